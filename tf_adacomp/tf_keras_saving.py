"""Saving and loading the tf_keras wrapper (``tf_adacomp.tf_keras.CompressedOptimizer``):
``set_weights`` and ``.h5`` / ``.keras`` files (the residues' sum, the inner optimizer's
step counter and slots, and each replica's own copies), checkpoints, and the SavedModel
that is refused (tf_keras' loader would drop the optimizer's state).

In an ``.h5`` file the copies are entries of their own after the optimizer's variables
(``h5_copies``): tf_keras' writer stores ``optimizer.variables`` and its loader hands
the stored values back, in that order, to ``set_weights``."""

import numpy as np
import tensorflow as tf
import tf_keras

from tf_adacomp import replica_state


class Saving:
  """The saving half of the tf_keras wrapper: it has ``variables``, ``name``,
  ``_built``, ``_distribution_strategy`` and ``_pending_state``."""

  @property
  def _replica_state(self):
    """Each replica's own copy of the per-replica state, as a ``.keras`` file keeps it
    (``tf_adacomp.replica_state``). tf_keras saves and loads an optimizer's attributes
    in reverse name order: this name comes after ``inner_optimizer``, whose entry holds
    the replicas' means. Empty before ``build`` and with one replica."""
    return FileCopies(self.variables if self._built else [])

  def set_weights(self, weights):
    """Sets the optimizer's state from values in the order of ``variables`` (the
    wrapper's, then the inner optimizer's), as tf_keras' ``.h5`` loader does.

    A residue takes the sum of the replicas' residues (what a save stores) and each
    replica of the strategy now present gets an even share of it; a slot kept per
    replica takes the replicas' mean, set on every replica.

    Args:
      weights: arrays (NumPy arrays, h5py datasets, tensors), one per variable.

    Raises:
      ValueError: the optimizer is not built; the number of values or a shape differs
        from the optimizer's and the values hold some state (all zeros, the step
        counter's included, is the state of an optimizer that never stepped: this one
        is left as it is).
    """
    if not self._built:
      raise ValueError(
          "CompressedOptimizer.set_weights() needs the optimizer built (its residues "
          "exist once it is): call optimizer.build(model.trainable_variables) first.")
    self._assign_state([np.asarray(w) for w in weights], "the values given to set_weights")

  def load_own_variables(self, store):
    """Restores the state a ``.keras`` (or ``.weights.h5``) file holds; tf_keras'
    ``load_model`` and ``load_weights`` call it. Before ``build`` (``load_weights``
    into a new model), the state is kept and set when the optimizer is built, at its
    first step.

    Args:
      store: the file's entries of this optimizer, ``"0"``, ``"1"``, ... in the order
        of ``variables``.

    Raises:
      ValueError: the file holds a different number of variables or other shapes than
        the built optimizer and some state (all zeros, the step counter's included, is
        the state of an optimizer that never stepped: this one is left as it is).
    """
    # Read now: the file is closed once the model is loaded.
    values = [np.asarray(store[str(i)]) for i in range(len(store.keys()))]
    source = "the file's state of this optimizer"
    if not self._built and len(values) > len(self.variables):
      self._pending_state = self._no_dependency((values, source))
      return
    self._assign_state(values, source)

  def _assign_state(self, values, source):
    """Sets ``variables`` from ``values`` (NumPy arrays, their saved cross-replica
    values) in order, then each replica's own copies where ``values`` ends with those
    of as many replicas (an ``.h5`` file's, ``h5_copies``), or refuses, naming what
    would be lost."""
    variables = self.variables
    values, copies = _split_copies(variables, values)
    if len(values) != len(variables):
      if not any(np.any(v) for v in values):
        return  # an optimizer saved before its first step: its state is the initial one
      raise ValueError(
          f"CompressedOptimizer {self.name!r} has {len(variables)} variables (residues, "
          f"bytes_sent, then the inner optimizer's) but {source} has {len(values)}: the "
          f"saved optimizer was built for other variables or with another compressor, "
          f"exchange or inner optimizer, and its step counter, slots and residues cannot "
          f"be restored. Load with compile=False and compile a new optimizer to start "
          f"afresh.")
    for variable, value in zip(variables, values):
      if tuple(variable.shape) != value.shape:
        raise ValueError(
            f"CompressedOptimizer {self.name!r}: variable {variable.name} has shape "
            f"{tuple(variable.shape)} but {source} holds shape {value.shape} for it.")
    replicas = self._distribution_strategy.num_replicas_in_sync
    for variable, value in zip(variables, values):
      set_every_replica(variable, value, replicas)
    per_replica = replica_state.per_replica(variables)
    if len(copies) == len(per_replica) and all(
        replica_state.fits(v, c.shape) for v, c in zip(per_replica, copies)):
      for variable, value in zip(per_replica, copies):
        replica_state.assign_copies(variable, value)
    # Else copies of another replica count (or none): the mean (or the split sum) stands.

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    """The wrapper's attributes (``inner_optimizer``, ``residues``, ``bytes_sent``) for a
    checkpoint; a SavedModel is refused.

    Raises:
      ValueError: for a SavedModel (``model.save(directory)``, ``tf.saved_model.save``).
    """
    if save_type == "savedmodel":
      raise ValueError(
          "A SavedModel (model.save(directory), tf.saved_model.save) cannot keep the "
          "state of tf_adacomp.tf_keras.CompressedOptimizer: tf_keras.models.load_model "
          "compiles the model again with a new optimizer from its config, so the inner "
          "optimizer's step counter (iterations) and slots and the residues (error "
          "feedback) it saved would be lost. Save to a file ending in .keras or .h5 "
          "(model.save('model.keras')), or use tf.train.Checkpoint / save_weights for the "
          "training state; model.save(directory, include_optimizer=False) or "
          "model.export(directory) saves the model alone, for inference.")
    # Not tf_keras' Optimizer._trackable_children: it keeps the first answer, given
    # before `build` when a checkpoint is restored into a new optimizer, and a later
    # save would then hold neither the residues nor bytes_sent.
    children = tf.__internal__.tracking.AutoTrackable._trackable_children  # pylint: disable=protected-access
    return children(self, save_type, **kwargs)


class FileCopies(replica_state.FileCopiesMixin, tf_keras.losses.Loss):
  """``replica_state.FileCopiesMixin`` for tf_keras' ``.keras`` saving, which visits
  only layers, optimizers, metrics and losses among an object's attributes: a Loss that
  computes nothing.

  Args:
    variables: the optimizer's variables (those that ``is_per_replica`` are kept).
  """

  def __init__(self, variables):
    super().__init__(name="replica_state")
    self._set_copied(variables)

  def call(self, y_true, y_pred):
    raise NotImplementedError("The per-replica state of a file is not a loss.")


def set_every_replica(variable, value, replicas):
  """Sets each replica's copy of ``variable`` from ``value``, its saved cross-replica
  value: an even share of it for a variable summed on read (a residue), ``value``
  itself for the others.

  Copy by copy, not ``variable.assign``: ``build`` (which sets a state loaded before
  it) may run in a replica context, where ``assign`` of an on-read variable sets that
  replica's copy alone; and a loader's h5py dataset cannot be divided over replicas."""
  if (variable.synchronization == tf.VariableSynchronization.ON_READ
      and variable.aggregation == tf.VariableAggregation.SUM):
    value = value / replicas
  value = value.astype(variable.dtype.as_numpy_dtype)
  if isinstance(variable, tf.distribute.DistributedValues):
    for copy in variable.values:
      copy.assign(value)
  else:
    variable.assign(value)


class _H5Entry:
  """What tf_keras' ``.h5`` writer reads of an entry of ``optimizer.variables``."""

  def __init__(self, name, value):
    self.name = name
    self._value = value

  def numpy(self):
    return self._value


H5_COPIES_NAME = "replica_copies"


def h5_copies(variables):
  """Entries for tf_keras' ``.h5`` writer: for each variable of ``variables`` that
  ``replica_state.is_per_replica``, in order, its copies ``[replicas, *shape]``, named
  ``replica_copies_<i>`` (none with one replica)."""
  return [_H5Entry(f"{H5_COPIES_NAME}_{i}", replica_state.copies(v).numpy())
          for i, v in enumerate(replica_state.per_replica(variables))]


def _split_copies(variables, values):
  """``values`` as (one per variable, the copies after them): the values beyond
  ``variables`` are an ``.h5`` file's copies when there is one for each variable that
  keeps them, of its shape with a leading replica axis; else nothing is split off (and
  the count check refuses the values)."""
  extra = values[len(variables):]
  if not extra:
    return values, []
  kinds = [v for v in variables if replica_state.is_kept_per_replica(v)]
  if len(extra) != len(kinds) or any(
      e.ndim != len(v.shape) + 1 or tuple(e.shape[1:]) != tuple(v.shape)
      for e, v in zip(extra, kinds)):
    return values, []
  return values[:len(variables)], extra
