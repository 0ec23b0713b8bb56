"""The ``tf.distribute`` strategy of a run: its replicas' devices, and who is chief."""

from typing import Optional

import tensorflow as tf

from tf_adacomp import distribute
from tf_adacomp.cross_device_ops import CompressedAllReduce
from tf_adacomp.examples import optimizers


def replica_devices(count: Optional[int]):
  """Device names for ``count`` local replicas (None: every GPU, else one CPU).

  Uses the first ``count`` GPUs; with fewer GPUs, splits the first GPU (2 GiB each) or
  the CPU into logical devices. Call before anything else touches TensorFlow.
  """
  gpus = tf.config.list_physical_devices("GPU")
  if count is None:
    count = max(len(gpus), 1)
  if gpus and count <= len(gpus):
    return [f"/device:GPU:{i}" for i in range(count)]
  kind = "GPU" if gpus else "CPU"
  try:
    return distribute.split_logical_devices(
        count, kind, memory_limit=2048 if kind == "GPU" else None)
  except RuntimeError:
    # TensorFlow already runs with logical devices (a test's conftest): use them if enough.
    existing = tf.config.list_logical_devices(kind)
    if len(existing) < count:
      raise
    return [device.name for device in existing[:count]]


def make_strategy(config):
  """The ``tf.distribute`` strategy of ``config`` (a ``flags_and_config.Config``).

  ``--strategy`` and ``--replicas`` (logical devices where there are fewer GPUs than
  replicas: call before anything else touches TensorFlow's devices); with
  ``--exchange cross_device_ops``, a ``CompressedAllReduce`` of the configured compressor.
  """
  if config.strategy == "multi_worker":
    if config.replicas not in (None, 1) and not tf.config.list_physical_devices("GPU"):
      raise ValueError("Under --strategy=multi_worker each CPU worker is one replica (add "
                       f"workers to TF_CONFIG instead). Received: replicas={config.replicas}")
    return distribute.multi_worker_strategy()
  devices = replica_devices(config.replicas)
  if config.strategy == "one_device":
    return tf.distribute.OneDeviceStrategy(devices[0])
  if config.exchange == "cross_device_ops" and (config.compressor != "none"
                                                or config.reduction != "sum"):
    return distribute.mirrored_strategy(
        devices=devices, cross_device_ops=CompressedAllReduce(
            optimizers.make_compressor(config), start_step=config.start_step,
            reduction=config.reduction))
  return distribute.mirrored_strategy(devices=devices)


def is_chief(strategy) -> bool:
  """True except on the non-chief workers of a multi-worker cluster."""
  resolver = getattr(strategy, "cluster_resolver", None)
  if resolver is None or not resolver.cluster_spec().as_dict():
    return True
  return resolver.task_type == "chief" or (
      resolver.task_type == "worker" and resolver.task_id == 0
      and "chief" not in resolver.cluster_spec().as_dict())
