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

With ``reduction="adasum"`` the replicas' contributions are combined with Adasum
(``ops.adasum_reduce``) instead of added, in one of two modes:

- ``adasum_mode="gradient"``: Adasum of the replicas' own mean gradients (each replica's
  gradient times the replica count, since Keras divides every replica's loss by it),
  handed to the inner optimizer;
- ``adasum_mode="delta"`` (Horovod's): each replica first takes the inner optimizer's step
  on its own mean gradient, with its own optimizer state (momentum, Adam moments: each
  replica keeps its own copy, and a checkpoint saves replica 0's); the updates
  ``delta = weights after - weights before`` are compressed (with residues), exchanged
  and combined with Adasum, and every replica sets ``weights = before + Adasum(deltas)``.
  A step whose gradients are not finite on some replica changes nothing; a combined
  update that is not finite leaves weights and residues as they were, but the inner
  optimizers' states have taken their step.
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
ADASUM_MODES = ("gradient", "delta")


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
    reduction: "sum" (default) or "adasum": how the replicas' contributions combine.
    adasum_mode: with ``reduction="adasum"``, "gradient" (default: Adasum of gradients)
      or "delta" (Adasum of each replica's optimizer update; see the module docstring).
    name: optional name.

  Raises:
    TypeError: ``inner_optimizer`` is not a Keras optimizer.
    ValueError: unknown compressor, reduction or adasum_mode, ``start_step`` < 0, or
      base optimizer arguments (set those on the inner optimizer).
  """

  def __init__(self, inner_optimizer, compressor="adacomp", start_step=0, name=None,
               reduction="sum", adasum_mode="gradient", **kwargs):
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
    reduction = collectives.check_reduction(reduction)
    if adasum_mode not in ADASUM_MODES:
      raise ValueError(f"`adasum_mode` must be one of {ADASUM_MODES}. "
                       f"Received: adasum_mode={adasum_mode!r}")
    compressor = registry.get_compressor(compressor)
    super().__init__(learning_rate=0.0, name=name)
    self.inner_optimizer = inner_optimizer
    self.compressor = compressor
    self.start_step = start_step
    self.reduction = reduction
    self.adasum_mode = adasum_mode

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

    if self.reduction == "adasum" and self.adasum_mode == "delta":
      self._apply_adasum_of_deltas(grads, trainable_variables, indices, plans, states, dense)
      return
    exchanged = collectives.replica_exchange(self.compressor, plans, grads, states, dense,
                                             reduction=self.reduction)
    sums = exchanged.sums
    if self.reduction == "adasum":
      # Adasum of the replicas' own mean gradients: Keras divides each replica's loss by
      # the replica count, and Adasum(c * g) = c * Adasum(g).
      replicas = tf.distribute.get_replica_context().num_replicas_in_sync
      sums = [None if s is None else s * replicas for s in sums]
    finite = _all_finite(sums)
    self._keep_states(indices, states, exchanged.states, finite)
    self._record_bytes(indices, exchanged.nbytes)
    self._on_every_replica_if(
        finite, lambda summed: self._apply_inner(summed, trainable_variables), sums)

  def _apply_adasum_of_deltas(self, grads, variables, indices, plans, states, dense):
    """Horovod's Adasum: local optimizer steps, then Adasum of the weight updates."""
    ctx = tf.distribute.get_replica_context()
    replicas = ctx.num_replicas_in_sync
    own = [None if g is None else g * replicas for g in grads]  # this replica's mean gradient
    # Every replica must take the same branch: step only if all gradients are finite.
    bad = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                         tf.cast(tf.logical_not(_all_finite(own)), tf.float32))
    stepped = tf.equal(bad, 0.0)
    before = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
    with tf.control_dependencies(before):
      self._on_every_replica_if(
          stepped, lambda local: self._apply_inner(local, variables), own)
    # Automatic control dependencies order these reads after the local step.
    deltas = [None if g is None else tf.convert_to_tensor(v) - b
              for g, v, b in zip(grads, variables, before)]
    exchanged = collectives.replica_exchange(self.compressor, plans, deltas, states, dense,
                                             reduction="adasum")
    finite = tf.logical_and(stepped, _all_finite(exchanged.sums))
    self._keep_states(indices, states, exchanged.states, finite)
    self._record_bytes(indices, exchanged.nbytes)
    pairs = [(v, tf.where(finite, b + tf.cast(s, b.dtype), b))
             for v, b, s in zip(variables, before, exchanged.sums) if s is not None]
    self._assign_on_every_replica([v for v, _ in pairs], [x for _, x in pairs])

  def _keep_states(self, indices, old_states, new_states, finite):
    """Stores the compressor states of a finite step; keeps the old ones otherwise."""
    for i, old, new in zip(indices, old_states, new_states):
      for variable, old_value, new_value in zip(self.residues[i], old, new):
        variable.assign(tf.where(finite, new_value, old_value))

  def _on_every_replica_if(self, flag, fn, values):
    """Calls ``fn(values)`` in every replica if ``flag`` (the same on every replica).

    ``fn`` may call the inner optimizer, whose updates need a merge_call under
    MirroredStrategy: a cond around a merge_call must be taken in cross-replica context.
    """
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
      tf.cond(flag, lambda: fn(values), lambda: tf.constant(False))
      return

    def in_cross_replica(distribution, values, flag):
      flag = distribution.experimental_local_results(flag)[0]

      def everywhere():
        distribution.extended.call_for_each_replica(fn, args=(values,))
        return tf.constant(True)

      tf.cond(flag, everywhere, lambda: tf.constant(False))

    tf.distribute.get_replica_context().merge_call(in_cross_replica, args=(values, flag))

  def _assign_on_every_replica(self, variables, values):
    """Sets every copy of each variable to this replica's value (equal on all replicas)."""
    def assign(distribution, values):
      for variable, value in zip(variables, values):
        distribution.extended.update(
            variable.value if isinstance(variable, keras.Variable) else variable,
            lambda var, x: var.assign(x), args=(value,), group=False)

    tf.__internal__.distribute.interim.maybe_merge_call(
        assign, self._distribution_strategy, values)

  def _record_bytes(self, indices, nbytes):
    values = tf.tensor_scatter_nd_update(
        tf.zeros([len(self.plans)], tf.int64), [[i] for i in indices],
        [tf.zeros([], tf.int64) if b is None else tf.cast(b, tf.int64) for b in nbytes])
    self.bytes_sent.assign(values)

  def _apply_inner(self, grads, trainable_variables):
    """The inner optimizer's step on ``grads``: summed (or Adasum-combined) over the
    replicas, or in delta mode this replica's own (each replica steps its own copy)."""
    self.inner_optimizer.apply(grads, trainable_variables)
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
        "reduction": self.reduction,
        "adasum_mode": self.adasum_mode,
    }

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    inner = serialization_lib.deserialize_keras_object(config.pop("inner_optimizer"),
                                                       custom_objects=custom_objects)
    return cls(inner, **config)


def _all_finite(tensors):
  """Scalar bool: every tensor (None entries aside) is finite."""
  present = [t for t in tensors if t is not None]
  if not present:
    return tf.constant(True)
  return tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in present])


def _no_all_reduce(grads_and_vars):
  return list(grads_and_vars)
