"""CIFAR-10, ResNet-20/32/56 (the CIFAR variant of He et al. 2016, section 4.2).

Three stages of ``n`` basic blocks (16, 32, 64 filters; depth = 6n + 2), batch
normalisation, L2 1e-4, SGD with momentum, pad-4 random crops and flips, the step
schedule (x0.1 at 50% and 75%) or cosine. Data: tfds ``cifar10``; ``--dataset
fashion_mnist`` trains the same network on Fashion-MNIST padded to 32x32 and tiled to
three channels (real data that installs offline).

    python -m tf_adacomp.examples.cifar10_resnet --replicas=4 --depth=20 --compressor=adacomp
"""

import sys

from absl import app
from absl import flags

from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import input_data
from tf_adacomp.examples import training

flags.adopt_module_key_flags(flags_and_config)  # --help lists the shared flags too

NAME = "cifar10_resnet"
DEFAULTS = dict(epochs=160, batch_size=128, learning_rate=0.1, lr_schedule="step")
OPTIONS = dict(depth=20, dataset="cifar10")
DEPTHS = (20, 32, 44, 56, 110)
DATASETS = ("cifar10", "fashion_mnist")
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)

flags.DEFINE_enum("depth", None, [str(d) for d in DEPTHS], "ResNet depth, 6n + 2 (20).")
flags.DEFINE_enum("dataset", None, DATASETS, "cifar10 (tfds) or fashion_mnist (offline; "
                  "padded to 32x32x3).")


# What cifar10_resnet and cifar10_resist train on when tfds cannot download CIFAR-10.
WAYS_OUT = ("--dataset=fashion_mnist (offline with Debian's dataset-fashion-mnist)",)


def _tfds_cifar10(config):
  builder = input_data.tfds_builder("cifar10", config, WAYS_OUT)
  train, test = builder.as_dataset(split=["train", "test"], as_supervised=True)
  return (train, test, input_data.split_size(builder.info, "train", train),
          input_data.split_size(builder.info, "test", test))


def _fashion_mnist_32(config):
  """Fashion-MNIST as 32x32x3 uint8 images (zero-padded by 2, grey tiled to RGB)."""
  import numpy as np
  import tensorflow as tf

  from tf_adacomp.examples import fashion_mnist

  arrays = fashion_mnist.load_arrays(config)

  def dataset(split):
    images, labels = arrays[split]
    images = np.repeat(np.pad(images, ((0, 0), (2, 2), (2, 2)))[..., None], 3, axis=-1)
    return tf.data.Dataset.from_tensor_slices((images, labels.astype("int64")))

  return dataset("train"), dataset("test"), len(arrays["train"][1]), len(arrays["test"][1])


def normalize(image):
  import tensorflow as tf

  image = tf.cast(image, tf.float32) / 255.0
  return (image - MEAN) / STD


def augment(image):
  """Pad by 4, crop a random 32x32 window, flip half of the images."""
  import tensorflow as tf

  image = tf.image.resize_with_crop_or_pad(image, 40, 40)
  image = tf.image.random_crop(image, [32, 32, 3])
  return tf.image.random_flip_left_right(image)


def load_data(config):
  if config.synthetic:
    return input_data.synthetic_data([32, 32, 3], 10, 512, 128, config.seed)
  import tensorflow as tf

  loader = _tfds_cifar10 if config.options["dataset"] == "cifar10" else _fashion_mnist_32
  train, test, n_train, n_test = loader(config)
  train = (train.shuffle(min(n_train, 50_000), seed=config.seed)
           .map(lambda x, y: (normalize(augment(x)), tf.cast(y, tf.int32)),
                num_parallel_calls=tf.data.AUTOTUNE))
  test = test.map(lambda x, y: (normalize(x), tf.cast(y, tf.int32)),
                  num_parallel_calls=tf.data.AUTOTUNE)
  return input_data.Data(train, test, n_train, n_test)


def resnet_cifar(depth, num_classes=10, weight_decay=1e-4):
  """The CIFAR ResNet of He et al. (2016): depth 6n + 2, projection shortcuts."""
  import keras
  from keras import layers

  if (depth - 2) % 6:
    raise ValueError(f"`depth` must be 6n + 2 (20, 32, 44, 56, 110). Received: depth={depth}")
  blocks = (depth - 2) // 6
  regularizer = keras.regularizers.L2(weight_decay)

  def conv(x, filters, strides=1, kernel=3):
    return layers.Conv2D(filters, kernel, strides, padding="same", use_bias=False,
                         kernel_initializer="he_normal", kernel_regularizer=regularizer)(x)

  def bn(x):
    return layers.BatchNormalization(momentum=0.9, epsilon=1e-5)(x)

  inputs = keras.Input([32, 32, 3])
  x = layers.ReLU()(bn(conv(inputs, 16)))
  for stage, filters in enumerate((16, 32, 64)):
    for block in range(blocks):
      strides = 2 if stage > 0 and block == 0 else 1
      y = layers.ReLU()(bn(conv(x, filters, strides)))
      y = bn(conv(y, filters))
      shortcut = x if strides == 1 else bn(conv(x, filters, strides, kernel=1))
      x = layers.ReLU()(layers.Add()([y, shortcut]))
  x = layers.GlobalAveragePooling2D()(x)
  outputs = layers.Dense(num_classes, kernel_regularizer=regularizer)(x)
  return keras.Model(inputs, outputs, name=f"resnet{depth}")


def build_model(config, data):
  del data
  return resnet_cifar(int(config.options["depth"]))


def main(argv):
  training.run(sys.modules[__name__], argv)


if __name__ == "__main__":
  app.run(main)
