"""CompressedAllReduce: a ``tf.distribute.CrossDeviceOps`` that reduces compressed.

    strategy = tf.distribute.MirroredStrategy(
        cross_device_ops=tf_adacomp.CompressedAllReduce(tf_adacomp.AdaComp()))

The all-reduces of the strategy's replicas (``strategy.extended.batch_reduce_to``: Keras'
gradient all-reduce in ``model.fit``, ``ReplicaContext.all_reduce`` in a custom loop)
go through it: the floating-point tensors of one batch are compressed on their own
device, with one residue per device and per tensor kept across steps, only the compact
payloads are copied to the destination devices, and each destination decodes and sums
them in device order (bit-identical on every device; each destination device holds its
own result). This is ``exchange.Exchange.local_exchange``, the engine that the
optimizer wrapper runs with collectives. IndexedSlices, integer tensors, scalars (losses,
metric totals and counts) and tensors without a static shape are reduced exactly
(uncompressed), under every compressor and reduction.

``strategy.reduce`` does not go through it, and is exact: that is TensorFlow's dispatch
(2.21), not this object's. ``strategy.reduce`` reduces to the current device or the host
CPU, and ``MirroredStrategy`` hands a ``strategy.extended.reduce_to`` whose destinations
include a CPU, or are not the value's own devices, to ``ReductionToOneDevice`` instead of
its cross-device ops; only a ``reduce_to`` onto the value's own accelerators reaches this
object (tests/test_cross_device_ops_paths.py pins what reaches it).

With ``reduction="adasum"`` the devices' decoded tensors are combined with Adasum
(``ops.adasum_reduce``) instead of added: a MEAN reduction returns their Adasum (equal tensors
give their mean, orthogonal ones their sum) and a SUM reduction the number of devices
times it (equal tensors give their sum, as SUM would). Keras' gradient all-reduce is a SUM
of per-replica gradients each scaled by 1/replicas, so under ``model.fit`` this is the
Adasum of the replicas' own mean gradients, as Horovod applies it.

``start_step`` warm-up steps send compact payloads (AdaComp, FFT, top-k) as float32 and
count those bytes; cast compressors (fp16, bf16) also send their float32 tensors during
warm-up, and the reduction is their float32 sum in device order (afterwards the
half-precision sum, plus 8 bytes per reduction).

Residues are keyed by the functions the reduction is traced in (their names, "eager"
outside any), the position of a tensor in its batch of reductions, its shape and dtype:
a training step must reduce its gradients in the same order every step, as Keras and the
usual custom loops do, and two ``tf.function`` functions of different names never share a
residue (two of one name, e.g. two lambdas, do). They live in this object, which is a
``tf.Module``, not in the model or its optimizer: a checkpoint of those alone restores
them as zeros, and the first reduction logs a warning saying so. Add one item to the
checkpoint to keep them::

    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer,
                                      residues=tf_adacomp.CompressedAllReduce.of(strategy))

``model.save`` and Keras' ``ModelCheckpoint`` and ``BackupAndRestore`` cannot hold them:
use ``CompressedOptimizer`` if they must travel with a Keras model.

A checkpoint holds each tensor's states as one stacked tensor per state (the devices'
values along a new first axis), so that its structure does not depend on the number of
devices. A restore with as many devices as the save gives each device its own values
back; with another number it keeps the total over devices, the error feedback not yet
sent: each device gets the saved sum / devices of a floating state, and the first saved
device's value of an integer one (the FFT compressor's step counter), as
``CompressedOptimizer``'s on-read residues do. A restore before the first reduction is
applied when the states are made. Checkpoints written before this layout (one variable
per device and state) load with as many devices as they were written with or more (the
extra devices start at zero); with fewer, the restore raises a ValueError rather than
drop the other devices' residues. (With ``devices_per_worker``, the devices here are the
groups' senders. A strategy over one device never calls its cross-device ops: restored
there, the residues have nowhere to go and stay in the checkpoint, unread.)
"""

import collections.abc
import copy

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.ops import resource_variable_ops

from tf_adacomp import _keywords
from tf_adacomp import compile_log
from tf_adacomp import exchange as exchange_lib
from tf_adacomp import hierarchy as hierarchy_lib
from tf_adacomp import log
from tf_adacomp import replica_state
from tf_adacomp import stats
from tf_adacomp.compat import internals
from tf_adacomp.compressors import registry
from tf_adacomp.ops import checks
from tf_adacomp.ops import fused


class CompressedAllReduce(tf.distribute.CrossDeviceOps, tf.Module):
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
    devices_per_worker: None (default: every device compresses its own tensor) or an
      int >= 1: consecutive groups of that many devices share a host (a worker), and
      the hierarchical exchange of ``tf_adacomp.hierarchy`` applies: each group's
      tensors are summed densely on its first device (their mean, with Adasum), which
      alone compresses (with the group's one residue) and sends its payload; each
      destination decodes one payload per group.

  Raises:
    TypeError: an unknown keyword argument (named with its value and the closest valid
      name).
    ValueError: unknown compressor or reduction, ``start_step`` < 0, ``min_size`` < 0,
      ``devices_per_worker`` < 1 (a TypeError if not an int), or, when reducing, one
      that does not divide the strategy's devices.
    RuntimeError: made (or, later, reducing) in TF1 graph mode (a ``tf.compat.v1``
      Graph and Session), which it does not support.
  """

  @_keywords.suggest_keywords
  def __init__(self, compressor="adacomp", start_step: int = 0, min_size=None,
               reduction: str = "sum", devices_per_worker=None):
    _refuse_graph_mode()
    tf.distribute.CrossDeviceOps.__init__(self)
    tf.Module.__init__(self, name="compressed_all_reduce")
    compressor = registry.get_compressor(compressor)
    if min_size is not None:
      config = registry.serialize(compressor)
      config["config"]["min_size"] = min_size
      compressor = registry.get_compressor(config)
    start_step = checks.non_negative_int(start_step, "start_step")
    self.compressor = compressor
    self.start_step = start_step
    self.reduction = exchange_lib.check_reduction(reduction)
    self.devices_per_worker = hierarchy_lib.check_devices_per_worker(devices_per_worker)
    self._exchange = exchange_lib.Exchange(compressor, reduction)
    self._exact = tf.distribute.ReductionToOneDevice()
    self.residues = {}   # key -> _DeviceStates: [per device: [state variables]]
    self.steps = {}      # key of an exchange's first tensor -> int64 variable: reductions done
    self.nbytes = {}     # key -> int64 variable: bytes one device sent last time
    self._plans = {}     # key -> TensorPlan (static, not checkpointed)
    self._compile_log = None  # compile_log.FirstCompile of the first reduction

  def __deepcopy__(self, memo):
    # Strategies deep-copy their cross-device ops; the copy starts with no residues.
    result = CompressedAllReduce(copy.deepcopy(self.compressor, memo), self.start_step,
                                 reduction=self.reduction,
                                 devices_per_worker=self.devices_per_worker)
    memo[id(self)] = result
    return result

  @staticmethod
  def of(strategy) -> "CompressedAllReduce":
    """The ``CompressedAllReduce`` that ``strategy`` reduces with, to add to a checkpoint:
    ``tf.train.Checkpoint(model=model, optimizer=optimizer,
    residues=tf_adacomp.CompressedAllReduce.of(strategy))``.

    Args:
      strategy: a ``tf.distribute.MirroredStrategy``.

    Returns:
      Its ``CompressedAllReduce``.

    Raises:
      ValueError: ``strategy`` does not reduce with a ``CompressedAllReduce``.
    """
    ops = internals.cross_device_ops_of(strategy)
    if not isinstance(ops, CompressedAllReduce):
      raise ValueError(f"The strategy does not reduce with a CompressedAllReduce (its cross-"
                       f"device ops are {ops!r}). Received: strategy={strategy!r}")
    return ops

  # --- tf.distribute.CrossDeviceOps ------------------------------------------------

  def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
    return self.batch_reduce_implementation(
        reduce_op, [(per_replica_value, destinations)], options)[0]

  def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
    _refuse_graph_mode()
    results = [None] * len(value_destination_pairs)
    compressed = []
    for index, (value, destinations) in enumerate(value_destination_pairs):
      if _compressible(value):
        compressed.append(index)
      else:
        results[index] = self._exact.reduce(reduce_op, value, destinations, options)
    # The compressible tensors of one batch (Keras' gradients) share one exchange, one
    # destination set per exchange.
    by_destinations = {}
    for index in compressed:
      destinations = value_destination_pairs[index][1]
      targets = tuple(cross_device_ops_lib.get_devices_from(destinations))
      by_destinations.setdefault(targets, []).append(index)
    batch = _batch_key(value_destination_pairs)
    for targets, indices in by_destinations.items():
      values = [value_destination_pairs[i][0] for i in indices]
      keys = [_key(batch, i, value_destination_pairs[i][0].values[0]) for i in indices]
      for index, result in zip(indices, self._reduce(reduce_op, values, keys, list(targets))):
        results[index] = result
    return results

  def _gather_implementation(self, per_replica_value, destinations, axis, options):
    return self._exact._gather(per_replica_value, destinations, axis, options)  # pylint: disable=protected-access

  # --- The compressed reduction -----------------------------------------------------

  def _reduce(self, reduce_op, values, keys, targets):
    """Reduces the per-device ``values`` (one exchange) onto ``targets``: one Mirrored
    value per tensor, with one component on each target device."""
    devices = [c.device for c in values[0].values]
    group = self.devices_per_worker or 1
    if len(devices) % group:
      raise ValueError(f"`devices_per_worker` must divide the strategy's {len(devices)} "
                       f"devices. Received: devices_per_worker={group}")
    # Each group's first device compresses for the group (alone, without a hierarchy).
    senders = devices[::group]
    plans = []
    for value, key in zip(values, keys):
      first = value.values[0]
      self._plans[key] = self.compressor.plan(first.shape, first.dtype, name=key)
      plans.append(self._plans[key])
    residues = [self._variables_for(key, plan, senders) for key, plan in zip(keys, plans)]
    grads = [[_group_total(value.values[d:d + group], senders[d // group],
                           mean=not self._exchange.reduction.sums_payloads)
              for value in values] for d in range(0, len(devices), group)]
    states = [[tuple(v.read_value() for v in residues[t][d]) for t in range(len(values))]
              for d in range(len(senders))]
    dense = None
    updates = []
    if self.start_step:
      step = self._step_for(keys)
      updates.append(step.assign_add(1))
      with tf.control_dependencies(updates):
        dense = step.read_value() <= self.start_step
    if self._compile_log is None:
      # The first reduction compiles the kernels (tens of seconds): say so, and how long.
      nbytes = self.nbytes[keys[0]]
      self._compile_log = compile_log.FirstCompile(
          "CompressedAllReduce", lambda: int(nbytes.numpy()) > 0)
      self._compile_log.start()
    totals, exchanged = self._exchange.local_exchange(plans, grads, states, senders, targets,
                                                      dense)
    self._compile_log.traced()
    for t, key in enumerate(keys):
      # A non-finite total changes nothing: every residue of that tensor keeps its value.
      finite = fused.all_finite([exchanged.sums[t]])
      for d, device in enumerate(senders):
        with tf.device(device):
          updates += [v.assign(tf.where(finite, new, old)) for v, old, new in
                      zip(residues[t][d], states[d][t], exchanged.states[d][t])]
      updates.append(self.nbytes[key].assign(tf.cast(exchanged.nbytes[t], tf.int64)))
    replicas = len(devices)
    scale = (self._exchange.reduction.to_mean if reduce_op == tf.distribute.ReduceOp.MEAN
             else self._exchange.reduction.to_sum)
    results = []
    with tf.control_dependencies(updates):
      for t in range(len(values)):
        per_target = []
        for target, target_totals in zip(targets, totals):
          with tf.device(target):  # each destination keeps its own copy
            per_target.append(tf.identity(scale(target_totals[t], replicas)))
        results.append(distribute_utils.regroup(per_target, wrap_class=values_lib.Mirrored))
    return results

  def _variables_for(self, key, plan, devices):
    """Per-device state variables for ``key``, created outside any function on first use."""
    if key not in self.residues:
      if not self.residues:
        _warn_checkpoints_do_not_hold_residues()
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
          self.nbytes[key] = resource_variable_ops.ResourceVariable(
              tf.zeros([], tf.int64), trainable=False, name="nbytes")
        # Tracked once its variables exist: a restore made before the first reduction
        # (deferred by the checkpoint until this key appears) is applied here. A tensor
        # sent dense holds no state: its empty lists save nothing, and a checkpoint's
        # assert_consumed does not wait for them.
        self.residues[key] = _DeviceStates(per_device) if per_device[0] else per_device
    return self.residues[key]

  def _step_for(self, keys):
    """The reductions counter of the exchange of ``keys`` (for the warm-up)."""
    key = keys[0]
    if key not in self.steps:
      with tf.init_scope():
        self.steps[key] = resource_variable_ops.ResourceVariable(
            tf.zeros([], tf.int64), trainable=False, name="steps")
    return self.steps[key]

  def bytes_sent(self):
    """``{key: bytes one device (with ``devices_per_worker``, one group) sent for that
    tensor in its last reduction}``."""
    return {key: int(v.numpy()) for key, v in self.nbytes.items()}

  def variable_bytes(self):
    """``[(plan, bytes one device sent for that tensor in its last reduction)]``."""
    return [(self._plans[k], n) for k, n in self.bytes_sent().items()]

  def compression_stats(self):
    """Bytes of the last reduction per tensor kind and in total (see ``stats``)."""
    return stats.summarize(self.variable_bytes())


class _DeviceStates(tf.__internal__.tracking.Trackable, collections.abc.Sequence):
  """One tensor's compressor states on each device: ``states[d][s]``, a variable.

  Checkpointed as one tensor per state, ``state_{s}``: the devices' values stacked along
  a new first axis, so that the checkpoint's object graph (which a deferred restore
  matches by path) is the same whatever the number of devices. A restore with the saved
  number of devices gives each its own values; with another number, every device gets
  the saved total / devices of a floating state (the sum, in device order, of what the
  devices had still to send) and the first saved device's value of an integer one.
  Checkpoints of the earlier layout (children ``{d}/{s}``, one variable each) restore
  through ``_lookup_dependency``.
  """

  def __init__(self, per_device):
    self._per_device = per_device
    self._legacy = [_LegacyDeviceStates(states) for states in per_device]

  def __getitem__(self, index):
    return self._per_device[index]

  def __len__(self):
    return len(self._per_device)

  def _serialize_to_tensors(self):
    # Stacked on the host: a checkpoint is written from there, and the devices' copies
    # would otherwise all land on the first device.
    with tf.device("/cpu:0"):
      return {f"state_{s}": tf.stack([states[s].read_value() for states in self._per_device])
              for s in range(len(self._per_device[0]))}

  def _restore_from_tensors(self, restored_tensors):
    devices = len(self._per_device)
    updates = []
    for s in range(len(self._per_device[0])):
      values = replica_state.spread(restored_tensors[f"state_{s}"], devices)
      for states, value in zip(self._per_device, values):
        with tf.device(states[s].device):
          updates.append(states[s].assign(value))
    return tf.group(updates)

  def _lookup_dependency(self, name, cached_dependencies=None):
    # Only a checkpoint of the earlier layout has children here (this object saves none).
    del cached_dependencies
    if not name.isdigit():
      return None
    device = int(name)
    if device >= len(self._legacy):
      raise ValueError(
          f"This checkpoint holds CompressedAllReduce residues in the layout of earlier "
          f"tf_adacomp versions (one variable per device), written with more devices than "
          f"this strategy's {len(self._legacy)}: restoring it would drop the residues of "
          f"the other devices. Restore it with as many devices as it was written with "
          f"and save it again: this version's checkpoints restore with any number of "
          f"devices. Received: a residue of device {device}")
    return self._legacy[device]


class _LegacyDeviceStates(tf.__internal__.tracking.Trackable):
  """One device's states where checkpoints of the earlier layout keep them: children
  ``0``, ``1``, ... (the variables). Restores them; saves nothing."""

  def __init__(self, states):
    self._states = states

  def _lookup_dependency(self, name, cached_dependencies=None):
    del cached_dependencies
    if name.isdigit() and int(name) < len(self._states):
      return self._states[int(name)]
    return None


def _group_total(tensors, device, mean: bool):
  """The sum (or mean) of one group's tensors, on ``device``, in device order."""
  if len(tensors) == 1:
    return tensors[0]
  with tf.device(device):
    total = tensors[0]
    for tensor in tensors[1:]:
      total += tensor
    return total / len(tensors) if mean else total


def _refuse_graph_mode():
  """Raises RuntimeError in TF1 graph mode (a ``tf.compat.v1`` Graph run by a Session).

  There the kernels' tensor comparisons (``==``) are Python identity, so every payload
  decodes to NaN, and the state variables (made under ``init_scope``) would land in the
  eager context, out of the graph and of ``global_variables_initializer``.
  """
  if not tf.compat.v1.executing_eagerly_outside_functions():
    raise RuntimeError(
        "CompressedAllReduce does not support TF1 graph mode (a tf.compat.v1 Graph run "
        "by a Session, or eager execution disabled): use it eagerly or in a tf.function. "
        "Received: a call in the graph "
        f"{tf.compat.v1.get_default_graph()!r}")


def _warn_checkpoints_do_not_hold_residues():
  """Once per ``CompressedAllReduce``, at its first residues: nothing but the docstring
  said that a model's checkpoint restores them as zeros."""
  log.warning(
      "CompressedAllReduce keeps its residues (error feedback) itself: model.save, Keras' "
      "ModelCheckpoint and BackupAndRestore and a tf.train.Checkpoint of the model and "
      "optimizer do not hold them, and a restore starts them from zero. To keep them, "
      "add one item to your checkpoint: tf.train.Checkpoint(model=model, "
      "optimizer=optimizer, residues=tf_adacomp.CompressedAllReduce.of(strategy)); with "
      "Keras' callbacks, use tf_adacomp.CompressedOptimizer instead, whose residues are "
      "optimizer variables.")


def _compressible(value) -> bool:
  """Dense floating-point tensors of a static shape, scalars aside: losses, metric totals
  and counts are always summed exactly, whatever the compressor or reduction."""
  if not isinstance(value, values_lib.DistributedValues):
    return False
  first = value.values[0]
  return (not isinstance(first, tf.IndexedSlices) and first.dtype.is_floating
          and first.shape.is_fully_defined() and first.shape.rank > 0)


def _batch_key(value_destination_pairs) -> str:
  """What identifies a batch of reductions across steps: the functions it is traced in
  (outermost first; "eager" outside any) and its size. Two ``tf.function`` functions of
  different names (a training and an evaluation step) therefore never share residues,
  while retracing one does."""
  names = []
  graph = tf.compat.v1.get_default_graph()
  while graph is not None and not tf.executing_eagerly() and hasattr(graph, "outer_graph"):
    names.append(graph.name)
    graph = graph.outer_graph
  scope = "/".join(reversed(names)) or "eager"
  return f"{scope}/batch{len(value_destination_pairs)}"


def _key(batch: str, index: int, tensor) -> str:
  shape = "x".join(str(d) for d in tensor.shape) or "scalar"
  return f"{batch}_{index}_{shape}_{tensor.dtype.name}"
