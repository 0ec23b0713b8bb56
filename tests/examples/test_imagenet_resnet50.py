"""The ImageNet ResNet-50 example: preprocessing, the tfds pipeline (mocked), a short run."""

import numpy as np
import pytest
import tensorflow as tf

import example_runs
from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import imagenet_resnet50
from tf_adacomp.examples import training


def test_train_and_eval_images_have_the_size_and_are_normalised():
  image = tf.cast(tf.random.stateless_uniform([300, 200, 3], [1, 2], 0, 256, tf.int32),
                  tf.uint8)
  for function in (imagenet_resnet50.train_image, imagenet_resnet50.eval_image):
    out = function(image, 64)
    assert out.shape == (64, 64, 3)
    assert abs(float(tf.reduce_mean(out))) < 1.0


def test_eval_crop_is_central():
  image = np.zeros([100, 200, 3], np.uint8)
  image[:, 100:] = 255  # right half white: the central square is half white
  out = imagenet_resnet50.eval_image(tf.constant(image), 8).numpy()
  left, right = out[:, :4].mean(), out[:, 4:].mean()
  assert left < 0 < right


def test_defaults_are_the_large_batch_recipe():
  config = flags_and_config.make_config(imagenet_resnet50)
  assert config.batch_size == 1024 and config.learning_rate == pytest.approx(0.1 * 1024 / 256)
  assert config.warmup_epochs == 5 and config.options["image_size"] == 224


@pytest.mark.slow
def test_trains_on_the_tfds_pipeline(tmp_path, monkeypatch):
  # One replica: ResNet-50's step compiles once, not once per device (the replicas'
  # exchange is tested on the smaller examples); 32x32 is the smallest ResNet50 takes.
  config = example_runs.small_config(
      imagenet_resnet50, tmp_path, compressor="bf16", warmup_epochs=0, image_size=32,
      replicas=1, eval_steps=1, manual_dir=str(tmp_path / "manual"),
      data_dir=str(tmp_path / "tfds"))
  with example_runs.mock_tfds(monkeypatch, num_examples=8):
    summary = training.train(imagenet_resnet50, config)
  example_runs.check_summary(summary, tmp_path, kinds=("conv", "dense", "vector"))
  assert summary["parameters"] > 23e6  # ResNet-50 with 1000 classes
