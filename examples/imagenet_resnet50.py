"""ImageNet (ILSVRC 2012), ResNet-50 with large-batch settings (Goyal et al. 2017).

``keras.applications.ResNet50(weights=None)``; tfds ``imagenet2012``, which needs the
ILSVRC 2012 archives downloaded by hand into ``--manual_dir`` (tfds prepares them once
into ``--data_dir``). Training images: a random crop of 8-100% of the area and aspect
3/4-4/3, resized to ``--image_size``, flipped; evaluation: the central 87.5%, resized.
Global batch 1024 at learning rate 0.4 (0.1 x batch / 256), 5 warm-up epochs, cosine
decay, SGD with momentum.

    python -m tf_adacomp.examples.imagenet_resnet50 --manual_dir=/data/imagenet \\
        --data_dir=/data/tfds --strategy=multi_worker --compressor=adacomp
"""

import sys

from absl import app
from absl import flags

from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import input_data
from tf_adacomp.examples import training

flags.adopt_module_key_flags(flags_and_config)  # --help lists the shared flags too

NAME = "imagenet_resnet50"
DEFAULTS = dict(epochs=90, batch_size=1024, learning_rate=0.4, lr_schedule="cosine",
                warmup_epochs=5.0)
OPTIONS = dict(manual_dir=None, image_size=224)
NUM_CLASSES = 1000
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)

WAYS_OUT = ("--manual_dir=DIR (ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar "
            "from image-net.org)",)

flags.DEFINE_string("manual_dir", None, "Directory holding ILSVRC2012_img_train.tar and "
                    "ILSVRC2012_img_val.tar (tfds imagenet2012 manual download).")
flags.DEFINE_integer("image_size", None, "Side of the square training images (224).")


def train_image(image, size):
  """Inception-style random-resized crop and flip, normalised."""
  import tensorflow as tf

  begin, crop_size, _ = tf.image.sample_distorted_bounding_box(
      tf.shape(image), bounding_boxes=tf.zeros([1, 0, 4]), min_object_covered=0.1,
      aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0), max_attempts=10,
      use_image_if_no_bounding_boxes=True)
  image = tf.slice(image, begin, crop_size)
  image = tf.image.resize(image, [size, size])
  image = tf.image.random_flip_left_right(image)
  return (image - MEAN) / STD


def eval_image(image, size):
  """The central 87.5% of the image (a square on the short side), resized."""
  import tensorflow as tf

  shape = tf.shape(image)
  side = tf.cast(tf.cast(tf.minimum(shape[0], shape[1]), tf.float32) * 0.875, tf.int32)
  image = tf.image.crop_to_bounding_box(image, (shape[0] - side) // 2,
                                        (shape[1] - side) // 2, side, side)
  image = tf.image.resize(image, [size, size])
  return (image - MEAN) / STD


def load_data(config):
  size = config.options["image_size"]
  if config.synthetic:
    return input_data.synthetic_data([size, size, 3], NUM_CLASSES, 256, 64, config.seed)
  import tensorflow as tf

  # tfds cannot download ImageNet: its archives come by hand, into --manual_dir.
  builder = input_data.tfds_builder("imagenet2012", config, WAYS_OUT,
                                    manual_dir=config.options["manual_dir"])
  train = builder.as_dataset(split="train", as_supervised=True, shuffle_files=True)
  test = builder.as_dataset(split="validation", as_supervised=True)
  n_train = input_data.split_size(builder.info, "train", train)
  n_test = input_data.split_size(builder.info, "validation", test)
  train = (train.shuffle(10_000, seed=config.seed)
           .map(lambda x, y: (train_image(x, size), tf.cast(y, tf.int32)),
                num_parallel_calls=tf.data.AUTOTUNE))
  test = test.map(lambda x, y: (eval_image(x, size), tf.cast(y, tf.int32)),
                  num_parallel_calls=tf.data.AUTOTUNE)
  # 1,024 training files: each worker reads its own share of them.
  return input_data.Data(train, test, n_train, n_test, info={"shard_policy": "AUTO"})


def build_model(config, data):
  del data
  import keras

  size = config.options["image_size"]
  return keras.applications.ResNet50(weights=None, input_shape=(size, size, 3),
                                     classes=NUM_CLASSES, classifier_activation=None)


def main(argv):
  training.run(sys.modules[__name__], argv)


if __name__ == "__main__":
  app.run(main)
