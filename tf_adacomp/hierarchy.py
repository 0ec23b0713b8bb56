"""Which replicas share a worker, and the collectives of a hierarchical exchange.

A cluster has several devices per host, joined by fast links (NVLink, PCIe, or one
memory), and one slow network link between hosts. The hierarchical exchange
(``Exchange.replica_exchange(..., hierarchy=...)``) uses two kinds of group:

- a *local group* per worker, its devices: they sum their gradients densely (one
  all-reduce of float32, over the fast links) before anything is compressed, and
  afterwards receive from the worker's first device what arrived (local all-reduces to
  which the other devices add zeros) and decode it;
- the *leaders' group*: the first device of every worker. Only its members compress
  and exchange compressed payloads across the network (one payload per worker, whatever
  the number of its devices).

The error feedback state lives once per worker, on its first device: one payload
per worker needs one residue per worker, and a state kept in one place survives a
restore onto another number of devices (the other devices' residues, which a restore
fills with an equal share of the saved total, are folded into the next local sum;
``Exchange``). The price is that compression is not split across a worker's devices:
on a GPU it runs near memory bandwidth, a small cost beside the network it saves.

``devices_per_worker`` describes the machine a job runs on, not the model. A value read
back from a saved config (``CompressedOptimizer.from_config``, so ``keras.models.load_model``
too, marks it with ``saved_devices_per_worker``) that does not fit the strategy the
optimizer is restored under is not an error: ``resolve`` then uses the layout it would
without ``devices_per_worker`` (the flat exchange under a ``MirroredStrategy``, unless
``hierarchical=True``: one worker of all its devices; a ``MultiWorkerMirroredStrategy``'s
own devices per worker) and logs one warning saying so. The residues need nothing: a
checkpoint holds their sum over the replicas, which a restore splits evenly over the
replicas there are (no residue is lost: a worker's, on its first device, is part of the
sum). A value the user gives (an int) is checked as before. To choose the layout of a
restored optimizer: set ``optimizer.devices_per_worker`` (and ``hierarchical``) on the
optimizer ``from_config`` returns, before it is built (a plain int is checked again); or,
since ``load_model`` builds the optimizer, load with ``compile=False``, compile with
``CompressedOptimizer(..., devices_per_worker=n)``, build the optimizer
(``model.optimizer.build(model.trainable_variables)``) and ``model.load_weights(path)``
(a ``.keras`` file holds the optimizer's state too). A restored optimizer keeps the saved
value in ``devices_per_worker`` (and in a later ``get_config``: used again wherever it
fits); ``optimizer.hierarchy`` is what it uses.

Replica ``r`` of a strategy with ``devices_per_worker`` devices per worker is device
``r % devices_per_worker`` of worker ``r // devices_per_worker``: the order of
``MultiWorkerMirroredStrategy``'s replica ids (worker by worker, each worker's
``extended.worker_devices`` in order), and of a ``MirroredStrategy``'s devices when
it is told how many of them share a host.

The collectives are TensorFlow's ``CollectiveReduceV2`` and ``CollectiveGatherV2``
with group keys of their own (``collective_keys``), so that a group of some of the
strategy's devices does not clash with the strategy's own groups (or with an earlier
hierarchy's), and instance keys from a counter per group and member that each call
advances on the device (the n-th collective of a group has the same key on every
member: every worker traces the same step).
"""

import threading
from typing import List, NamedTuple, Optional, Sequence

import tensorflow as tf

from tf_adacomp import collective_keys
from tf_adacomp import log
from tf_adacomp.ops import checks


class Position(NamedTuple):
  """Where one replica sits: ``worker`` (its host) and ``device`` (index on that host)."""
  worker: int
  device: int

  @property
  def leads(self) -> bool:
    """Whether this replica is its worker's first device (it compresses and sends)."""
    return self.device == 0


class Hierarchy:
  """Workers of ``devices_per_worker`` replicas each, and their collectives.

  Made once per exchange owner (an optimizer), in the same order on every worker: its
  group keys are counted in creation order.

  Args:
    workers: the number of workers (hosts), >= 1.
    devices_per_worker: the replicas of each worker, >= 1.

  Raises:
    ValueError: either not an int >= 1, or too many workers for the key range.
  """

  def __init__(self, workers: int, devices_per_worker: int):
    self.workers = checks.typed_int(workers, "workers", 1)
    self.devices_per_worker = checks.typed_int(devices_per_worker, "devices_per_worker", 1)
    if self.workers > collective_keys.MAX_HIERARCHY_WORKERS:
      raise ValueError(f"`workers` must be at most {collective_keys.MAX_HIERARCHY_WORKERS}. "
                       f"Received: workers={workers}")
    # Group keys of its own, in the upper half of a block of collective keys, where no
    # strategy reaches (collective_keys: the whole key space): a key of two groups of
    # different devices aborts the process' collectives ("joining a group with size 2,
    # but that group has size 3").
    self._key_base = collective_keys.next_hierarchy_key_base()
    self._resources = {}
    self._lock = threading.Lock()  # a MirroredStrategy traces its replicas in threads

  def __repr__(self):
    return f"Hierarchy(workers={self.workers}, devices_per_worker={self.devices_per_worker})"

  @property
  def replicas(self) -> int:
    return self.workers * self.devices_per_worker

  def position(self, replica: int) -> Position:
    """The worker and device of replica ``replica`` (an int)."""
    return Position(*divmod(int(replica), self.devices_per_worker))

  def current_position(self) -> Position:
    """The position of the replica being traced (in a replica context).

    Raises:
      RuntimeError: outside a replica context, or a replica id that is not known while
        tracing, or a strategy with another number of replicas.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
      raise RuntimeError("The hierarchical exchange must run in a replica context.")
    if ctx.num_replicas_in_sync != self.replicas:
      raise RuntimeError(f"{self!r} has {self.replicas} replicas, the strategy "
                         f"{ctx.num_replicas_in_sync}.")
    if tf.executing_eagerly():
      # A strategy runs its replicas' eager code one thread at a time, switching only at
      # its own collectives: replica 0 would wait in the first local sum for replica 1,
      # which never starts.
      raise RuntimeError("The hierarchical exchange runs only inside a tf.function (Keras: "
                         "model.compile(run_eagerly=False), the default); eagerly, pass "
                         "hierarchical=False.")
    replica = tf.get_static_value(ctx.replica_id_in_sync_group)
    if replica is None:
      raise RuntimeError("The hierarchical exchange needs each replica's id while tracing; "
                         "this strategy gives it only at run time.")
    return self.position(replica)

  # --- Collectives -----------------------------------------------------------------

  def local_sum(self, position: Position, tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """The sums of ``tensors`` over the devices of ``position``'s worker.

    One all-reduce per dtype, of the tensors flattened and joined; each waits for the
    previous one (and for ``tensors``), so every device launches them in one order.
    """
    return self._joined(tensors, lambda joined: self._reduce(
        joined, self.devices_per_worker, self._key_base + position.worker, position))

  def leaders_sum(self, position: Position, tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """The sums of ``tensors`` over the workers' first devices (call on those only)."""
    return self._joined(tensors, lambda joined: self._reduce(
        joined, self.workers, self._leaders_key, position))

  def leaders_gather(self, position: Position, tensor: tf.Tensor) -> tf.Tensor:
    """``tensor`` of every worker's first device, joined along axis 0 in worker order.

    Every first device must give the same shape (pad first where lengths differ).
    """
    if self.workers == 1:
      return tf.identity(tensor)
    return tf.raw_ops.CollectiveGatherV2(
        input=tensor, group_size=self.workers, group_key=self._leaders_key,
        instance_key=self._instance_key(self._leaders_key, position),
        ordering_token=[self._ordering_token(position)], communication_hint="auto")

  @property
  def _leaders_key(self) -> int:
    return self._key_base + self.workers

  def _reduce(self, tensor, group_size, group_key, position):
    if group_size == 1:
      return tf.identity(tensor)
    return tf.raw_ops.CollectiveReduceV2(
        input=tensor, group_size=group_size, group_key=group_key,
        instance_key=self._instance_key(group_key, position),
        ordering_token=[self._ordering_token(position)], merge_op="Add", final_op="Id",
        communication_hint="auto")

  def _joined(self, tensors, reduce):
    groups = {}
    for k, tensor in enumerate(tensors):
      groups.setdefault(tensor.dtype, []).append(k)
    out, previous = [None] * len(tensors), list(tensors)
    for ks in groups.values():
      if len(ks) == 1:  # as it is (its shape may be known only at run time)
        with tf.control_dependencies(previous):
          out[ks[0]] = reduce(tensors[ks[0]])
        previous = [out[ks[0]]]
        continue
      with tf.control_dependencies(previous):
        joined = reduce(tf.concat([tf.reshape(tensors[k], [-1]) for k in ks], 0))
      previous, start = [joined], 0
      for k in ks:
        size = tensors[k].shape.num_elements()
        out[k] = tf.reshape(joined[start:start + size], tensors[k].shape)
        start += size
    return out

  def _ordering_token(self, position: Position):
    # tf.function runs stateful ops in program order unless they take a resource: then
    # only the ops of one resource are ordered. The strategy traces its replicas one
    # after the other into one graph, so without a token per device replica 0's last
    # collective would have to finish before replica 1's first one starts (a deadlock);
    # with it each device runs its own collectives in its own order (as
    # TensorFlow's CollectiveReplicaLauncher does with a variable per device).
    return self._resource(("order", position), position, tf.float32, on_host=False)

  def _instance_key(self, group_key: int, position: Position) -> tf.Tensor:
    # TensorFlow keeps the shape of every collective instance it has run and fails a
    # later one with the same key and another shape ("Shape mismatch in the collective
    # instance"), and payloads change length every step: so every call gets a new key,
    # from a counter per group and member, counted on the device (the n-th collective of
    # a group has the same key on every member, call after call).
    counter = self._resource(("count", group_key, position), position, tf.int64, on_host=True)
    with tf.control_dependencies([tf.raw_ops.AssignAddVariableOp(
        resource=counter, value=tf.constant(1, tf.int64))]):
      count = tf.raw_ops.ReadVariableOp(resource=counter, dtype=tf.int64)
    return tf.cast(count, tf.int32)

  def _resource(self, name, position: Position, dtype, on_host: bool):
    """A scalar resource variable of this hierarchy, made once (eagerly, set to zero) and
    captured by every function that uses it: on ``position``'s device (an op that takes
    a resource is placed where the resource is: an ordering token must be on the
    collective's device) or on its host (a counter: int64 ops stay on the CPU)."""
    with self._lock:
      handle = self._resources.get(name)
      if handle is None:
        devices = tf.distribute.get_replica_context().strategy.extended.worker_devices
        # A MirroredStrategy lists every replica's device; a multi-worker one its worker's.
        device = devices[position.worker * self.devices_per_worker + position.device
                         if len(devices) == self.replicas else position.device]
        if on_host:
          device = tf.DeviceSpec.from_string(device).replace(device_type="CPU",
                                                             device_index=0).to_string()
        unique = "_".join(str(part) for part in tf.nest.flatten(name))
        with tf.init_scope(), tf.device(device):
          handle = tf.raw_ops.VarHandleOp(dtype=dtype, shape=[],
                                          shared_name=f"tf_adacomp_{self._key_base}_{unique}")
          tf.raw_ops.AssignVariableOp(resource=handle, value=tf.zeros([], dtype))
        self._resources[name] = handle
    return handle


class SavedDevicesPerWorker(int):
  """A ``devices_per_worker`` read back from a saved config: an int (it compares, prints
  and serializes as one) that ``resolve`` fits to the strategy the optimizer is restored
  under, rather than refusing it (``saved_devices_per_worker``)."""

  __slots__ = ()


def saved_devices_per_worker(devices_per_worker) -> Optional[int]:
  """``devices_per_worker`` of a saved config, marked as the saved machine's layout.

  ``from_config`` passes it to the optimizer instead of the plain value: where it does not
  fit the strategy the optimizer is built under (another number of devices), ``resolve``
  falls back to the layout it would use without ``devices_per_worker`` and logs a
  warning, rather than raising.

  Args:
    devices_per_worker: the config's value: None or an int >= 1.

  Returns:
    None, or a ``SavedDevicesPerWorker`` of the same value.

  Raises:
    TypeError: not None and not an int (a bool included), named in the message.
    ValueError: an int < 1, named in the message.
  """
  if devices_per_worker is None:
    return None
  return SavedDevicesPerWorker(checks.typed_int(devices_per_worker, "devices_per_worker", 1))


def resolve(strategy, hierarchical: Optional[bool],
            devices_per_worker: Optional[int]) -> Optional[Hierarchy]:
  """The ``Hierarchy`` an exchange under ``strategy`` uses, or None for the flat exchange.

  Args:
    strategy: the ``tf.distribute.Strategy`` the exchange runs under.
    hierarchical: None (hierarchical when a worker has more than one device), True or
      False (the flat exchange).
    devices_per_worker: None, or how many consecutive replicas share a worker. Under
      ``MultiWorkerMirroredStrategy`` it is the strategy's ``len(extended.
      worker_devices)`` (and a different value is an error); under a ``MirroredStrategy``
      None means one host (all its devices), hierarchical only when ``hierarchical`` is
      True. A ``SavedDevicesPerWorker`` (from a saved config) that does not fit is
      replaced by None, with a warning (logged unless ``hierarchical`` is False, where
      it changes nothing), instead of raising.

  Returns:
    A ``Hierarchy``, or None where every worker has one device or ``hierarchical`` is
    False.

  Raises:
    ValueError: ``devices_per_worker`` (not one from a saved config) that does not divide
      the replicas or contradicts a multi-worker strategy.
  """
  replicas = strategy.num_replicas_in_sync
  multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
  saved = isinstance(devices_per_worker, SavedDevicesPerWorker)
  if multi_worker:
    own = len(strategy.extended.worker_devices)
    if devices_per_worker is not None and devices_per_worker != own:
      if not saved:
        raise ValueError(f"`devices_per_worker` must be the strategy's devices per worker "
                         f"({own}: {list(strategy.extended.worker_devices)}) under "
                         f"MultiWorkerMirroredStrategy. Received: "
                         f"devices_per_worker={devices_per_worker}")
      _warn_saved_layout_does_not_fit(
          devices_per_worker, hierarchical,
          f"is not this MultiWorkerMirroredStrategy's {own} devices per worker",
          f"its {own} devices per worker" if own > 1
          else "the flat exchange (its 1 device per worker)")
    devices_per_worker = own
  elif devices_per_worker is not None and replicas % devices_per_worker and saved:
    _warn_saved_layout_does_not_fit(
        devices_per_worker, hierarchical,
        f"does not divide this strategy's {replicas} replica{'s' * (replicas != 1)}",
        f"one worker of {replicas} devices" if hierarchical and replicas > 1
        else "the flat exchange (no hierarchy)")
    devices_per_worker = None
  if devices_per_worker is None:
    devices_per_worker = replicas if hierarchical else 1
  if replicas % devices_per_worker:
    raise ValueError(f"`devices_per_worker` must divide the strategy's {replicas} replicas. "
                     f"Received: devices_per_worker={devices_per_worker}")
  if hierarchical is False or devices_per_worker == 1:
    return None
  return Hierarchy(replicas // devices_per_worker, devices_per_worker)


def _warn_saved_layout_does_not_fit(devices_per_worker: int, hierarchical: Optional[bool],
                                    why: str, used: str) -> None:
  """One line: the saved layout, why it does not fit, what is used, how to choose."""
  if hierarchical is False:
    return  # the flat exchange either way: nothing changes
  log.warning(
      "The optimizer was saved with devices_per_worker=%d, which %s: it uses %s here. To "
      "choose the layout, set `devices_per_worker` (and `hierarchical`) on the optimizer "
      "before it is built, or load the model with compile=False, compile it with "
      "CompressedOptimizer(..., devices_per_worker=n), build the optimizer and "
      "model.load_weights(path) (tf_adacomp.hierarchy's docs).", int(devices_per_worker),
      why, used)


def check_hierarchical(hierarchical) -> Optional[bool]:
  """``hierarchical`` checked: None, True or False.

  Raises:
    ValueError: anything else, named in the message.
  """
  if hierarchical is None or isinstance(hierarchical, bool):
    return hierarchical
  raise ValueError(f"`hierarchical` must be None, True or False. "
                   f"Received: hierarchical={hierarchical!r}")


def check_devices_per_worker(devices_per_worker) -> Optional[int]:
  """``devices_per_worker`` checked: None or an int >= 1.

  Returns:
    None, or the int (a ``SavedDevicesPerWorker`` as it is: ``resolve`` must still tell
    that it came from a saved config).

  Raises:
    TypeError: not None and not an int (a bool included), named in the message.
    ValueError: an int < 1, named in the message.
  """
  if devices_per_worker is None:
    return None
  if isinstance(devices_per_worker, SavedDevicesPerWorker):
    checks.typed_int(devices_per_worker, "devices_per_worker", 1)
    return devices_per_worker
  return checks.typed_int(devices_per_worker, "devices_per_worker", 1)
