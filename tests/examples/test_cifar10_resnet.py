"""The CIFAR-10 ResNet example: the network of He et al., the tfds pipeline (mocked, and
tfds' real cifar10 builder on files in CIFAR-10's binary format), a short run."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import example_runs
from tf_adacomp.examples import cifar10_resnet
from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import training


@pytest.mark.parametrize("depth,parameters", [
    (20, 0.27e6),
    pytest.param(32, 0.46e6, marks=pytest.mark.slow),  # building the deeper ones: seconds
    pytest.param(56, 0.85e6, marks=pytest.mark.slow)])
def test_resnet_has_the_papers_size(depth, parameters):
  """He et al. 2016, table 6: 0.27M, 0.46M and 0.85M parameters."""
  model = cifar10_resnet.resnet_cifar(depth)
  convs = [l for l in model.layers if isinstance(l, tf.keras.layers.Conv2D)]
  assert len([c for c in convs if c.kernel_size == (3, 3)]) + 1 == depth  # + the dense
  assert model.count_params() == pytest.approx(parameters, rel=0.05)


def test_resnet_rejects_a_depth_that_is_not_6n_plus_2():
  with pytest.raises(ValueError, match="depth=21"):
    cifar10_resnet.resnet_cifar(21)


def test_augment_pads_crops_and_flips():
  image = tf.reshape(tf.range(32 * 32 * 3, dtype=tf.float32), [32, 32, 3])
  out = cifar10_resnet.augment(image)
  assert out.shape == (32, 32, 3)
  # Every output pixel is an input pixel or padding (0).
  assert set(np.unique(out.numpy())) <= set(np.unique(image.numpy())) | {0.0}


def test_the_tfds_pipeline_gives_normalised_images(tmp_path, monkeypatch):
  config = flags_and_config.make_config(cifar10_resnet, data_dir=str(tmp_path / "tfds"))
  with example_runs.mock_tfds(monkeypatch, num_examples=16):
    data = cifar10_resnet.load_data(config)
  x, y = next(iter(data.train.batch(4)))
  assert x.shape == (4, 32, 32, 3) and y.dtype == tf.int32
  assert abs(float(tf.reduce_mean(x))) < 3.0  # normalised


def test_tfds_prepares_cifar10_from_its_binary_archive(tmp_path, monkeypatch):
  """tfds' own cifar10 builder, from an archive in CIFAR-10's binary format through
  download (a local copy), extraction, _generate_examples and the prepared files, to the
  example's pipeline: the images and labels written come out (test split: normalised,
  in tfds' shuffled order)."""
  example_runs.block_network(monkeypatch)  # a redirect gone wrong must not download
  archive, written = example_runs.write_cifar10_archive(tmp_path, per_file=4, test_size=8)
  example_runs.serve_cifar10_from(monkeypatch, archive)
  config = flags_and_config.make_config(cifar10_resnet, data_dir=str(tmp_path / "tfds"))
  data = cifar10_resnet.load_data(config)
  assert (data.train_size, data.test_size) == (20, 8)  # from the prepared split metadata
  assert (tfds.builder("cifar10", data_dir=config.data_dir).info.features["label"].names
          == list(example_runs.CIFAR10_LABELS))  # from batches.meta.txt
  images, labels = next(iter(data.test.batch(8)))
  pixels = np.rint((images.numpy() * cifar10_resnet.STD + cifar10_resnet.MEAN) * 255)
  read = sorted((int(y), x.astype(np.uint8).tobytes()) for x, y in zip(pixels, labels))
  assert read == sorted((int(y), x.tobytes()) for x, y in zip(*written["test"]))
  x, y = next(iter(data.train.batch(20)))
  assert x.shape == (20, 32, 32, 3) and sorted(y.numpy()) == sorted(written["train"][1])


@pytest.mark.slow
def test_trains_on_the_tfds_pipeline(tmp_path, monkeypatch):
  """From CIFAR-10's binary archive through tfds' real cifar10 builder (as
  test_tfds_prepares_cifar10_from_its_binary_archive) to model.fit."""
  example_runs.block_network(monkeypatch)
  archive, _ = example_runs.write_cifar10_archive(tmp_path, per_file=4, test_size=8)
  example_runs.serve_cifar10_from(monkeypatch, archive)
  # One replica (one compile of the step): the replicas' exchange is tested elsewhere.
  config = example_runs.small_config(cifar10_resnet, tmp_path, compressor="fp16",
                                     replicas=1, eval_steps=1,
                                     data_dir=str(tmp_path / "tfds"))
  summary = training.train(cifar10_resnet, config)
  example_runs.check_summary(summary, tmp_path, kinds=("conv", "dense", "vector"))
  assert summary["steps"] == 3
  assert summary["compression_ratio"] == pytest.approx(2.0, rel=0.01)  # float16
  trainable = cifar10_resnet.resnet_cifar(20).trainable_weights
  assert summary["parameters"] == sum(int(np.prod(v.shape)) for v in trainable)


def test_fashion_mnist_stands_in_for_cifar(tmp_path):
  example_runs.write_fashion_mnist(tmp_path)
  config = flags_and_config.make_config(cifar10_resnet, dataset="fashion_mnist",
                                        data_dir=str(tmp_path))
  data = cifar10_resnet.load_data(config)
  x, _ = next(iter(data.test.batch(16)))
  assert data.train_size == 64 and x.shape == (16, 32, 32, 3)
  np.testing.assert_allclose(x[..., 0] * cifar10_resnet.STD[0] + cifar10_resnet.MEAN[0],
                             x[..., 1] * cifar10_resnet.STD[1] + cifar10_resnet.MEAN[1],
                             atol=1e-5)  # grey tiled to three channels
