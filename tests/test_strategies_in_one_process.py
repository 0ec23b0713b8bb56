"""Several ``tf.distribute.MirroredStrategy`` objects in one process, one after the other.

What a notebook does: train a dense model under a ``MirroredStrategy``, then a model of
another size with ``CompressedAllReduce``, then with ``CompressedOptimizer``, on other
numbers of replicas, or restore a 4-replica checkpoint onto 2 replicas. TensorFlow numbers
every ``MirroredStrategy``'s collectives from the same keys and keeps the first shape and
group size it saw under a key, so each of these used to fail ("Shape mismatch in the
collective instance 100", "joining a group with size 2, but that group has size 4") and
abort every later collective of the process. The strategies here are the user's own
``tf.distribute.MirroredStrategy``, not ``tf_adacomp.distribute.mirrored_strategy``.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import digits_data
import tf_adacomp

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _strategy(replicas, cross_device_ops=None):
  return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)],
                                        cross_device_ops=cross_device_ops)


def _model(strategy, width, optimizer):
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input([64]), keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer(), LOSS)
  return model


def _sgd():
  return keras.optimizers.SGD(0.1, momentum=0.9)


def _compressed():
  return tf_adacomp.CompressedOptimizer(_sgd(), tf_adacomp.AdaComp(min_size=100))


def _fit_trains(model, steps=4):
  """Fits ``steps`` batches of 64 digits twice; the second pass must have a lower loss."""
  (x, y), _ = digits_data.flat()
  history = model.fit(x[:64 * steps], y[:64 * steps], batch_size=64, epochs=2, verbose=0,
                      shuffle=False)
  first, last = history.history["loss"]
  assert np.isfinite(last) and last < first, history.history
  for weight in model.get_weights():
    assert np.isfinite(weight).all()


@pytest.mark.slow
def test_dense_then_cross_device_ops_then_the_wrapper_on_4_then_2_replicas(tmp_path):
  # Models of other sizes (the same collective keys would carry other shapes), then the
  # same model on 4 then 2 replicas (the same group key would have two sizes), restored
  # from the 4-replica checkpoint with every residue's total kept.
  _fit_trains(_model(_strategy(2), 32, _sgd))
  _fit_trains(_model(_strategy(2, tf_adacomp.CompressedAllReduce(
      tf_adacomp.AdaComp(min_size=100))), 48, _sgd))
  saved = _model(_strategy(4), 64, _compressed)
  _fit_trains(saved)
  path = str(tmp_path / "four.weights.h5")
  saved.save_weights(path)
  totals = [np.sum([c.numpy() for c in r.value.values], axis=0)
            for state in saved.optimizer.residues for r in state]

  strategy = _strategy(2)
  restored = _model(strategy, 64, _compressed)
  with strategy.scope():
    restored.optimizer.build(restored.trainable_variables)
  restored.load_weights(path)
  after = [np.sum([c.numpy() for c in r.value.values], axis=0)
           for state in restored.optimizer.residues for r in state]
  for a, b in zip(totals, after):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  _fit_trains(restored)
