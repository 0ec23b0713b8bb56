"""Simulated learners: exact with no compression, close to it with AdaComp, on real data."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import digits_data
from tf_adacomp import simulate

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _mlp(seed=0):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([keras.Input([8, 8, 1]), keras.layers.Flatten(),
                           keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])


def test_no_compression_equals_full_batch_sgd():
  (x, y), _ = digits_data.images(0)
  x, y = tf.constant(x[:64]), tf.constant(y[:64])
  model, reference = _mlp(), _mlp()
  trainer = simulate.SimulatedLearners(model, keras.optimizers.SGD(0.1), LOSS, "none", 4)
  optimizer = keras.optimizers.SGD(0.1)
  for _ in range(3):
    trainer.train_step(x, y)
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(LOSS(y, reference(x, training=True)))
    optimizer.apply_gradients(
        zip(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables))
  for a, b in zip(model.trainable_variables, reference.trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


def _cnn(seed=0):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input([8, 8, 1]),
      keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
      keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
      keras.layers.MaxPooling2D(), keras.layers.Flatten(),
      keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])


def _train(compressor, steps=150, learners=4, batch_size=128, seed=0):
  """Test accuracy and the compression report of a short simulated run on digits."""
  (x_train, y_train), (x_test, y_test) = digits_data.images(seed)
  model = _cnn(seed)
  trainer = simulate.SimulatedLearners(model, keras.optimizers.SGD(0.05, momentum=0.9),
                                       LOSS, compressor, learners)
  rng = np.random.default_rng(seed)
  sent_steps = []
  for _ in range(steps):
    idx = rng.choice(len(x_train), batch_size, replace=False)
    _, sent = trainer.train_step(tf.constant(x_train[idx]), tf.constant(y_train[idx]))
    sent_steps.append({k: int(v) for k, v in sent.items()})
  accuracy = float(np.mean(np.argmax(model.predict(x_test, verbose=0), -1) == y_test))
  return accuracy, simulate.compression_report(trainer.plans, sent_steps)


# Real-data accuracy: the slow tier. Measured (test accuracy, dense / AdaComp): 0.939 /
# 0.822 after 50 steps, 0.964 / 0.958 after 100, 0.983 / 0.969 after 120 (ratios: total
# 124, conv 33, dense 155), 0.986 / 0.986 after 150. AdaComp trails early on: 120 steps
# leave it within half the 0.03 allowed. The simulated exchange itself is checked
# exactly in the fast tier (test_no_compression_equals_full_batch_sgd).
@pytest.mark.slow
def test_adacomp_keeps_dense_accuracy_on_digits():
  (dense, dense_ratio), (adacomp, ratio) = _train("none", 120), _train("adacomp", 120)
  assert dense > 0.9
  assert adacomp >= dense - 0.03
  assert ratio["total"]["ratio"] > 50
  assert ratio["conv"]["ratio"] > 10 and ratio["dense"]["ratio"] > 50
  assert dense_ratio["total"]["ratio"] == 1.0


def test_learners_must_be_positive():
  with pytest.raises(ValueError, match="learners=0"):
    simulate.SimulatedLearners(_mlp(), keras.optimizers.SGD(), LOSS, "none", 0)
