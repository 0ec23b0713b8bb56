"""How an exchange mode reaches the inner optimizer: one adapter per wrapper.

A mode (``steps.gradients``, ``steps.updates``, ...) needs five things of the inner
optimizer, and the two wrappers differ only there:

- ``optimizer``: the inner optimizer itself (its ``iterations``, slots, settings);
- ``step(grads, variables)``: its step on gradients summed already (its own all-reduce
  is switched off by the wrapper);
- ``own_step(grads, variables)``: its step on this replica's own gradient, clipped to
  ``local_clipnorm`` first;
- ``own_gradient(grad, replicas)``: this replica's own mean gradient from what Keras
  hands the wrapper (its loss divided by the replica count);
- ``keeps_slices``: whether it steps on an Embedding's ``IndexedSlices`` as they are.
"""

import tensorflow as tf

from tf_adacomp import ema
from tf_adacomp import replica_steps
from tf_adacomp.compat import internals
from tf_adacomp.compat import patches
from tf_adacomp.steps.arguments import BASE_DEFAULTS


def build(optimizer, var_list, per_replica, outer_optimizer="average"):
  """Builds a Keras 3 inner optimizer (and outer optimizer) for the wrapper.

  Args:
    optimizer: the inner optimizer.
    var_list: the variables it steps.
    per_replica: whether each replica steps it with its own state (the update
      exchange): its slots then hold one value per replica (on-read, as the residues),
      a checkpoint stores their mean rather than replica 0's copy, and each replica's
      copy beside it (``tf_adacomp.replica_state``).
    outer_optimizer: "average" or a Keras optimizer: its state is the same on every
      replica (it steps the anchor, which is), and it is handed pseudo-gradients that
      are means already.
  """
  if not isinstance(outer_optimizer, str):
    outer_optimizer.build(var_list)
    patches.patch_instance(outer_optimizer, internals.ALL_REDUCE_SUMMED, no_all_reduce)
  if per_replica:
    with tf.variable_creator_scope(replica_steps.one_value_per_replica):
      optimizer.build(var_list)
  else:
    optimizer.build(var_list)
  if optimizer.use_ema:
    # Its average follows the exchanged weights, not each replica's own (tf_adacomp.ema).
    ema.defer(optimizer)
  # Keras' TensorFlow optimizers all-reduce gradients in `apply`. The wrapped one only
  # ever receives gradients already summed over replicas, so that second, dense
  # all-reduce is switched off (an instance attribute: replica threads share it).
  patches.patch_instance(optimizer, internals.ALL_REDUCE_SUMMED, no_all_reduce)


def no_all_reduce(grads_and_vars):
  """The inner optimizer's all-reduce, switched off: its gradients are summed already."""
  return list(grads_and_vars)


class KerasInner:
  """A Keras 3 inner optimizer (``tf_adacomp.optimizer``).

  Args:
    optimizer: the built inner ``keras.optimizers.Optimizer``.
    local_clipnorm: None or the float each replica's own gradient is clipped to.
  """

  keeps_slices = True

  def __init__(self, optimizer, local_clipnorm=None):
    self.optimizer = optimizer
    self.local_clipnorm = local_clipnorm

  def step(self, grads, variables):
    """Its step on ``grads``: summed (or Adasum-combined) over the replicas, or this
    replica's own (each replica steps its own copy). Returns True (a cond branch)."""
    with ema.deferred():  # its EMA follows the exchange (wrapper's apply)
      self.optimizer.apply(grads, variables)
    return tf.constant(True)

  def clip(self, grads, replicas=1):
    """``grads`` clipped so that each replica's own mean gradient, ``grads * replicas``,
    has a global norm of at most ``local_clipnorm`` (as they are without one). Dense
    afterwards, as Keras' ``global_clipnorm`` makes an ``IndexedSlices``."""
    if self.local_clipnorm is None:
      return grads
    return replica_steps.clip_by_global_norm(grads, self.local_clipnorm / replicas)

  def own_step(self, grads, variables):
    """Its step on this replica's own gradient, clipped to ``local_clipnorm`` first. The
    clip is traced beside the step, as Keras' ``global_clipnorm`` clips in ``apply``:
    TensorFlow's graph optimizer (its arithmetic optimizer reorders a chain of scalings
    such as the clip's and SGD's learning rate) then rewrites both alike, and one
    replica is the inner optimizer with ``global_clipnorm`` bit for bit."""
    return self.step(self.clip(grads), variables)

  @staticmethod
  def own_gradient(grad, replicas):
    """``grad * replicas``; an ``IndexedSlices`` kept as one (its values scaled), so that
    the inner optimizer steps on it as Keras would."""
    if grad is None:
      return None
    if isinstance(grad, tf.IndexedSlices):
      values = grad.values if replicas == 1 else grad.values * replicas
      return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return tf.convert_to_tensor(grad) * replicas


class TfKerasInner(KerasInner):
  """A tf_keras inner optimizer (``tf_adacomp.tf_keras``): its ``apply_gradients``
  without aggregation, and an Embedding's slices made dense (Horovod's
  ``sparse_as_dense=True``, always)."""

  keeps_slices = False

  def step(self, grads, variables):
    self.optimizer.apply_gradients(list(zip(grads, variables)),
                                   experimental_aggregate_gradients=False)
    return tf.constant(True)

  @staticmethod
  def own_gradient(grad, replicas):
    return None if grad is None else tf.convert_to_tensor(grad) * replicas


class InnerSetting:
  """A data descriptor: the base optimizer setting of this name is the inner optimizer's.

  Keras' base class writes and reads these on the wrapper too: its ``__init__`` writes the
  defaults before there is an inner optimizer (ignored: the wrapper refused any other
  value), and its ``build`` reads ``gradient_accumulation_steps`` to create accumulators,
  which only the inner optimizer needs; while ``_reading_own_settings`` is set the
  wrapper's own default is read instead.
  """

  def __set_name__(self, owner, name):
    self.name = name  # pylint: disable=attribute-defined-outside-init

  def __get__(self, wrapper, owner=None):
    if wrapper is None:
      return self
    inner = wrapper.__dict__.get("inner_optimizer")
    if inner is None or wrapper.__dict__.get("_reading_own_settings"):
      return BASE_DEFAULTS.get(self.name)
    return getattr(inner, self.name)

  def __set__(self, wrapper, value):
    inner = wrapper.__dict__.get("inner_optimizer")
    if inner is not None:
      setattr(inner, self.name, value)


class Forwarding:
  """What both wrappers forward to their ``inner_optimizer``: its learning rate (read
  and set) and its step counter (a skipped step does not count)."""

  @property
  def learning_rate(self):
    return self.inner_optimizer.learning_rate

  @learning_rate.setter
  def learning_rate(self, learning_rate):
    self.inner_optimizer.learning_rate = learning_rate

  @property
  def iterations(self):
    """The inner optimizer's step counter (a skipped step does not count)."""
    return self.inner_optimizer.iterations

  @iterations.setter
  def iterations(self, variable):  # tf_keras' loaders set it
    self.inner_optimizer.iterations = variable
