"""Strategy helpers: logical devices, MirroredStrategy with compression, multi-worker set-up.

- ``split_logical_devices(4)``: four logical CPUs (or GPUs) out of one, for
  ``MirroredStrategy`` with real collectives on a single device;
- ``mirrored_strategy("adacomp")``: ``MirroredStrategy`` whose all-reduce exchanges
  compressed gradients (``tf_adacomp.cross_device_ops.CompressedAllReduce``); every
  strategy it builds has collective keys of its own (see ``mirrored_strategy``);
- ``multi_worker_strategy()``: ``MultiWorkerMirroredStrategy`` from ``TF_CONFIG``, with
  the Keras fix that makes ``model.fit`` work under it (``tf_adacomp.keras_fixes``);
- ``tf_config(addresses, index)``: the ``TF_CONFIG`` of one worker of a cluster.

Under ``MultiWorkerMirroredStrategy`` the cross-device ops cannot be replaced, so
compression there goes through ``tf_adacomp.CompressedOptimizer`` instead.
"""

import itertools
import json
import os
from typing import List, Optional, Sequence

import tensorflow as tf

from tf_adacomp import internals
from tf_adacomp.compressors import get_compressor
from tf_adacomp.keras_fixes import apply_keras_multi_worker_fix
from tf_adacomp.ops import checks

__all__ = ["mirrored_strategy", "multi_worker_strategy", "split_logical_devices", "tf_config"]

# Collective key ranges for the strategies mirrored_strategy builds (see there). TensorFlow's
# own tests space them the same way (tensorflow/python/distribute/strategy_combinations.py);
# group keys are int32, so the ranges wrap around after 20000 strategies.
_COLLECTIVE_KEY_STEP = 100_000
_COLLECTIVE_KEY_RANGES = 20_000
_collective_key_counter = itertools.count(1)


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

  Every strategy built here numbers its collectives from a key range of its own.
  ``tf.distribute.MirroredStrategy`` objects all start from the same keys (group 1,
  instance 100), and TensorFlow keeps the shape it first saw under a key for the whole
  process: after one strategy has trained a model, a second one over the same devices
  training a model of another size fails with "Shape mismatch in the collective
  instance 100", and aborts the collectives of the process. (The range is set through
  ``MirroredStrategy._collective_key_base``, on the instance only: see ``internals``.)

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
    return _new_mirrored_strategy(devices, cross_device_ops)
  if compressor is None:
    if compressor_kwargs:
      raise ValueError("Compressor arguments were given without a compressor. "
                       f"Received: compressor=None, compressor_kwargs={compressor_kwargs!r}")
    return _new_mirrored_strategy(devices)

  compressor = get_compressor(compressor, **compressor_kwargs)
  # Imported here: the cross-device ops module pulls in the collectives only when needed.
  from tf_adacomp.cross_device_ops import CompressedAllReduce  # pylint: disable=g-import-not-at-top
  return _new_mirrored_strategy(devices, CompressedAllReduce(compressor))


def _new_mirrored_strategy(devices, cross_device_ops=None):
  """``MirroredStrategy(devices, cross_device_ops)`` with collective keys of its own."""
  cls = tf.distribute.MirroredStrategy
  strategy = cls.__new__(cls)
  # MirroredExtended.__init__ reads the base from the strategy: set on this instance only.
  key_range = next(_collective_key_counter) % _COLLECTIVE_KEY_RANGES + 1
  internals.set_collective_key_base(strategy, key_range * _COLLECTIVE_KEY_STEP)
  strategy.__init__(devices, cross_device_ops=cross_device_ops)
  return strategy


def multi_worker_strategy() -> tf.distribute.MultiWorkerMirroredStrategy:
  """A ``MultiWorkerMirroredStrategy`` (gRPC, cluster from ``TF_CONFIG``), Keras-ready.

  Applies ``tf_adacomp.keras_fixes.apply_keras_multi_worker_fix()`` so that Keras 3
  ``model.fit``/``evaluate`` work under it. Must run before TensorFlow initialises its
  devices. Gradient compression under this strategy goes through
  ``tf_adacomp.CompressedOptimizer``: its cross-device ops cannot be replaced.

  Returns:
    ``tf.distribute.MultiWorkerMirroredStrategy()``.

  Raises:
    ValueError: ``TF_CONFIG`` is set but is not a JSON object.
  """
  raw = os.environ.get("TF_CONFIG")
  if raw:
    try:
      parsed = json.loads(raw)
    except ValueError as error:
      raise ValueError(f"The TF_CONFIG environment variable is not valid JSON. "
                       f"Received: TF_CONFIG={raw!r}") from error
    if not isinstance(parsed, dict):
      raise ValueError(f"The TF_CONFIG environment variable must hold a JSON object. "
                       f"Received: TF_CONFIG={raw!r}")
  apply_keras_multi_worker_fix()
  return tf.distribute.MultiWorkerMirroredStrategy()


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
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
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
