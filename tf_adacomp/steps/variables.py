"""The Keras 3 wrapper's own variables with one value per replica: residues, and the
state of the exchange modes (shared moments, anchors)."""

import keras
import tensorflow as tf


def variable_path(variable):
  """A Keras variable's ``path``; a plain ``tf.Variable`` (no ``path``) its ``name``, as
  Keras' ``add_variable_from_reference`` names the slots of either."""
  return getattr(variable, "path", None) or variable.name


class Maker:
  """Makes variables of ``optimizer`` (a ``keras.optimizers.Optimizer``, which tracks
  them), each beside the variable it belongs to and named after it."""

  def __init__(self, optimizer):
    self.optimizer = optimizer

  def one(self, reference, spec, suffix, aggregation=None, saved=True):
    """A variable with one value per replica (each replica's residue is its own), named
    after ``reference`` and ``suffix``; ``saved=False``: not tracked by the optimizer,
    so no checkpoint or saved model holds it (a value that means nothing in another
    process, such as a time stamp).

    ``on_read`` synchronization keeps a separate copy on every replica. A floating
    state (a residue) has ``sum`` aggregation: a checkpoint stores the sum of the
    replicas' residues (the total not yet sent) and a restore splits it evenly, so
    nothing is lost across a restore, whatever the number of replicas then (onto as
    many replicas, each gets its own back: ``tf_adacomp.replica_state``). An integer
    state (the FFT compressor's step counter) is the same on every replica: a checkpoint
    stores the first replica's and a restore gives it to every replica (summed, a restore
    with fewer replicas would move the theta schedule forward;
    tests/test_optimizer_restore.py). ``aggregation="mean"`` is for a value of each
    replica's own whose mean is what counts (Adam's moment of m^2), and
    ``"only_first_replica"`` for a float equal on every replica (an anchor, the shared
    second moment).
    """
    optimizer = self.optimizer
    name = variable_path(reference).replace("/", "_").replace(":", "_") + "_" + suffix
    # A plain tf.Variable (which Keras' optimizers accept too) is its own tf.Variable.
    colocate_with = reference.value if isinstance(reference, keras.Variable) else reference
    if aggregation is None:
      aggregation = "sum" if spec.dtype.is_floating else "only_first_replica"
    with optimizer._distribution_strategy.extended.colocate_vars_with(colocate_with):  # pylint: disable=protected-access
      with keras.name_scope(optimizer.name, caller=optimizer):
        variable = keras.Variable(initializer="zeros", shape=spec.shape, dtype=spec.dtype.name,
                                  trainable=False, aggregation=aggregation,
                                  synchronization="on_read", name=name)
    if saved:
      optimizer._track_variable(variable)  # pylint: disable=protected-access
    return variable

  def like(self, var_list, suffix, aggregation="mean"):
    """One float variable per variable of ``var_list``, a value per replica, stored as
    the replicas' mean (``one``); with ``"only_first_replica"``, for a value equal on
    every replica, as the first replica's (a mean of equal float32 copies is not always
    the value itself)."""
    return [self.one(v, tf.TensorSpec(v.shape, v.dtype), suffix, aggregation=aggregation)
            for v in var_list]
