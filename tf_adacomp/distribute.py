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
given here: its workers must agree on them, and a process makes one such strategy. (The
whole key space, these ranges and the hierarchy's: ``tf_adacomp.collective_keys``.)
"""

import os
from typing import List, Optional, Sequence
import warnings

import tensorflow as tf

from tf_adacomp import cluster
from tf_adacomp import collective_keys
from tf_adacomp.cluster import tf_config
from tf_adacomp.compat import internals
from tf_adacomp.compat.keras_multi_worker import apply_keras_multi_worker_fix
from tf_adacomp.compressors import get_compressor
from tf_adacomp.cross_device_ops import CompressedAllReduce
from tf_adacomp.ops import checks

__all__ = ["UnsynchronizedWorkersWarning", "mirrored_strategy", "multi_worker_strategy",
           "split_logical_devices", "tf_config", "warn_if_training_alone",
           "warn_once_if_training_alone"]

# Each MirroredStrategy (v2 and v1, one counter) made in this process gets a block of
# collective keys of its own (see the module doc; the key space: collective_keys).
internals.own_collective_keys_per_strategy(collective_keys.next_strategy_key_base)


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
  ``tf_adacomp.cluster.check_tf_config`` for what a valid one is. With several workers,
  the workers then exchange their clusters once (one all-gather of a fixed-size buffer):
  workers whose ``TF_CONFIG`` lists another cluster fail here, with both clusters in the
  error, rather than at the first collective of training with TensorFlow's "joining a
  group with size 3, but that group has size 2" or "Connection refused".

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
  config = cluster.check_tf_config(raw) if raw else None
  if num_workers is not None:
    found = cluster.worker_count(config) if config else 1
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
  if config and config["task"]["type"] != "evaluator" and cluster.worker_count(config) > 1:
    cluster.check_same_cluster(strategy, config)
  return strategy


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
    config = cluster.check_tf_config(raw)
  except ValueError:
    return False
  workers = cluster.worker_count(config)
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
