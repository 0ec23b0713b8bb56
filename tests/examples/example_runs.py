"""Helpers for the example tests: small configs, what every summary must hold, data
files in the datasets' own formats, and a machine without network."""

import gzip
import io
import json
import math
import os
import tarfile
import textwrap
import threading

import numpy as np
import pytest

from tf_adacomp.examples import fashion_mnist
from tf_adacomp.examples import flags_and_config

SUMMARY_FIELDS = {
    "example", "compressor", "strategy", "replicas", "steps", "batch_size", "test_accuracy",
    "test_loss", "compression", "bytes_sent_per_step", "dense_bytes_per_step",
    "compression_ratio", "train_seconds", "wall_seconds", "config"}


def small_config(example, model_dir, **overrides):
  """Two replicas, a few steps of a small batch, quiet: a smoke run of ``example``."""
  settings = dict(replicas=2, epochs=1, steps_per_epoch=3, eval_steps=2, batch_size=8,
                  verbose=0, model_dir=str(model_dir))
  settings.update(overrides)
  return flags_and_config.make_config(example, **settings)


def check_summary(summary, model_dir, kinds):
  """The summary has every field, per-kind ratios, and was written as JSON."""
  assert SUMMARY_FIELDS <= set(summary), SUMMARY_FIELDS - set(summary)
  assert set(kinds) | {"total"} <= set(summary["compression"])
  for entry in summary["compression"].values():
    assert entry["sent_bytes_per_step"] > 0 and math.isfinite(entry["ratio"])
  assert 0.0 <= summary["test_accuracy"] <= 1.0
  if summary["compressor"] != "none":  # per variable, adding up to the per-kind figures
    variables = summary["variables"]
    assert {v["kind"] for v in variables.values()} == set(summary["compression"]) - {"total"}
    assert math.isclose(sum(v["sent_bytes_per_step"] for v in variables.values()),
                        summary["bytes_sent_per_step"], rel_tol=1e-9)
  with open(os.path.join(model_dir, "summary.json")) as f:
    written = json.load(f)
  assert json.dumps(written, sort_keys=True) == json.dumps(summary, sort_keys=True)


def write_idx(path, array, compress=True):
  """Writes ``array`` as an unsigned-byte IDX file (gzipped unless ``compress`` is False)."""
  header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
      int(n).to_bytes(4, "big") for n in array.shape)
  opener = gzip.open if compress else open
  with opener(path, "wb") as f:
    f.write(header + array.astype(np.uint8).tobytes())


def write_fashion_mnist(directory, n_train=64, n_test=16):
  """Random images and labels under Fashion-MNIST's four IDX file names."""
  rng = np.random.default_rng(0)
  for split, n in (("train", n_train), ("test", n_test)):
    images, labels = fashion_mnist.FILES[split]
    write_idx(os.path.join(directory, images), rng.integers(0, 256, (n, 28, 28)))
    write_idx(os.path.join(directory, labels), rng.integers(0, 10, (n,)))


NETWORK_BLOCKED = "network blocked by the test"


class _Downloads:
  """tfds downloads submitted and not yet finished (``wait`` until there are none)."""

  def __init__(self):
    self.count = 0
    self.changed = threading.Condition()

  def add(self, step):
    with self.changed:
      self.count += step
      self.changed.notify_all()

  def wait(self, timeout=60):
    with self.changed:
      return self.changed.wait_for(lambda: self.count == 0, timeout)


def block_network(monkeypatch):
  """This process as on a machine without network: no name resolves, no socket
  connects (a CI machine may have network), and urllib3 retries without waiting, so
  that tfds' real downloader (its requests session, 10 retries with backoff: 3.4 minutes
  here without network) fails at once.

  Returns:
    The tfds downloads under way (``wait()``): a dataset of several files (fashion_mnist)
    fails on its first, while its other downloads still run in tfds' threads, which must
    not outlive the block (they would retry on the real network with backoff, and the
    process waits for them when it exits). The ``no_network`` fixture waits.
  """
  import socket  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.core.download import downloader  # pylint: disable=g-import-not-at-top

  def unreachable(*args, **kwargs):
    del args, kwargs
    raise socket.gaierror(socket.EAI_NONAME, NETWORK_BLOCKED)

  monkeypatch.setattr(socket, "getaddrinfo", unreachable)
  monkeypatch.setattr(socket.socket, "connect", unreachable)  # addresses given as numbers
  # The Retry class of tfds' requests session (urllib3's, reached through tfds).
  retry = downloader.requests.packages.urllib3.util.retry.Retry
  monkeypatch.setattr(retry, "get_backoff_time", lambda self: 0.0)
  # Counted from submission (tfds' download) to the end of tfds' own _sync_download,
  # which runs unchanged in tfds' thread pool.
  downloads = _Downloads()
  cls = downloader._Downloader  # pylint: disable=protected-access
  submit, fetch = cls.download, cls._sync_download  # pylint: disable=protected-access

  def counted_submit(self, *args, **kwargs):
    downloads.add(1)
    return submit(self, *args, **kwargs)

  def counted_fetch(self, *args, **kwargs):
    try:
      return fetch(self, *args, **kwargs)
    finally:
      downloads.add(-1)

  monkeypatch.setattr(cls, "download", counted_submit)
  monkeypatch.setattr(cls, "_sync_download", counted_fetch)
  return downloads


@pytest.fixture
def no_network(monkeypatch):
  """``block_network`` for a test; tfds' downloads end before the network comes back."""
  downloads = block_network(monkeypatch)
  yield
  assert downloads.wait(), "tfds downloads still running 60 s after the test"


# block_network for the processes a test starts (and theirs): Python imports
# `sitecustomize` from PYTHONPATH at start-up.
_SITECUSTOMIZE = textwrap.dedent(f"""\
    import socket
    import urllib3

    def _unreachable(*args, **kwargs):
      raise socket.gaierror(socket.EAI_NONAME, {NETWORK_BLOCKED!r})

    socket.getaddrinfo = _unreachable
    socket.socket.connect = _unreachable
    urllib3.util.retry.Retry.get_backoff_time = lambda self: 0.0
    """)


def env_without_network(directory, env=None):
  """``env`` (default: this process's) for a process without network (block_network's
  ``sitecustomize`` written to ``directory``, first on PYTHONPATH)."""
  env = dict(os.environ if env is None else env)
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "sitecustomize.py"), "w") as f:
    f.write(_SITECUSTOMIZE)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), env.get("PYTHONPATH")]))
  return env


CIFAR10_LABELS = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                  "ship", "truck")
CIFAR10_TRAIN_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)]


def write_cifar10_archive(directory, per_file=4, test_size=8):
  """``cifar-10-binary.tar.gz`` as www.cs.toronto.edu serves it, with random images.

  ``cifar-10-batches-bin/`` holds ``data_batch_{1..5}.bin`` (``per_file`` records each)
  and ``test_batch.bin``: records of one label byte and 3,072 pixel bytes (1,024 red,
  then green, then blue, rows of 32), and ``batches.meta.txt``, the class names.

  Returns:
    ``(path, {"train": (images [n, 32, 32, 3] uint8, labels [n]), "test": ...})``.
  """
  rng = np.random.default_rng(0)
  files, arrays = {}, {"train": ([], []), "test": ([], [])}
  for name, split, n in [(f, "train", per_file) for f in CIFAR10_TRAIN_FILES] + [
      ("test_batch.bin", "test", test_size)]:
    images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, n, dtype=np.uint8)
    planes = images.transpose(0, 3, 1, 2).reshape(n, 3072)  # channel by channel
    files[name] = np.concatenate([labels[:, None], planes], axis=1).tobytes()
    arrays[split][0].append(images)
    arrays[split][1].append(labels)
  files["batches.meta.txt"] = ("\n".join(CIFAR10_LABELS) + "\n\n").encode()
  path = os.path.join(directory, "cifar-10-binary.tar.gz")
  with tarfile.open(path, "w:gz") as archive:
    for name, content in files.items():
      info = tarfile.TarInfo(f"cifar-10-batches-bin/{name}")
      info.size = len(content)
      archive.addfile(info, io.BytesIO(content))
  return path, {split: (np.concatenate(images), np.concatenate(labels))
                for split, (images, labels) in arrays.items()}


def serve_cifar10_from(monkeypatch, archive):
  """tfds' own ``cifar10`` builder downloads ``archive`` (a local path) instead of its
  URL: tfds' downloader copies a path that is not http(s) with ``tf.io.gfile``; the
  extraction, ``_split_generators``, ``_generate_examples`` and the writing of the
  prepared dataset are tfds' own."""
  from tensorflow_datasets.image_classification import cifar  # pylint: disable=g-import-not-at-top

  info = cifar.Cifar10._cifar_info  # pylint: disable=protected-access
  monkeypatch.setattr(cifar.Cifar10, "_cifar_info",
                      property(lambda self: info.fget(self)._replace(url=archive)))
  # Its registered URLs and checksums are the real archive's: a local archive has none
  # (and the examples' probe of the download hosts, input_data.unreachable_download_host,
  # has no host to probe).
  monkeypatch.setattr(cifar.Cifar10, "url_infos", None)


def mock_tfds(monkeypatch, **kwargs):
  """``tfds.testing.mock_data(**kwargs)`` (generated examples in place of tfds' download
  and prepare), with the examples' probe of the download hosts off: it runs before the
  download, which the mock replaces, and would find no network here."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  from tf_adacomp.examples import input_data  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(input_data, "unreachable_download_host", lambda builder: None)
  return tfds.testing.mock_data(**kwargs)
