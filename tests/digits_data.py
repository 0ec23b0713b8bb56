"""Small real data for distribution tests: scikit-learn's bundled handwritten digits."""

import keras
import numpy as np
from sklearn.datasets import load_digits


def flat(seed: int = 0):
  """((x_train, y_train), (x_test, y_test)): 64 features in [0, 1], 1437/360 split."""
  data = load_digits()
  x = (data.data / 16.0).astype("float32")
  y = data.target.astype("int32")
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order]
  return (x[:1437], y[:1437]), (x[1437:], y[1437:])


def images(seed: int = 0):
  """The same split as ``flat``, as 8x8x1 images."""
  (x_train, y_train), (x_test, y_test) = flat(seed)
  return (x_train.reshape(-1, 8, 8, 1), y_train), (x_test.reshape(-1, 8, 8, 1), y_test)


def mlp(seed: int = 0, optimizer=None):
  """A 64-64-10 MLP, compiled with SGD(0.1, momentum 0.9) unless given an optimizer."""
  keras.utils.set_random_seed(seed)
  model = keras.Sequential([keras.Input([64]), keras.layers.Dense(64, activation="relu"),
                            keras.layers.Dense(10)])
  model.compile(optimizer or keras.optimizers.SGD(0.1, momentum=0.9),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
  return model
