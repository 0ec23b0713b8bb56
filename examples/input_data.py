"""The examples' data: ``Data`` (what an example's ``load_data`` returns), the input
pipelines, and helpers for the loaders (tfds datasets, split sizes, synthetic data;
``DataUnavailable`` when there are no data)."""

import dataclasses
import logging
import os
import socket
import urllib.parse
from typing import Any, Dict, Optional

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


class DataUnavailable(RuntimeError):
  """An example found no data (no network, nothing prepared, no archives, no files).

  Its message names the ways out; ``training.run`` prints it and exits non-zero, without
  a traceback: nothing is wrong with the program, the data are missing.
  """


# A cause longer than this is cut: the message stays one readable line.
_CAUSE_CHARS = 200


def _cause(error) -> str:
  """``Type: first line of the message``, short (requests' ConnectionError repeats its
  whole chain of causes in one line)."""
  text = str(error).strip().split("\n")[0].split(" (Caused by ")[0]
  if ". " in text:  # the first sentence (tfds' manual_dir error goes on to instructions)
    text = text[:text.index(". ")]
  if len(text) > _CAUSE_CHARS:
    text = text[:_CAUSE_CHARS - 3] + "..."
  return f"{type(error).__name__}: {text}" if text else type(error).__name__


def tfds_builder(name, config, ways_out=(), **download_config):
  """tfds' builder of dataset ``name``, downloaded and prepared in ``config.data_dir``.

  Args:
    name: the tfds dataset ("cifar10", "tiny_shakespeare", ...).
    config: the run's settings; ``config.data_dir`` is tfds' data directory (None: tfds'
      default, ``~/tensorflow_datasets``).
    ways_out: what else the example can train on without tfds' download, each as
      "--flag=VALUE (what it gives)": the message names them after ``--data_dir`` (a
      prepared tfds directory) and before ``--synthetic``.
    **download_config: ``tfds.download.DownloadConfig`` settings (ImageNet: the
      ``manual_dir`` of archives downloaded by hand), named with their values in the
      message.

  Returns:
    The prepared ``tfds.core.DatasetBuilder`` (``as_dataset``, ``info``).

  Raises:
    DataUnavailable: tfds could not download or prepare ``name`` (no network, no archive
      in ``manual_dir``, a data directory it cannot write); the message names the cause,
      the ways out and the directories received.
  """
  import tensorflow_datasets as tfds

  # Looking for a prepared copy, tfds warns about every folder it finds without one (its
  # own absl logger): that is what the message below says, once.
  absl_logger = logging.getLogger("absl")
  level = absl_logger.level
  absl_logger.setLevel(logging.ERROR)
  try:
    builder = tfds.builder(name, data_dir=config.data_dir)
    prepared = builder.is_prepared()
  finally:
    absl_logger.setLevel(level)

  def unavailable(cause):
    ways = [f"--data_dir=DIR (a tfds data directory with {name} prepared)", *ways_out,
            "--synthetic (random data: a smoke run)"]
    received = ", ".join(f"{key}={value!r}" for key, value in
                         dict(data_dir=config.data_dir, **download_config).items())
    return DataUnavailable(
        f"No {name} data: tensorflow-datasets could not download or prepare it "
        f"({cause}). Ways out: {'; '.join(ways)}. Received: {received}")

  # A data set of archives downloaded by hand (ImageNet) gets tfds' own error, which
  # says where they go.
  manual = getattr(builder, "MANUAL_DOWNLOAD_INSTRUCTIONS", None)
  host = None if prepared or manual else unreachable_download_host(builder)
  if host is not None:
    raise unavailable(f"no connection to {host} within {PROBE_S:.0f} s")
  try:
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(**download_config))
  except ImportError:
    raise  # a package missing from the installation, not missing data: shown as it is
  except Exception as error:  # tfds raises many kinds when it cannot download or prepare
    raise unavailable(_cause(error)) from error
  return builder


# How long a connection to a download host may take to open before the data count as
# unreachable. tfds' downloader would retry each file 10 times with back-off, about 3.5
# minutes, printing a warning per retry, before it fails; and the other files' downloads
# go on retrying in its threads, holding the process at exit.
PROBE_S = 5.0
# tfds tries its own copy of many data sets on Google Cloud Storage first.
TFDS_GCS_HOST = "storage.googleapis.com"
_PROXY_VARIABLES = ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy",
                    "ALL_PROXY")


def unreachable_download_host(builder) -> Optional[str]:
  """The first of ``builder``'s download hosts if none of them (nor tfds' Cloud Storage)
  accepts a connection within ``PROBE_S`` seconds; None if one does, or if this cannot
  tell (behind a proxy, which only the download's own requests reach; no http(s) URLs
  registered with the builder).
  """
  if any(os.environ.get(variable) for variable in _PROXY_VARIABLES):
    return None
  urls = [urllib.parse.urlsplit(url) for url in (type(builder).url_infos or {})]
  hosts = {}
  for url in urls:
    if url.scheme in ("http", "https") and url.hostname:
      hosts.setdefault(url.hostname, url.port or (443 if url.scheme == "https" else 80))
  if not hosts:
    return None
  for host, port in [*hosts.items(), (TFDS_GCS_HOST, 443)]:
    try:
      socket.create_connection((host, port), timeout=PROBE_S).close()
      return None
    except OSError:  # no name resolution, refused, unreachable or timed out
      continue
  return next(iter(hosts))


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
