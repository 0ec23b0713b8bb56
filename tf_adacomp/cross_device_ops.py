"""CompressedAllReduce: a ``tf.distribute.CrossDeviceOps`` that reduces compressed.

    strategy = tf.distribute.MirroredStrategy(
        cross_device_ops=tf_adacomp.CompressedAllReduce(tf_adacomp.AdaComp()))

Every all-reduce of the strategy's replicas (Keras' gradient all-reduce in
``model.fit``, ``ReplicaContext.all_reduce`` in a custom loop, ``strategy.reduce``)
goes through it: floating-point tensors are compressed on their own device, with one
residue per device and per tensor kept across steps, only the compact payloads are
copied to the destination devices, and each destination decodes and sums them in
device order (bit-identical on every device). IndexedSlices, integer tensors and
tensors without a static shape are reduced exactly (uncompressed).

With ``reduction="adasum"`` the devices' decoded tensors are combined with Adasum
(``ops.adasum_reduce``) instead of added: a MEAN reduction returns their Adasum (equal tensors
give their mean, orthogonal ones their sum) and a SUM reduction the number of devices
times it (equal tensors give their sum, as SUM would). Keras' gradient all-reduce is a SUM
of per-replica gradients each scaled by 1/replicas, so under ``model.fit`` this is the
Adasum of the replicas' own mean gradients, as Horovod applies it. Scalars (losses,
metric totals and counts) are still summed exactly: for three or more devices Adasum of
scalars is not their sum, and Adasum is meant for gradients.

Residues are keyed by the position of a tensor in its reduction and its shape and dtype;
a training step must reduce its gradients in the same order every step, as Keras and
the usual custom loops do. They live in this object, which is a ``tf.Module``: add it to
a ``tf.train.Checkpoint`` to save and restore them (``model.save`` does not see them; use
``CompressedOptimizer`` if they must travel with a Keras model).
"""

import copy

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.ops import resource_variable_ops

from tf_adacomp import collectives
from tf_adacomp import stats
from tf_adacomp.compressors import registry
from tf_adacomp.ops import adacomp as adacomp_ops
from tf_adacomp.ops import adasum as adasum_ops


class CompressedAllReduce(cross_device_ops_lib.CrossDeviceOps, tf.Module):
  """Cross-device reduction of compressed payloads, for ``MirroredStrategy``.

  Args:
    compressor: a ``Compressor``, a registered name or a serialized compressor.
      Default "adacomp".
    start_step: int >= 0; each tensor's first ``start_step`` reductions are exact
      (a dense warm-up) before compression begins.
    min_size: if given, overrides the compressor's ``min_size``: tensors with fewer
      elements are reduced dense.
    reduction: "sum" (default) or "adasum": how the devices' decoded tensors combine
      (see the module docstring).

  Raises:
    ValueError: unknown compressor or reduction, ``start_step`` < 0 or ``min_size`` < 0.
  """

  def __init__(self, compressor="adacomp", start_step: int = 0, min_size=None,
               reduction: str = "sum"):
    cross_device_ops_lib.CrossDeviceOps.__init__(self)
    tf.Module.__init__(self, name="compressed_all_reduce")
    compressor = registry.get_compressor(compressor)
    if min_size is not None:
      config = registry.serialize(compressor)
      config["config"]["min_size"] = min_size
      compressor = registry.get_compressor(config)
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
      raise ValueError(f"`start_step` must be an integer >= 0. Received: start_step={start_step!r}")
    self.compressor = compressor
    self.start_step = start_step
    self.reduction = collectives.check_reduction(reduction)
    self._exact = cross_device_ops_lib.ReductionToOneDevice()
    self.residues = {}   # key -> [per device: [state variables]]
    self.steps = {}      # key -> int64 variable: reductions done
    self.nbytes = {}     # key -> int64 variable: bytes one device sent last time
    self._plans = {}     # key -> TensorPlan (static, not checkpointed)

  def __deepcopy__(self, memo):
    # Strategies deep-copy their cross-device ops; the copy starts with no residues.
    result = CompressedAllReduce(copy.deepcopy(self.compressor, memo), self.start_step,
                                 reduction=self.reduction)
    memo[id(self)] = result
    return result

  # --- tf.distribute.CrossDeviceOps ------------------------------------------------

  def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
    return self.batch_reduce_implementation(
        reduce_op, [(per_replica_value, destinations)], options)[0]

  def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
    results = []
    for index, (value, destinations) in enumerate(value_destination_pairs):
      if _compressible(value) and not (self.reduction == "adasum" and _scalar(value)):
        key = _key(len(value_destination_pairs), index, value.values[0])
        results.append(self._reduce(reduce_op, value, destinations, key))
      else:
        results.append(self._exact.reduce(reduce_op, value, destinations, options))
    return results

  def _gather_implementation(self, per_replica_value, destinations, axis, options):
    return self._exact._gather(per_replica_value, destinations, axis, options)  # pylint: disable=protected-access

  # --- The compressed reduction -----------------------------------------------------

  def _reduce(self, reduce_op, value, destinations, key):
    components = value.values
    first = components[0]
    plan = self.compressor.plan(first.shape, first.dtype, name=key)
    self._plans[key] = plan
    devices = [c.device for c in components]
    residues = self._variables_for(key, plan, devices)
    targets = cross_device_ops_lib.get_devices_from(destinations)

    def compressed():
      return self._compressed_sums(components, plan, residues, targets)

    if self.start_step:
      step = self.steps[key]
      with tf.control_dependencies([step.assign_add(1)]):
        sums = tf.cond(step.read_value() <= self.start_step,
                       lambda: self._exact_sums(components, targets), compressed)
    else:
      sums = compressed()
    if self.reduction == "adasum":
      if reduce_op == tf.distribute.ReduceOp.SUM:
        sums = [s * len(components) for s in sums]
    elif reduce_op == tf.distribute.ReduceOp.MEAN:
      sums = [s / len(components) for s in sums]
    return distribute_utils.regroup(sums, wrap_class=values_lib.Mirrored)

  def _compressed_sums(self, components, plan, residues, targets):
    payloads, olds, news = [], [], []
    for component, state_vars in zip(components, residues):
      with tf.device(component.device):
        old = tuple(v.read_value() for v in state_vars)
        payload, new = self.compressor.compress(component, old, plan)
        nbytes = self.compressor.payload_nbytes(payload, plan)
        if not plan.summable:
          # Only the used words leave the device.
          payload = payload[:tf.cast(nbytes // 4, tf.int32)]
        payloads.append((payload, nbytes))
        olds.append(old)
        news.append(new)
    width = None if plan.summable else self.compressor.payload_width(plan)
    sums = []
    for target in targets:
      with tf.device(target):
        if self.reduction == "adasum":
          sums.append(adasum_ops.adasum_reduce([self._decode_one(p, plan, width) for p, _ in payloads]))
        elif plan.summable:
          sums.append(self.compressor.decompress(tf.add_n([p for p, _ in payloads]), plan))
        else:
          rows = tf.stack([tf.pad(p, [[0, width - tf.shape(p)[0]]]) for p, _ in payloads])
          sums.append(self.compressor.decompress(tf.ensure_shape(rows, [len(payloads), width]),
                                                 plan))
    # A non-finite sum changes nothing: every residue keeps its value.
    finite = tf.reduce_all(tf.math.is_finite(sums[0]))
    updates = []
    for state_vars, old, new, component in zip(residues, olds, news, components):
      with tf.device(component.device):
        updates += [v.assign(tf.where(finite, n, o)) for v, o, n in zip(state_vars, old, new)]
    sent = tf.stack([b for _, b in payloads])
    # Gathered payloads of varying length cost a length word and the longest payload.
    updates.append(self.nbytes[plan.name].assign(
        tf.reduce_max(sent) if plan.summable else adacomp_ops.exchange_nbytes(sent)))
    with tf.control_dependencies(updates):
      return [tf.identity(s) for s in sums]

  def _decode_one(self, payload, plan, width):
    """One device's (trimmed) payload, decoded on its own (for Adasum)."""
    if plan.summable:
      return self.compressor.decompress(payload, plan)
    row = tf.pad(payload, [[0, width - tf.shape(payload)[0]]])[None]
    return self.compressor.decompress(tf.ensure_shape(row, [1, width]), plan)

  def _exact_sums(self, components, targets):
    sums = []
    for target in targets:
      with tf.device(target):
        copies = [tf.identity(c) for c in components]
        sums.append(adasum_ops.adasum_reduce(copies) if self.reduction == "adasum" else tf.add_n(copies))
    return sums

  def _variables_for(self, key, plan, devices):
    """Per-device state variables for ``key``, created outside any function on first use."""
    if key not in self.residues:
      with tf.init_scope():
        per_device = []
        for d, device in enumerate(devices):
          with tf.device(device):
            per_device.append([
                resource_variable_ops.ResourceVariable(
                    tf.zeros(spec.shape, spec.dtype), trainable=False,
                    name=f"residue_{d}")
                for spec in self.compressor.state_specs(plan)])
        with tf.device(devices[0]):
          self.steps[key] = resource_variable_ops.ResourceVariable(
              tf.zeros([], tf.int64), trainable=False, name="steps")
          self.nbytes[key] = resource_variable_ops.ResourceVariable(
              tf.zeros([], tf.int64), trainable=False, name="nbytes")
        self.residues[key] = per_device
    return self.residues[key]

  def bytes_sent(self):
    """``{key: bytes one device sent for that tensor in its last reduction}``."""
    return {key: int(v.numpy()) for key, v in self.nbytes.items()}

  def variable_bytes(self):
    """``[(plan, bytes one device sent for that tensor in its last reduction)]``."""
    return [(self._plans[k], n) for k, n in self.bytes_sent().items()]

  def compression_stats(self):
    """Bytes of the last reduction per tensor kind and in total (see ``stats``)."""
    return stats.summarize(self.variable_bytes())


def _compressible(value) -> bool:
  if not isinstance(value, values_lib.DistributedValues):
    return False
  first = value.values[0]
  return (not isinstance(first, tf.IndexedSlices) and first.dtype.is_floating
          and first.shape.is_fully_defined())


def _scalar(value) -> bool:
  return value.values[0].shape.rank == 0


def _key(batch: int, index: int, tensor) -> str:
  shape = "x".join(str(d) for d in tensor.shape) or "scalar"
  return f"batch{batch}_{index}_{shape}_{tensor.dtype.name}"
