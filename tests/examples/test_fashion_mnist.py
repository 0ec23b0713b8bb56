"""The Fashion-MNIST example: IDX reading, the data sources, a real training run."""

import gzip

import numpy as np
import pytest

import example_runs
from tf_adacomp.examples import fashion_mnist
from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import training

HAVE_FILES = fashion_mnist.idx_directory(
    flags_and_config.make_config(fashion_mnist)) is not None
needs_files = pytest.mark.skipif(not HAVE_FILES, reason="Debian's dataset-fashion-mnist is "
                                 "not installed (apt-get install dataset-fashion-mnist)")


@pytest.mark.parametrize("compress", [True, False])
def test_read_idx_round_trip(tmp_path, compress):
  array = np.arange(2 * 3 * 4).reshape(2, 3, 4)
  path = str(tmp_path / ("a.idx.gz" if compress else "a.idx"))
  example_runs.write_idx(path, array, compress)
  np.testing.assert_array_equal(fashion_mnist.read_idx(path), array)


def test_read_idx_rejects_other_files(tmp_path):
  bad = tmp_path / "bad.gz"
  with gzip.open(bad, "wb") as f:
    f.write(b"\x00\x00\x0d\x01" + (3).to_bytes(4, "big") + b"\0" * 12)  # float IDX
  with pytest.raises(ValueError, match="path="):
    fashion_mnist.read_idx(str(bad))
  short = tmp_path / "short.gz"
  with gzip.open(short, "wb") as f:
    f.write(b"\x00\x00\x08\x01" + (5).to_bytes(4, "big") + b"\0" * 3)
  with pytest.raises(ValueError, match="3 bytes, its header says"):
    fashion_mnist.read_idx(str(short))


def test_data_dir_with_idx_files_is_read(tmp_path):
  example_runs.write_fashion_mnist(tmp_path)
  config = flags_and_config.make_config(fashion_mnist, data_dir=str(tmp_path))
  data = fashion_mnist.load_data(config)
  assert (data.train_size, data.test_size) == (64, 16)
  x, y = next(iter(data.test.batch(16)))
  assert x.shape == (16, 28, 28, 1) and 0.0 <= float(x.numpy().min())
  assert float(x.numpy().max()) <= 1.0 and y.dtype == "int32"


def test_without_idx_files_tfds_is_used(tmp_path, monkeypatch):
  monkeypatch.setattr(fashion_mnist, "DEBIAN_DIR", str(tmp_path / "absent"))
  config = flags_and_config.make_config(fashion_mnist, data_dir=str(tmp_path))
  with example_runs.mock_tfds(monkeypatch, num_examples=12):
    data = fashion_mnist.load_data(config)
  assert (data.train_size, data.test_size) == (12, 12)
  x, _ = next(iter(data.train.batch(4)))
  assert x.shape == (4, 28, 28, 1)


@needs_files
def test_the_installed_files_are_the_real_dataset():
  arrays = fashion_mnist.load_arrays(flags_and_config.make_config(fashion_mnist))
  assert arrays["train"][0].shape == (60000, 28, 28)
  assert arrays["test"][0].shape == (10000, 28, 28)
  assert np.bincount(arrays["train"][1]).tolist() == [6000] * 10


@pytest.mark.slow
def test_trains_with_adacomp_and_writes_its_summary(tmp_path):
  """Real files when installed (synthetic data otherwise): a few AdaComp steps."""
  config = example_runs.small_config(fashion_mnist, tmp_path, compressor="adacomp",
                                     synthetic=not HAVE_FILES)
  summary = training.train(fashion_mnist, config)
  example_runs.check_summary(summary, tmp_path, kinds=("conv", "dense", "vector"))
  assert summary["steps"] == 3 and summary["replicas"] == 2
  assert summary["compression"]["dense"]["ratio"] > 20
  assert summary["bytes_sent_per_step"] < summary["dense_bytes_per_step"] / 10
