"""Strategy helpers: logical devices, MirroredStrategy with compression, multi-worker set-up.

- ``split_logical_devices(4)``: four logical CPUs (or GPUs) out of one, for
  ``MirroredStrategy`` with real collectives on a single device;
- ``mirrored_strategy("adacomp")``: ``MirroredStrategy`` whose all-reduce exchanges
  compressed gradients (``tf_adacomp.cross_device_ops.CompressedAllReduce``);
- ``multi_worker_strategy()``: ``MultiWorkerMirroredStrategy`` from ``TF_CONFIG``, with
  the Keras fix that makes ``model.fit`` work under it
  (``tf_adacomp.compat.keras_multi_worker``);
  ``TF_CONFIG`` is checked first, and the workers compare their clusters once;
- ``tf_config(addresses, index)``: the ``TF_CONFIG`` of one worker of a cluster;
- ``warn_if_training_alone(strategy, owner)`` (``warn_once_if_training_alone`` at an
  optimizer's first step): the ``UnsynchronizedWorkersWarning`` of
  an optimizer wrapper training where ``TF_CONFIG`` names several workers but its
  strategy spans only this one (each worker would train a model of its own, silently).

Under ``MultiWorkerMirroredStrategy`` the cross-device ops cannot be replaced, so
compression there goes through ``tf_adacomp.CompressedOptimizer`` instead.

Importing this module (``import tf_adacomp`` does) gives every ``tf.distribute.MirroredStrategy``
and ``tf.compat.v1.distribute.MirroredStrategy`` made afterwards, the user's own included,
collective keys of its own. TensorFlow numbers
every ``MirroredStrategy``'s collectives from the same keys (group 1, instance 100), and
its runtime keeps the shape and group size it first saw under a key for the whole
process: without this, a second strategy in one process (a notebook that trains a dense
model, then a compressed one; a checkpoint of 4 replicas restored onto 2) fails with
"Shape mismatch in the collective instance 100" or "joining a group with size 2, but
that group has size 4 (group_key=1)", and aborts every later collective of the process.
(Through ``MirroredStrategy._collective_key_base``: see ``compat.internals``.) A
``MultiWorkerMirroredStrategy`` keeps TensorFlow's keys, which start below every range
given here: its workers must agree on them, and a process makes one such strategy.
"""

import hashlib
import itertools
import json
import os
from typing import List, Optional, Sequence
import warnings

import tensorflow as tf

from tf_adacomp.compat import internals
from tf_adacomp.compat.keras_multi_worker import apply_keras_multi_worker_fix
from tf_adacomp.compressors import get_compressor
from tf_adacomp.cross_device_ops import CompressedAllReduce
from tf_adacomp.ops import checks

__all__ = ["UnsynchronizedWorkersWarning", "mirrored_strategy", "multi_worker_strategy",
           "split_logical_devices", "tf_config", "warn_if_training_alone",
           "warn_once_if_training_alone"]

# Collective key ranges of the MirroredStrategy objects (v2 and v1, one counter) made in
# this process (see the module doc). TensorFlow's own tests space them the same way
# (tensorflow/python/distribute/strategy_combinations.py); group keys are int32, so the
# ranges wrap around after 20000 strategies.
_COLLECTIVE_KEY_STEP = 100_000
_COLLECTIVE_KEY_RANGES = 20_000
_collective_key_counter = itertools.count(1)


def _next_collective_key_base() -> int:
  """The first group key, minus one, of the next ``MirroredStrategy``."""
  return (next(_collective_key_counter) % _COLLECTIVE_KEY_RANGES + 1) * _COLLECTIVE_KEY_STEP


internals.own_collective_keys_per_strategy(_next_collective_key_base)


def split_logical_devices(count: int, device_type: str = "CPU",
                          memory_limit: Optional[int] = None) -> List[str]:
  """Splits the first physical CPU or GPU into ``count`` logical devices.

  Must run before TensorFlow initialises its devices (before the first op, tensor or
  ``list_logical_devices`` call). It does not initialise them itself, so a
  ``MultiWorkerMirroredStrategy`` can still be created afterwards.

  Args:
    count: number of logical devices, >= 1.
    device_type: "CPU" or "GPU" (case insensitive).
    memory_limit: memory of each logical GPU in MiB; required for "GPU", not allowed
      for "CPU" (TensorFlow supports no memory limit on CPU devices).

  Returns:
    The names of the logical devices made from the first physical device,
    ``["/device:CPU:0", ..., f"/device:CPU:{count - 1}"]``, as ``MirroredStrategy``
    takes them.

  Raises:
    TypeError: ``count``, ``device_type`` or ``memory_limit`` of the wrong type.
    ValueError: ``count`` < 1, an unknown ``device_type``, a ``memory_limit`` missing
      (GPU), given (CPU) or < 1.
    RuntimeError: no physical device of that type, or TensorFlow has already
      initialised its devices with another number of logical devices. (When the
      existing configuration already has ``count`` logical devices, the call returns
      their names.)
  """
  count = checks.typed_int(count, "count", 1)
  if not isinstance(device_type, str):
    raise TypeError(f"`device_type` must be a str. Received: device_type={device_type!r}")
  kind = device_type.upper()
  if kind not in ("CPU", "GPU"):
    raise ValueError(f"`device_type` must be 'CPU' or 'GPU'. Received: device_type={device_type!r}")
  if kind == "GPU":
    if memory_limit is None:
      raise ValueError("Logical GPUs need a `memory_limit` (MiB each). "
                       f"Received: memory_limit=None, device_type={device_type!r}")
    memory_limit = checks.typed_int(memory_limit, "memory_limit", 1)
  elif memory_limit is not None:
    raise ValueError("TensorFlow supports no memory limit on logical CPUs. "
                     f"Received: memory_limit={memory_limit!r}, device_type={device_type!r}")

  physical = tf.config.list_physical_devices(kind)
  if not physical:
    raise RuntimeError(f"No physical {kind} device to split. "
                       f"Received: device_type={device_type!r}, count={count}")
  names = [f"/device:{kind}:{i}" for i in range(count)]
  configs = [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit)
             for _ in range(count)]
  try:
    # A no-op when the same configuration is already set, even after initialisation.
    tf.config.set_logical_device_configuration(physical[0], configs)
  except RuntimeError as error:  # devices already initialised with another configuration
    existing = tf.config.get_logical_device_configuration(physical[0])
    existing_count = 1 if existing is None else len(existing)
    if existing_count == count:
      return names
    raise RuntimeError(
        f"Cannot split {physical[0].name} into {count} logical devices: TensorFlow has "
        f"already initialised its devices, with {existing_count} logical {kind} "
        f"device(s) on it. Call split_logical_devices before anything else touches "
        f"TensorFlow (the first op, tensor, model or strategy). "
        f"Received: count={count}") from error
  return names


def mirrored_strategy(compressor=None, devices: Optional[Sequence[str]] = None,
                      cross_device_ops=None, **compressor_kwargs) -> tf.distribute.MirroredStrategy:
  """A ``MirroredStrategy``, exchanging compressed gradients when given a compressor.

  Args:
    compressor: None for the plain strategy (TensorFlow's default all-reduce), or
      anything ``tf_adacomp.get_compressor`` accepts: a name ("adacomp", "topk",
      ...), a config dict or a ``Compressor``.
    devices: device names for the replicas (e.g. from ``split_logical_devices``);
      None for all local GPUs, or the CPU when there is none.
    cross_device_ops: instead of a compressor, a ready ``tf.distribute.CrossDeviceOps``
      (e.g. a configured ``CompressedAllReduce``) for the strategy.
    **compressor_kwargs: constructor arguments of the named compressor.

  Like every ``MirroredStrategy`` made once ``tf_adacomp`` is imported, the strategy
  numbers its collectives from a key range of its own (see the module doc).

  Returns:
    ``tf.distribute.MirroredStrategy(devices)`` without a compressor; with one,
    ``MirroredStrategy(devices, cross_device_ops=CompressedAllReduce(compressor))``.

  Raises:
    TypeError: ``devices`` not a list or tuple of str.
    ValueError: empty ``devices``; ``compressor_kwargs`` without a compressor; both a
      compressor and ``cross_device_ops``; an unknown compressor or bad arguments.
  """
  if devices is not None:
    if isinstance(devices, str) or not isinstance(devices, (list, tuple)):
      raise TypeError(f"`devices` must be a list or tuple of device names, or None. "
                      f"Received: devices={devices!r}")
    if not devices:
      raise ValueError(f"`devices` must not be empty. Received: devices={devices!r}")
    for device in devices:
      if not isinstance(device, str):
        raise TypeError(f"`devices` must hold device names (str). Received: devices={devices!r}")
    devices = list(devices)
  if cross_device_ops is not None:
    if compressor is not None or compressor_kwargs:
      raise ValueError("Give either a compressor or cross_device_ops, not both. Received: "
                       f"compressor={compressor!r}, cross_device_ops={cross_device_ops!r}")
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
  if compressor is None:
    if compressor_kwargs:
      raise ValueError("Compressor arguments were given without a compressor. "
                       f"Received: compressor=None, compressor_kwargs={compressor_kwargs!r}")
    return tf.distribute.MirroredStrategy(devices)

  compressor = get_compressor(compressor, **compressor_kwargs)
  return tf.distribute.MirroredStrategy(devices, cross_device_ops=CompressedAllReduce(compressor))


# The task types TensorFlow allows in a cluster (multi_worker_util._validate_cluster_spec),
# and those a MultiWorkerMirroredStrategy can run as (worker_count refuses "ps").
_CLUSTER_TASK_TYPES = ("chief", "worker", "evaluator", "ps")
_STRATEGY_TASK_TYPES = ("chief", "worker", "evaluator")
# Bytes of the cluster's canonical JSON sent in the cluster check (its SHA-256 decides;
# the text only makes the error readable).
_CLUSTER_TEXT_BYTES = 2048


def multi_worker_strategy(num_workers: Optional[int] = None,
                          collective_timeout: Optional[float] = None,
                          heartbeat_timeout: Optional[float] = None,
                          devices_per_worker: Optional[int] = None
                          ) -> tf.distribute.MultiWorkerMirroredStrategy:
  """A ``MultiWorkerMirroredStrategy`` (gRPC, cluster from ``TF_CONFIG``), Keras-ready.

  Applies the Keras fix of ``tf_adacomp.compat.keras_multi_worker`` so that Keras 3
  ``model.fit``/``evaluate`` work under it. Must run before TensorFlow initialises its
  devices. Gradient compression under this strategy goes through
  ``tf_adacomp.CompressedOptimizer``: its cross-device ops cannot be replaced.

  ``TF_CONFIG`` is checked before TensorFlow reads it (TensorFlow's own errors name no
  value, and some mistakes make it wait for a worker that never comes); see
  ``_check_tf_config`` for what a valid one is. With several workers, the workers then
  exchange their clusters once (one all-gather of a fixed-size buffer): workers whose
  ``TF_CONFIG`` lists another cluster fail here, with both clusters in the error,
  rather than at the first collective of training with TensorFlow's "joining a group
  with size 3, but that group has size 2" or "Connection refused".

  A worker that dies (killed, out of memory, its machine lost) is noticed by
  TensorFlow's coordination service, whose heartbeats abort the others' collectives
  within seconds (docs/reliability.md has the times).
  ``collective_timeout`` bounds the rest: a peer alive but stuck (a hung input pipeline,
  a deadlock) makes every collective that waits longer than it fail with
  ``DeadlineExceededError`` instead of waiting forever. It must exceed the longest
  legitimate wait, the first step's XLA compilation on the slowest worker included.

  On a slow link the heartbeats share the workers' connection with the collectives: a
  transfer that holds it longer than the heartbeat timeout (10 s by default: 12 MB at
  10 Mbit/s, as the initial broadcast of a large weight) makes the service declare a
  healthy worker dead ("DEADLINE_EXCEEDED ... CoordinationService/Heartbeat").
  ``heartbeat_timeout`` raises it; a worker that dies is then noticed that much later.

  Args:
    num_workers: the number of workers (``chief`` and ``worker`` tasks) the cluster
      must have, or None to accept any. Without ``TF_CONFIG`` the strategy has one
      worker.
    collective_timeout: None (TensorFlow's default: no limit) or seconds > 0, the
      longest any collective of the strategy may wait for its peers
      (``tf.distribute.experimental.CommunicationOptions(timeout_seconds=...)``).
    heartbeat_timeout: None (TensorFlow's default, 10 s) or seconds >= 1 after which
      the coordination service declares a silent worker dead.
    devices_per_worker: None (TensorFlow's choice: every GPU of the worker, else its
      CPU) or an int >= 1: the worker's first ``devices_per_worker`` GPUs, or on a
      machine without GPUs that many logical CPU devices, which the process must have
      made before TensorFlow initialised (``split_logical_devices``). With more than one
      device per worker a ``CompressedOptimizer`` sends one payload per worker (its
      ``hierarchical`` argument).

  Returns:
    ``tf.distribute.MultiWorkerMirroredStrategy()``.

  Raises:
    TypeError: ``num_workers`` not an int.
    ValueError: ``num_workers`` < 1 or not the cluster's number of workers;
      ``devices_per_worker`` < 1 (a TypeError if not an int) or more than the worker
      has;
      ``collective_timeout`` not None or a finite number > 0; ``heartbeat_timeout``
      not None or a finite number >= 1;
      ``TF_CONFIG`` malformed (not JSON, not an object, a bad "cluster" or "task");
      another worker's ``TF_CONFIG`` lists another cluster, or the workers could not
      compare their clusters (TensorFlow's error chained).
  """
  if num_workers is not None:
    num_workers = checks.typed_int(num_workers, "num_workers", 1)
  collective_timeout = checks.positive_number(collective_timeout, "collective_timeout",
                                              optional=True)
  if heartbeat_timeout is not None:
    heartbeat_timeout = checks.number_in_range(heartbeat_timeout, "heartbeat_timeout", 1,
                                               float("inf"), high_open=True)
  if devices_per_worker is not None:
    devices_per_worker = checks.typed_int(devices_per_worker, "devices_per_worker", 1)
  raw = os.environ.get("TF_CONFIG")
  config = _check_tf_config(raw) if raw else None
  if num_workers is not None:
    found = _worker_count(config) if config else 1
    if found != num_workers:
      where = (f"the cluster in TF_CONFIG has {found} (chief and worker tasks)" if config
               else "TF_CONFIG is not set, so the strategy would have 1")
      raise ValueError(f"`num_workers` does not match the cluster: {where}. "
                       f"Received: num_workers={num_workers}, TF_CONFIG={raw!r}")
  apply_keras_multi_worker_fix()
  if heartbeat_timeout is not None and config and config["task"]["type"] in ("chief",
                                                                             "worker"):
    internals.configure_coordination_service(
        tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec(),
        heartbeat_timeout * 1000)
  options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=collective_timeout)
  if devices_per_worker is None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
  else:
    # Listing physical devices does not start the runtime (the strategy must, itself).
    device_type = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
    with internals.multi_worker_local_devices(device_type, devices_per_worker):
      strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    found = len(tf.config.list_logical_devices(device_type))
    if found < devices_per_worker:
      advice = (" (make logical CPU devices with tf_adacomp.distribute."
                "split_logical_devices before TensorFlow initialises)"
                if device_type == "CPU" else "")
      raise ValueError(f"`devices_per_worker` is more than this worker's {found} "
                       f"{device_type} devices{advice}. Received: "
                       f"devices_per_worker={devices_per_worker}")
  # An evaluator runs alone (TensorFlow's worker_count): nobody to compare with.
  if config and config["task"]["type"] != "evaluator" and _worker_count(config) > 1:
    _check_same_cluster(strategy, config)
  return strategy


def _check_tf_config(raw: str) -> dict:
  """Parses and checks a ``TF_CONFIG`` for ``MultiWorkerMirroredStrategy``.

  A valid one is a JSON object with

  - "cluster": an object of task type ("chief", "worker", "evaluator", "ps") -> a
    non-empty list of distinct "host:port" addresses (port in 1..65535), at most one
    chief and one evaluator, and at least one chief or worker;
  - "task": an object with "type", a task type of the cluster that the strategy runs
    ("chief", "worker" or "evaluator"), and "index", an int within that type's list.

  Other keys ("rpc_layer", "environment") are left to TensorFlow.

  Args:
    raw: the value of the ``TF_CONFIG`` environment variable.

  Returns:
    The parsed ``TF_CONFIG``.

  Raises:
    ValueError: anything above, naming ``TF_CONFIG`` and the part received.
  """
  try:
    config = json.loads(raw)
  except ValueError as error:
    raise ValueError(f"The TF_CONFIG environment variable is not valid JSON. "
                     f"Received: TF_CONFIG={raw!r}") from error
  if not isinstance(config, dict):
    raise ValueError(f"The TF_CONFIG environment variable must hold a JSON object. "
                     f"Received: TF_CONFIG={raw!r}")
  if "cluster" not in config:
    raise ValueError(f'TF_CONFIG has no "cluster" (an object of task type -> list of '
                     f'"host:port" addresses). Received: TF_CONFIG={raw!r}')
  cluster = config["cluster"]
  if not isinstance(cluster, dict) or not cluster:
    raise ValueError(f'TF_CONFIG["cluster"] must be a non-empty object of task type -> '
                     f'list of "host:port" addresses. Received: TF_CONFIG["cluster"]={cluster!r}')
  seen = {}
  for task_type, addresses in cluster.items():
    part = f'TF_CONFIG["cluster"][{task_type!r}]'
    if task_type not in _CLUSTER_TASK_TYPES:
      raise ValueError(f'The task types of TF_CONFIG["cluster"] are '
                       f'{", ".join(map(repr, _CLUSTER_TASK_TYPES))}. '
                       f'Received: {part}={addresses!r}')
    if not isinstance(addresses, list) or not addresses:
      raise ValueError(f'{part} must be a non-empty list of "host:port" addresses. '
                       f'Received: {part}={addresses!r}')
    if task_type in ("chief", "evaluator") and len(addresses) > 1:
      raise ValueError(f'A cluster has at most one {task_type!r} task. '
                       f'Received: {part}={addresses!r}')
    for index, address in enumerate(addresses):
      if not _is_address(address):
        raise ValueError(f'Each address in TF_CONFIG["cluster"] must be "host:port" with a '
                         f'port in 1..65535. Received: {part}[{index}]={address!r}')
      if address in seen:
        raise ValueError(f'TF_CONFIG["cluster"] must not repeat an address: {address!r} is '
                         f'both {seen[address]} and {part}[{index}]. '
                         f'Received: TF_CONFIG["cluster"]={cluster!r}')
      seen[address] = f"{part}[{index}]"
  if not any(task_type in cluster for task_type in ("chief", "worker")):
    raise ValueError(f'TF_CONFIG["cluster"] has no "chief" or "worker" task. '
                     f'Received: TF_CONFIG["cluster"]={cluster!r}')
  if "task" not in config:
    raise ValueError(f'TF_CONFIG has no "task" (an object with this worker\'s "type" and '
                     f'"index"). Received: TF_CONFIG={raw!r}')
  task = config["task"]
  if not isinstance(task, dict):
    raise ValueError(f'TF_CONFIG["task"] must be an object with "type" and "index". '
                     f'Received: TF_CONFIG["task"]={task!r}')
  task_type = task.get("type")
  if task_type not in cluster or task_type not in _STRATEGY_TASK_TYPES:
    types = [t for t in cluster if t in _STRATEGY_TASK_TYPES]
    raise ValueError(f'TF_CONFIG["task"]["type"] must be one of the task types of '
                     f'TF_CONFIG["cluster"] that MultiWorkerMirroredStrategy runs as: '
                     f'{", ".join(map(repr, types))}. Received: TF_CONFIG["task"]={task!r}')
  index = task.get("index")
  size = len(cluster[task_type])
  if not checks.is_int(index) or not 0 <= index < size:
    raise ValueError(f'TF_CONFIG["task"]["index"] must be an int in 0..{size - 1} (the '
                     f'{task_type!r} list of TF_CONFIG["cluster"] has {size} address'
                     f'{"" if size == 1 else "es"}). Received: TF_CONFIG["task"]={task!r}')
  return config


def _worker_count(config: dict) -> int:
  """The workers of a checked TF_CONFIG's cluster: its chief and worker tasks."""
  cluster = config["cluster"]
  return len(cluster.get("chief", [])) + len(cluster.get("worker", []))


class UnsynchronizedWorkersWarning(UserWarning):
  """``TF_CONFIG`` names several workers, but a compressed optimizer's exchange spans only
  this process's replicas: the workers train independently, each a model of its own.

  A category of its own so that a job can make it an error
  (``warnings.simplefilter("error", tf_adacomp.UnsynchronizedWorkersWarning)``) or, for
  processes meant to train alone, ignore it.
  """


def warn_if_training_alone(strategy, owner: str, stacklevel: int = 2) -> bool:
  """Warns, with ``UnsynchronizedWorkersWarning``, when ``TF_CONFIG`` names several
  workers but ``strategy`` spans this worker only.

  The trap it catches: a multi-worker job (a converted Horovod script) whose model and
  optimizer are built outside ``MultiWorkerMirroredStrategy.scope()``, or with no such
  strategy at all. Nothing fails then: every worker runs, exchanges payloads among its
  own replicas, reports its compression ratio and exits 0, having trained a model of
  its own. The optimizer wrappers call this once, at their first step, with the strategy
  of the replica context they exchange in (not when built: loading a saved model builds
  the optimizer too, often outside any strategy, and trains nothing).

  Args:
    strategy: the ``tf.distribute.Strategy`` whose replicas the optimizer exchanges
      with (``tf.distribute.get_strategy()`` in its replica context: the default
      strategy outside any scope).
    owner: the wrapper, as the message names it.
    stacklevel: as ``warnings.warn``'s, counted from this function's caller (2: the
      line that called this).

  Returns:
    Whether it warned: ``TF_CONFIG`` is valid, names more than one chief or worker
    task, this process is one of them (an evaluator or parameter server runs alone by
    design), and ``strategy`` is not a multi-worker strategy with more than one worker.
    No ``TF_CONFIG``, or one that ``multi_worker_strategy`` would refuse, never warns:
    that strategy's own check names what is wrong.
  """
  raw = os.environ.get("TF_CONFIG")
  if not raw:
    return False
  try:
    config = _check_tf_config(raw)
  except ValueError:
    return False
  workers = _worker_count(config)
  task = config["task"]
  if workers < 2 or task["type"] not in ("chief", "worker") or _spans_workers(strategy):
    return False
  # TensorFlow's default strategy (outside any scope) has a private class name: say
  # what it means instead.
  if type(strategy).__name__.startswith("_Default"):
    where = "no tf.distribute strategy (outside any strategy.scope())"
  else:
    replicas = strategy.num_replicas_in_sync
    where = (f"a {type(strategy).__name__} of {replicas} replica"
             f"{'s' if replicas != 1 else ''} on this worker alone")
  # One line of the wrapper as the place, so that Python's default filter shows it
  # once per process however many optimizers a job makes.
  warnings.warn(
      f"TF_CONFIG names {workers} workers (this process is its {task['type']} "
      f"{task['index']}), but {owner} is training under {where}: its exchange spans this "
      f"process only, so each worker trains a model of its own, unsynchronised, and still "
      f"exits 0. To train one model on the {workers} workers, create a "
      f"tf.distribute.MultiWorkerMirroredStrategy (or "
      f"tf_adacomp.distribute.multi_worker_strategy()) at the start of every worker, "
      f"build the model and the optimizer and call model.compile under its "
      f"strategy.scope(), and batch the dataset with the global batch size (the per-worker "
      f"batch times {workers}). If each process is meant to train alone, unset TF_CONFIG. "
      f"(warnings.simplefilter(\"error\", tf_adacomp.UnsynchronizedWorkersWarning) "
      f"makes this an error.)", UnsynchronizedWorkersWarning, stacklevel=stacklevel)
  return True


def warn_once_if_training_alone(optimizer, owner: str) -> None:
  """``warn_if_training_alone`` for an optimizer wrapper, at its first step only.

  Called from the wrapper's apply, in the replica context its exchange runs in; not from
  ``build``, which also runs where nothing trains (``keras.saving.load_model`` builds the
  optimizer to restore it, often outside any strategy, to export the model).

  Args:
    optimizer: the wrapper (it remembers that it was checked).
    owner: the wrapper, as the message names it.
  """
  if optimizer.__dict__.get("_workers_checked"):
    return
  # Through __dict__: the Keras wrappers track what is set as an attribute.
  optimizer.__dict__["_workers_checked"] = True
  warn_if_training_alone(tf.distribute.get_strategy(), owner, stacklevel=3)


def _spans_workers(strategy) -> bool:
  """Whether ``strategy`` synchronises several workers: a ``MultiWorkerMirroredStrategy``
  of more than one worker (its replicas are the workers' devices), or a parameter
  server strategy (the workers share the parameter servers' variables)."""
  if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    return strategy.num_replicas_in_sync > len(strategy.extended.worker_devices)
  return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


def _is_address(address) -> bool:
  """Whether ``address`` is a "host:port" str with a port in 1..65535."""
  if not isinstance(address, str):
    return False
  host, _, port = address.rpartition(":")
  return bool(host) and port.isdigit() and 0 < int(port) < 65536


def _cluster_buffer(cluster: dict) -> tf.Tensor:
  """int32 ``[1, 8 + 1 + _CLUSTER_TEXT_BYTES]``: the SHA-256 of the cluster's canonical
  JSON, the text's length, then its first bytes (0-padded)."""
  text = json.dumps(cluster, sort_keys=True, separators=(",", ":")).encode()
  digest = hashlib.sha256(text).digest()
  words = [int.from_bytes(digest[i:i + 4], "little", signed=True) for i in range(0, 32, 4)]
  head = list(text[:_CLUSTER_TEXT_BYTES])
  row = words + [len(text)] + head + [0] * (_CLUSTER_TEXT_BYTES - len(head))
  return tf.constant([row], tf.int32)


def _cluster_of_buffer(row) -> str:
  """The (possibly cut) cluster text of one row of ``_cluster_buffer``."""
  length = int(row[8])
  text = bytes(int(b) for b in row[9:9 + min(length, _CLUSTER_TEXT_BYTES)]).decode(
      errors="replace")
  return text if length <= _CLUSTER_TEXT_BYTES else text + "..."


def _first_reason(error: Exception) -> str:
  """The line of a TensorFlow error that says what went wrong (not "Graph execution
  error:", nor the Python frames of the op's definition)."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  for line in lines:
    if "aborted by" in line:
      return line[:500]
  noise = ("Graph execution error", "Detected at node", "File ")
  return next((line[:500] for line in lines if not line.startswith(noise)), repr(error))


def _check_same_cluster(strategy, config: dict) -> None:
  """Checks, with one all-gather, that every worker's TF_CONFIG lists this cluster.

  TensorFlow compares no cluster: a worker whose TF_CONFIG lists fewer workers than
  the others is only caught at the first collective ("joining a group with size 3,
  but that group has size 2"), one that lists another address gets "Connection
  refused", both naming no TF_CONFIG. (When the collective leader, the chief or worker
  0, lists more workers than exist, ``MultiWorkerMirroredStrategy()`` itself waits for
  them, and this check is never reached: TensorFlow's start-up barrier has no timeout
  that can be set.)

  Args:
    strategy: the new ``MultiWorkerMirroredStrategy``.
    config: this worker's parsed ``TF_CONFIG``.

  Raises:
    ValueError: a worker's cluster differs from this one, or the gather failed.
  """
  cluster = config["cluster"]
  mine = _cluster_buffer(cluster)
  ours = json.dumps(cluster, sort_keys=True)
  try:
    values = strategy.experimental_distribute_values_from_function(lambda _: mine)
    rows = strategy.gather(values, axis=0).numpy()
  except (tf.errors.OpError, RuntimeError) as error:
    raise ValueError(
        f"The workers could not compare their clusters, most likely because their "
        f"TF_CONFIGs list different clusters (another number of workers or other "
        f"addresses). TensorFlow said: {_first_reason(error)} "
        f"Received: TF_CONFIG[\"cluster\"]={ours} "
        f"(task {config['task']!r})") from error
  for row in rows:
    if not (row[:8] == mine.numpy()[0, :8]).all():
      raise ValueError(
          f"The workers' TF_CONFIGs list different clusters: this worker's is {ours}, "
          f"another worker's is {_cluster_of_buffer(row)}. Give every worker the same "
          f"\"cluster\". Received: TF_CONFIG[\"cluster\"]={ours} "
          f"(task {config['task']!r})")


def tf_config(worker_addresses: Sequence[str], index: int) -> str:
  """The ``TF_CONFIG`` JSON of worker ``index`` in a cluster of workers only.

  Args:
    worker_addresses: "host:port" of every worker, in task order (worker 0 is the
      chief).
    index: this worker's position in ``worker_addresses``.

  Returns:
    ``'{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": index}}'``.

  Raises:
    TypeError: ``worker_addresses`` not a list or tuple of str; ``index`` not an int.
    ValueError: no address, an address not "host:port" with a numeric port, a repeated
      address, or ``index`` out of range.
  """
  if isinstance(worker_addresses, str) or not isinstance(worker_addresses, (list, tuple)):
    raise TypeError(f"`worker_addresses` must be a list or tuple of 'host:port' strings. "
                    f"Received: worker_addresses={worker_addresses!r}")
  if not worker_addresses:
    raise ValueError(f"`worker_addresses` must not be empty. "
                     f"Received: worker_addresses={worker_addresses!r}")
  for address in worker_addresses:
    if not isinstance(address, str):
      raise TypeError(f"`worker_addresses` must hold 'host:port' strings. "
                      f"Received: worker_addresses={worker_addresses!r}")
    if not _is_address(address):
      raise ValueError(f"Each worker address must be 'host:port' with a port in 1..65535. "
                       f"Received: worker_addresses={worker_addresses!r}")
  if len(set(worker_addresses)) != len(worker_addresses):
    raise ValueError(f"`worker_addresses` must not repeat an address. "
                     f"Received: worker_addresses={worker_addresses!r}")
  index = checks.typed_int(index, "index", 0)
  if index >= len(worker_addresses):
    raise ValueError(f"`index` must be < len(worker_addresses) = {len(worker_addresses)}. "
                     f"Received: index={index}")
  return json.dumps({"cluster": {"worker": list(worker_addresses)},
                     "task": {"type": "worker", "index": index}})
