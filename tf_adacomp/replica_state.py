"""Each replica's own copy of a per-replica state, across a save and a load.

Under the update exchange every replica keeps state of its own: the inner optimizer's
slots (Adam's moments, momentum; ``on_read``, ``mean`` aggregation), the residues
(``on_read``, ``sum``) and Adam's moment of m^2 (``second_moment="global"``). TensorFlow
saves such a variable as its cross-replica value, the mean (or the sum) of the copies,
and a restore gives every replica that mean (or an even share of the sum): a state that
is not the same on every replica comes back changed, and with Adam the resumed run is
no longer the one that was saved.

The rule of this module, the one home of it for both optimizer wrappers:

- A save keeps, besides each such variable's usual (aggregated) value, every replica's
  copy: one tensor ``[replicas, *shape]``, in global replica order (the replicas of
  every worker: gathered across workers under ``MultiWorkerMirroredStrategy``).
- A load onto as many replicas (in all) as saved gives each replica its own copy back,
  exactly. A load onto another replica count, or of a file or checkpoint written
  before this module (without the copies), keeps the aggregated value: the mean on
  every replica, or the sum split evenly (the documented restore onto another count).

Where the copies go:

- ``tf.train.Checkpoint``: a child ``replica_copies`` of the variable itself
  (``attach``), whose one tensor holds the copies. The variable's own value is
  restored first: a restore visits the object graph breadth first and restores a
  parent before its child in the same batch, and a variable made after the restore
  started (a deferred restore, the optimizer built later) gets its value when it is
  made, before ``attach`` adds the child, whose restore is then deferred to that moment.
  A checkpoint without the child restores the value alone.
- Keras 3 ``.keras`` (``model.save``): ``FileCopies``, one more entry of the file
  (``optimizer/replica_state``), stacked copies keyed by the variable's position in the
  list, loaded after the inner optimizer's own entry (Keras loads attributes in name
  order, ``inner_optimizer`` before ``replica_state``), so that its means do not
  overwrite the copies.

The cost: a checkpoint or file holds, for each per-replica variable, ``replicas`` more
copies besides the aggregated value (one value per replica cannot be rebuilt exactly
from the mean and the other copies in float arithmetic). Variables equal on every
replica (the weights, the step counters, the shared second moment, anchors) are stored
once, as before; with one replica nothing is added.
"""

from typing import List, Sequence

import numpy as np
import tensorflow as tf

from tf_adacomp.compat import internals

# The name of the child that holds a variable's copies in a tf.train.Checkpoint, and of
# its one tensor.
CHILD = "replica_copies"
KEY = "copies"


def _distributed(variable):
  """The ``tf.distribute`` variable behind ``variable`` (a Keras 3 variable wraps one)."""
  inner = getattr(variable, "value", None)
  if isinstance(inner, tf.distribute.DistributedValues):
    return inner
  return variable


def is_per_replica(variable) -> bool:
  """Whether ``variable`` holds one value per replica that may differ across replicas:
  ``on_read`` with ``sum`` or ``mean`` aggregation, under a strategy of 2+ replicas.

  Args:
    variable: a ``tf.Variable`` or a Keras 3 variable.

  Returns:
    True for a variable whose copies a save must keep one by one.
  """
  values = _distributed(variable)
  if not isinstance(values, tf.distribute.DistributedValues) or not is_kept_per_replica(values):
    return False
  return values.distribute_strategy.num_replicas_in_sync > 1


def is_kept_per_replica(variable) -> bool:
  """Whether ``variable`` is of the kind whose copies a save of 2+ replicas keeps
  (``on_read``, ``sum`` or ``mean`` aggregation), whatever the number of replicas now.

  Args:
    variable: a ``tf.Variable``, a ``tf.distribute`` variable or a Keras 3 variable.

  Returns:
    True for such a variable.
  """
  values = _distributed(variable)
  return (getattr(values, "synchronization", None) == tf.VariableSynchronization.ON_READ
          and getattr(values, "aggregation", None) in (tf.VariableAggregation.SUM,
                                                       tf.VariableAggregation.MEAN))


def per_replica(variables: Sequence) -> List:
  """The variables of ``variables`` that ``is_per_replica`` (in order)."""
  return [v for v in variables if is_per_replica(v)]


def _strategy(values):
  return values.distribute_strategy


def _local_replica_ids(values) -> List[int]:
  """The global replica ids of the local copies ``values.values``, in their order."""
  strategy = _strategy(values)
  local = len(values.values)
  if strategy.num_replicas_in_sync == local:
    return list(range(local))
  # Several workers: each holds the copies of its own replicas. The ids, as the
  # strategy numbers them (this is called in cross-replica context: save, restore).
  ids = strategy.experimental_local_results(
      strategy.experimental_distribute_values_from_function(
          lambda context: tf.constant(context.replica_id_in_sync_group)))
  return [int(i) for i in ids]


def copies(variable) -> tf.Tensor:
  """Every replica's copy of ``variable``, stacked in global replica order, on the host.

  Under several workers the copies are gathered from all of them (a collective: every
  worker saves, as it must for the variable's own aggregated value).

  Args:
    variable: a variable that ``is_per_replica``.

  Returns:
    A tensor of shape ``[replicas, *variable.shape]``.
  """
  values = _distributed(variable)
  strategy = _strategy(values)
  components = list(values.values)
  ids = _local_replica_ids(values)
  if strategy.num_replicas_in_sync == len(components):
    with tf.device("/cpu:0"):
      ordered = [None] * len(components)
      for i, component in zip(ids, components):
        ordered[i] = component.read_value()
      return tf.stack(ordered)
  by_id = dict(zip(ids, components))
  mine = strategy.experimental_distribute_values_from_function(
      lambda context: tf.expand_dims(
          by_id[context.replica_id_in_sync_group].read_value(), 0))
  gathered = strategy.gather(mine, axis=0)
  with tf.device("/cpu:0"):
    return tf.identity(gathered)


def fits(variable, saved_shape) -> bool:
  """Whether copies of shape ``saved_shape`` were saved from as many replicas as
  ``variable`` has now, for a variable of this shape (else the aggregated value
  stands)."""
  values = _distributed(variable)
  expected = [_strategy(values).num_replicas_in_sync] + list(values.shape)
  return [int(d) for d in saved_shape] == expected


def assign_copies(variable, saved):
  """Gives each replica its own saved copy of ``variable``.

  Args:
    variable: a variable that ``is_per_replica``.
    saved: ``[replicas, *shape]`` (a tensor or a NumPy array), as ``copies`` gives it;
      nothing is assigned unless ``fits(variable, saved.shape)``.

  Returns:
    Whether the copies were assigned.
  """
  if not fits(variable, saved.shape):
    return False
  values = _distributed(variable)
  saved = tf.convert_to_tensor(saved, dtype=values.dtype)
  # Copy by copy: in a replica context (a deferred restore during `build`) `assign` of
  # an on-read variable would set that replica's copy alone.
  for i, component in zip(_local_replica_ids(values), values.values):
    with tf.device(component.device):
      component.assign(saved[i])
  return True


def spread(saved, count: int) -> List[tf.Tensor]:
  """This module's rule for stacked saved copies restored onto ``count`` holders
  (``CompressedAllReduce`` keeps its per-device residues this way): as many as saved,
  each its own copy; another count, a floating state's saved total (summed in saved
  order, as the exchange sums) split evenly, an integer state's first copy to every one.

  Args:
    saved: ``[saved holders, *shape]``.
    count: how many holders there are now.

  Returns:
    ``count`` tensors of ``shape``.
  """
  saved_count = saved.shape[0]
  if saved_count == count:
    return [saved[d] for d in range(count)]
  if not saved.dtype.is_floating:
    return [saved[0]] * count
  total = saved[0]
  for d in range(1, saved_count):
    total += saved[d]
  return [total / count] * count


class _CheckpointCopies(tf.__internal__.tracking.Trackable):
  """A variable's copies in a ``tf.train.Checkpoint``: one tensor ``copies``.

  A child of the variable (``attach``), restored after it (the module docstring)."""

  def __init__(self, variable):
    self._variable = variable

  def _serialize_to_tensors(self):
    if not tf.executing_eagerly() and not tf.inside_function():
      # A SavedModel's export graph (tf.saved_model.save of a model that holds the
      # optimizer), where the variables are copies this object does not know: a
      # SavedModel is for serving, and its loader restores no optimizer replicas.
      return {}
    return {KEY: copies(self._variable)}

  def _restore_from_tensors(self, restored_tensors):
    if KEY in restored_tensors:
      assign_copies(self._variable, restored_tensors[KEY])
    return tf.no_op()


def attach(variables: Sequence) -> None:
  """Makes ``tf.train.Checkpoint`` keep every replica's copy of each per-replica
  variable of ``variables`` (the others are left as they are); once per variable.

  Call it after the variables are made and tracked (end of the optimizer's ``build``):
  a restore under way gives each its value first, then its copies.

  Args:
    variables: ``tf.Variable`` or Keras 3 variables (the objects in the checkpoint's
      object graph).
  """
  for variable in per_replica(variables):
    if internals.checkpoint_child(variable, CHILD) is None:
      internals.add_checkpoint_child(variable, CHILD, _CheckpointCopies(variable))


class FileCopiesMixin:
  """The copies of per-replica variables in a ``.keras`` file: entry ``str(i)`` holds the
  stacked copies of the ``i``-th variable of ``variables`` that ``is_per_replica``. An
  attribute of the optimizer named so that Keras loads it after the inner optimizer (the
  module docstring); the Keras 3 (``FileCopies``) and the tf_keras wrapper
  (``tf_keras.py``) each make it an object their Keras saves."""

  def _set_copied(self, variables: Sequence):
    self._copied = per_replica(variables)

  def save_own_variables(self, store):
    """Writes each per-replica variable's stacked copies (nothing with one replica).

    Args:
      store: the file's entry of this object.
    """
    for i, variable in enumerate(self._copied):
      store[str(i)] = copies(variable).numpy()

  def load_own_variables(self, store):
    """Gives each replica its own copy where the file holds copies of as many replicas
    (and as many variables, of the same shapes); else leaves the aggregated values the
    optimizer's entry restored.

    Args:
      store: the file's entry of this object (empty in a file written before it).
    """
    keys = list(store.keys())
    if len(keys) != len(self._copied):
      return  # a file without copies (older, or one replica), or of another optimizer
    saved = [np.asarray(store[str(i)]) for i in range(len(keys))]
    if not all(fits(v, s.shape) for v, s in zip(self._copied, saved)):
      return  # another replica count: the mean (or the split sum) stands
    for variable, value in zip(self._copied, saved):
      assign_copies(variable, value)


class FileCopies(FileCopiesMixin, internals.keras_saveable_class()):
  """``FileCopiesMixin`` for Keras 3's ``.keras`` saving (a ``KerasSaveable``).

  Args:
    variables: the optimizer's variables (those that ``is_per_replica`` are kept).
  """

  def __init__(self, variables: Sequence):
    self._set_copied(variables)

  def _obj_type(self):
    # One of the kinds Keras' saving knows (it refuses others); "Loss" makes it skip
    # the attributes of a plain Loss, none of which this object has.
    return "Loss"
