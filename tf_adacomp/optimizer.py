"""CompressedOptimizer: a Keras 3 optimizer wrapper that exchanges compressed gradients.

Modelled on Keras' ``LossScaleOptimizer``. In each replica it compresses the gradients
(residues are optimizer variables), exchanges the compact payloads with the strategy's
collectives (``collectives.replica_exchange``), decodes and sums them, and hands the sum
to the inner optimizer with the inner optimizer's own dense all-reduce switched off, so
no gradient-sized tensor crosses devices. It works without a strategy (compression is
applied locally, to study its effect on accuracy), under ``MirroredStrategy`` and under
``MultiWorkerMirroredStrategy``.

A step whose summed gradient is not finite (e.g. float16 overflow) changes nothing:
the residues are restored and the inner optimizer is not called.
"""

import keras
import tensorflow as tf
from keras.src.saving import serialization_lib

from tf_adacomp import collectives
from tf_adacomp import stats
from tf_adacomp.compressors import registry

_BASE_ARGUMENTS = ("weight_decay", "clipnorm", "global_clipnorm", "clipvalue", "use_ema",
                   "ema_momentum", "ema_overwrite_frequency", "loss_scale_factor",
                   "gradient_accumulation_steps")


@keras.saving.register_keras_serializable(package="tf_adacomp")
class CompressedOptimizer(keras.optimizers.Optimizer):
  """Wraps a Keras optimizer so that gradients are exchanged compressed.

  Args:
    inner_optimizer: the ``keras.optimizers.Optimizer`` that applies the summed
      gradients (its learning rate, schedule and slots are used as they are).
    compressor: a ``Compressor``, a registered name ("adacomp", "topk", "fp16", ...)
      or a serialized compressor. Default "adacomp".
    start_step: int >= 0; the first ``start_step`` steps exchange dense float32
      gradients (a warm-up) before compression begins. Residues stay zero meanwhile.
    name: optional name.

  Raises:
    TypeError: ``inner_optimizer`` is not a Keras optimizer.
    ValueError: unknown compressor, ``start_step`` < 0, or base optimizer arguments
      (set those on the inner optimizer).
  """

  def __init__(self, inner_optimizer, compressor="adacomp", start_step=0, name=None,
               **kwargs):
    for argument in _BASE_ARGUMENTS:
      # Keras passes the base defaults back when deserializing; anything else belongs to
      # the inner optimizer.
      value = kwargs.pop(argument, None)
      if value not in (None, False, 0.99):
        raise ValueError(f"CompressedOptimizer does not take `{argument}`: set it on the "
                         f"inner optimizer. Received: {argument}={value!r}")
    if kwargs:
      raise ValueError(f"CompressedOptimizer does not take arguments {sorted(kwargs)}. "
                       f"Received: {kwargs!r}")
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
      raise TypeError(f"`inner_optimizer` must be a keras.optimizers.Optimizer. "
                      f"Received: inner_optimizer={inner_optimizer!r}")
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
      raise ValueError(f"`start_step` must be an integer >= 0. Received: start_step={start_step!r}")
    super().__init__(learning_rate=0.0, name=name)
    self.inner_optimizer = inner_optimizer
    self.compressor = registry.get_compressor(compressor)
    self.start_step = start_step

  # --- Variables -------------------------------------------------------------------

  def build(self, var_list):
    self.plans = [self.compressor.plan(v.shape, v.dtype, v.path) for v in var_list]
    self.residues = []
    for variable, plan in zip(var_list, self.plans):
      self.residues.append(tuple(
          self._add_replica_variable(variable, spec, f"{variable.path.replace('/', '_')}_residue")
          for spec in self.compressor.state_specs(plan)))
    self.bytes_sent = self.add_variable(shape=(len(var_list),), dtype="int64",
                                        aggregation="only_first_replica", name="bytes_sent")
    self.inner_optimizer.build(var_list)
    # Keras' TensorFlow optimizers all-reduce gradients in `apply`. The wrapped one only
    # ever receives gradients already summed over replicas, so that second, dense
    # all-reduce is switched off (an instance attribute: replica threads share it).
    if hasattr(self.inner_optimizer, "_all_reduce_sum_gradients"):
      self.inner_optimizer._all_reduce_sum_gradients = _no_all_reduce  # pylint: disable=protected-access
    super().build(var_list)

  def _add_replica_variable(self, reference, spec, name):
    """A variable with one value per replica (each replica's residue is its own).

    ``on_read`` synchronization keeps a separate copy on every replica; ``sum``
    aggregation makes a checkpoint store the sum of the replicas' residues (the total
    not yet sent) and a restore split it evenly, so nothing is lost across a restore,
    whatever the number of replicas then.
    """
    with self._distribution_strategy.extended.colocate_vars_with(reference.value):
      with keras.name_scope(self.name, caller=self):
        variable = keras.Variable(initializer="zeros", shape=spec.shape, dtype=spec.dtype.name,
                                  trainable=False, aggregation="sum",
                                  synchronization="on_read", name=name)
    self._track_variable(variable)
    return variable

  @property
  def variables(self):
    return self._variables + self.inner_optimizer.variables

  # --- Applying gradients ----------------------------------------------------------

  def apply(self, grads, trainable_variables=None):
    if tf.distribute.in_cross_replica_context():
      raise ValueError("CompressedOptimizer.apply() must be called in a replica context.")
    if not self.built:
      with keras.name_scope(self.name, caller=self):
        self.build(trainable_variables)
      self.built = True
    if trainable_variables is None:
      trainable_variables = self._trainable_variables
    grads, trainable_variables = list(grads), list(trainable_variables)
    indices = [self._get_variable_index(v) for v in trainable_variables]
    plans = [self.plans[i] for i in indices]
    states = [tuple(tf.convert_to_tensor(r.value) for r in self.residues[i]) for i in indices]
    dense = self.iterations < self.start_step if self.start_step else None

    exchanged = collectives.replica_exchange(self.compressor, plans, grads, states, dense)
    present = [s for s in exchanged.sums if s is not None]
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(s)) for s in present]) if present \
        else tf.constant(True)
    for i, old, new in zip(indices, states, exchanged.states):
      for variable, old_value, new_value in zip(self.residues[i], old, new):
        variable.assign(tf.where(finite, new_value, old_value))
    self._record_bytes(indices, exchanged.nbytes)

    if tf.__internal__.distribute.strategy_supports_no_merge_call():
      tf.cond(finite, lambda: self._apply_summed(exchanged.sums, trainable_variables),
              lambda: tf.constant(False))
    else:
      def apply_in_cross_replica(distribution, sums, finite):
        # Every replica holds the same sums, hence the same `finite`.
        finite = distribution.experimental_local_results(finite)[0]

        def apply_everywhere():
          distribution.extended.call_for_each_replica(
              self._apply_summed, args=(sums, trainable_variables))
          return tf.constant(True)

        # A cond with a merge_call inside must be taken in cross-replica context.
        tf.cond(finite, apply_everywhere, lambda: tf.constant(False))

      tf.distribute.get_replica_context().merge_call(
          apply_in_cross_replica, args=(exchanged.sums, finite))

  def _record_bytes(self, indices, nbytes):
    values = tf.tensor_scatter_nd_update(
        tf.zeros([len(self.plans)], tf.int64), [[i] for i in indices],
        [tf.zeros([], tf.int64) if b is None else tf.cast(b, tf.int64) for b in nbytes])
    self.bytes_sent.assign(values)

  def _apply_summed(self, sums, trainable_variables):
    """The inner optimizer's step on gradients that are already summed over replicas."""
    self.inner_optimizer.apply(sums, trainable_variables)
    return tf.constant(True)

  # --- Forwarded to the inner optimizer -------------------------------------------

  @property
  def learning_rate(self):
    return self.inner_optimizer.learning_rate

  @learning_rate.setter
  def learning_rate(self, learning_rate):
    self.inner_optimizer.learning_rate = learning_rate

  @property
  def iterations(self):
    return self.inner_optimizer.iterations

  def scale_loss(self, loss):
    return self.inner_optimizer.scale_loss(loss)

  def finalize_variable_values(self, var_list):
    self.inner_optimizer.finalize_variable_values(var_list)

  # --- Statistics and serialization -----------------------------------------------

  def variable_bytes(self):
    """``[(plan, bytes one replica sent for that variable in the last step)]``."""
    if not self.built:
      return []
    return list(zip(self.plans, (int(b) for b in self.bytes_sent.numpy())))

  def compression_stats(self):
    """Bytes of the last step per variable kind and in total (see ``stats``)."""
    return stats.summarize(self.variable_bytes()) if self.built else {}

  def get_config(self):
    return {
        "name": self.name,
        "inner_optimizer": serialization_lib.serialize_keras_object(self.inner_optimizer),
        "compressor": registry.serialize(self.compressor),
        "start_step": self.start_step,
    }

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    inner = serialization_lib.deserialize_keras_object(config.pop("inner_optimizer"),
                                                       custom_objects=custom_objects)
    return cls(inner, **config)


def _no_all_reduce(grads_and_vars):
  return list(grads_and_vars)
