"""The examples' data: ``Data`` (what an example's ``load_data`` returns), the input
pipelines, and helpers for the loaders (split sizes, synthetic data)."""

import dataclasses
from typing import Any, Dict

import numpy as np
import tensorflow as tf


@dataclasses.dataclass
class Data:
  """An example's data: unbatched ``(x, y)`` datasets and split sizes.

  ``train`` is shuffled and augmented (``pipelines`` repeats and batches it); ``test``
  is in order.
  """
  train: Any
  test: Any
  train_size: int
  test_size: int
  info: Dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. vocabulary size


def pipelines(data: Data, config):
  """Batched, prefetched ``(train, test)``; under multi_worker, sharded across workers.

  ``train`` repeats, in batches of the global batch size (``config.batch_size``).
  """
  options = tf.data.Options()
  # Data in memory or in a few files are sharded by example; an example whose data lie
  # in many files (ImageNet) says "AUTO" (by file) in Data.info["shard_policy"].
  policy = data.info.get("shard_policy", "DATA")
  options.experimental_distribute.auto_shard_policy = getattr(
      tf.data.experimental.AutoShardPolicy, policy)
  train = (data.train.repeat().batch(config.batch_size, drop_remainder=True)
           .prefetch(tf.data.AUTOTUNE).with_options(options))
  test = data.test.batch(config.batch_size).prefetch(tf.data.AUTOTUNE).with_options(options)
  return train, test


def split_size(info, split, dataset) -> int:
  """Examples in a tfds split: from its metadata, else by counting ``dataset``.

  (``tfds.testing.mock_data`` generates examples without split metadata.)
  """
  try:
    return info.splits[split].num_examples
  except KeyError:
    count = int(dataset.cardinality())
    return count if count >= 0 else int(dataset.reduce(0, lambda n, _: n + 1))


def synthetic_data(x_shape, num_classes, train_size, test_size, seed, x_dtype="float32",
                   y_shape=()):
  """Random inputs of ``x_shape`` and labels in ``[0, num_classes)`` (smoke runs)."""
  rng = np.random.default_rng(seed)

  def split(size):
    if x_dtype == "int32":
      x = rng.integers(0, num_classes, (size, *x_shape), dtype=np.int32)
    else:
      x = rng.standard_normal((size, *x_shape)).astype(x_dtype)
    y = rng.integers(0, num_classes, (size, *y_shape), dtype=np.int32)
    return tf.data.Dataset.from_tensor_slices((x, y))

  return Data(split(train_size).shuffle(train_size, seed=seed), split(test_size),
              train_size, test_size)
