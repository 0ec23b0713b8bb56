"""Fashion-MNIST, a small CNN: the project's embedded default (``tf-adacomp demo``).

Reads the IDX files of Debian's ``dataset-fashion-mnist`` package
(``/usr/share/datasets/fashion-mnist``) or of ``--data_dir``; without them, tfds
``fashion_mnist`` (which downloads).

    python -m tf_adacomp.examples.fashion_mnist --replicas=4 --compressor=adacomp
    tf-adacomp train fashion_mnist --replicas=4 --compressor=none
"""

import gzip
import os
import sys

from absl import app
from absl import flags

from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import input_data
from tf_adacomp.examples import training

flags.adopt_module_key_flags(flags_and_config)  # --help lists the shared flags too

NAME = "fashion_mnist"
DEFAULTS = dict(epochs=2, batch_size=128, learning_rate=0.05, lr_schedule="cosine")
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


def read_idx(path):
  """An IDX file (optionally gzipped) as a uint8 NumPy array of its stated shape.

  Raises:
    ValueError: not an unsigned-byte IDX file, or a size that disagrees with its header.
  """
  import numpy as np

  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    raw = f.read()
  if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] != 0x08:
    raise ValueError(f"Not an unsigned-byte IDX file. Received: path={path!r}")
  rank = raw[3]
  shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(rank))
  body = raw[4 + 4 * rank:]
  if len(body) != int(np.prod(shape)):
    raise ValueError(f"IDX file holds {len(body)} bytes, its header says {shape}. "
                     f"Received: path={path!r}")
  return np.frombuffer(body, np.uint8).reshape(shape)


def idx_directory(config):
  """The directory of the four IDX files to read, or None to use tfds."""
  for directory in (config.data_dir, DEBIAN_DIR):
    if directory and all(os.path.exists(os.path.join(directory, name))
                         for pair in FILES.values() for name in pair):
      return directory
  return None


def load_arrays(config):
  """``{split: (images [n, 28, 28] uint8, labels [n])}`` from IDX files or tfds.

  Raises:
    input_data.DataUnavailable: no IDX files, and tfds could not download fashion_mnist.
  """
  directory = idx_directory(config)
  if directory:
    return {split: tuple(read_idx(os.path.join(directory, name)) for name in names)
            for split, names in FILES.items()}
  import numpy as np
  import tensorflow_datasets as tfds

  ways_out = (f"apt-get install dataset-fashion-mnist (IDX files in {DEBIAN_DIR})",
              "--data_dir=DIR with the IDX files " + ", ".join(
                  name for pair in FILES.values() for name in pair))
  builder = input_data.tfds_builder("fashion_mnist", config, ways_out)
  splits = builder.as_dataset(split=["train", "test"], as_supervised=True)
  arrays = {}
  for name, split in zip(("train", "test"), splits):
    # Batches of 10,000 rather than tfds' batch_size=-1, which aborts on generated data.
    batches = list(tfds.as_numpy(split.batch(10_000)))
    arrays[name] = (np.concatenate([b[0] for b in batches])[..., 0],
                    np.concatenate([b[1] for b in batches]))
  return arrays


def load_data(config):
  if config.synthetic:
    return input_data.synthetic_data([28, 28, 1], 10, 1024, 256, config.seed)
  import tensorflow as tf

  arrays = load_arrays(config)

  def dataset(split):
    images, labels = arrays[split]
    x = images.astype("float32")[..., None] / 255.0
    return tf.data.Dataset.from_tensor_slices((x, labels.astype("int32")))

  n_train, n_test = len(arrays["train"][1]), len(arrays["test"][1])
  train = dataset("train").shuffle(n_train, seed=config.seed, reshuffle_each_iteration=True)
  train = train.map(lambda x, y: (tf.image.random_flip_left_right(x), y),
                    num_parallel_calls=tf.data.AUTOTUNE)
  return input_data.Data(train, dataset("test"), n_train, n_test)


def build_model(config, data):
  del config, data
  import keras

  return keras.Sequential([
      keras.Input([28, 28, 1]),
      keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
      keras.layers.MaxPooling2D(),
      keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
      keras.layers.MaxPooling2D(),
      keras.layers.Flatten(),
      keras.layers.Dense(128, activation="relu"),
      keras.layers.Dense(10),
  ], name="fashion_cnn")


def main(argv):
  training.run(sys.modules[__name__], argv)


if __name__ == "__main__":
  app.run(main)
