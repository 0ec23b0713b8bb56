"""The inner optimizer's EMA (``use_ema=True``) under the update exchange: Keras' average
of the exchanged weights, equal on every replica (tf_adacomp.ema)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp import ema
from replica_harness import DEVICES, PER_REPLICA, data, linear_model, replica_values


def _sgd(**kwargs):
  return keras.optimizers.SGD(0.1, momentum=0.9, use_ema=True, ema_momentum=0.9, **kwargs)


def _fit(make_optimizer, replicas, steps, fits=1, strategy=True):
  """``fits`` fits of ``steps`` steps on ``replicas`` replicas' global batches, under a
  MirroredStrategy (or, with ``strategy=False``, none: one device, the whole batch).

  Keras' own overwrite (``ema_overwrite_frequency``) fails under any MirroredStrategy in
  Keras 3.15 (a merge_call in a cond): its reference runs without one.
  """
  strategy = (tf_adacomp.distribute.mirrored_strategy(devices=DEVICES[:replicas])
              if strategy else tf.distribute.get_strategy())
  x, y = data(replicas, steps)
  with strategy.scope():
    model = linear_model()
    model.compile(optimizer=make_optimizer(), loss="mse")
  for _ in range(fits):  # each fit ends in finalize_variable_values: weights := average
    model.fit(x, y, batch_size=replicas * PER_REPLICA, epochs=1, shuffle=False, verbose=0)
  return model, strategy


def _averages(optimizer):
  inner = getattr(optimizer, "inner_optimizer", optimizer)
  return getattr(inner, ema.AVERAGES)


# Keras' own overwrite fails under a MirroredStrategy; the wrapper's takes place after the
# exchange, with either exchange.
@pytest.mark.parametrize("exchange,overwrite", [  # the fast tier: the overwrite, updates
    pytest.param("updates", None, marks=pytest.mark.slow), ("updates", 3),
    pytest.param("gradients", 3, marks=pytest.mark.slow)])
def test_two_replicas_keep_one_average_as_keras(exchange, overwrite):
  # Without compression, SGD's update exchange is SGD on the mean gradient: Keras' on the
  # global batch, on one device.
  keras_model, _ = _fit(lambda: _sgd(ema_overwrite_frequency=overwrite), 2, 6, fits=2,
                        strategy=False)
  ours, strategy = _fit(lambda: tf_adacomp.CompressedOptimizer(
      _sgd(ema_overwrite_frequency=overwrite), "none", exchange=exchange), 2, 6, fits=2)
  for variable, expected in zip(ours.trainable_variables, keras_model.get_weights()):
    copies = replica_values(variable, strategy)
    np.testing.assert_array_equal(copies[0], copies[1])  # no spread between replicas
    np.testing.assert_allclose(copies[0], expected, rtol=1e-5, atol=1e-6)
  for average, expected in zip(_averages(ours.optimizer), _averages(keras_model.optimizer)):
    copies = replica_values(average, strategy)
    np.testing.assert_array_equal(copies[0], copies[1])
    np.testing.assert_allclose(copies[0], expected.numpy(), rtol=1e-5, atol=1e-6)


# Slow (both): one replica's EMA is Keras' bit for bit in tests/conformance/test_oracle.py's
# test_trains_as_its_reference[inner=adam,exchange=gradients,second_moment=local,
# no_strategy,...,ema,...] in the fast tier, the overwrite (after the update exchange) in
# test_two_replicas_keep_one_average_as_keras[updates-3].
@pytest.mark.parametrize("exchange", [pytest.param("updates", marks=pytest.mark.slow),
                                      pytest.param("gradients", marks=pytest.mark.slow)])
def test_one_replica_is_keras_bit_for_bit(exchange):
  plain, _ = _fit(lambda: _sgd(ema_overwrite_frequency=2), 1, 5, strategy=False)
  ours, _ = _fit(lambda: tf_adacomp.CompressedOptimizer(
      _sgd(ema_overwrite_frequency=2), "none", exchange=exchange), 1, 5, strategy=False)
  for a, b in zip(plain.get_weights(), ours.get_weights()):
    np.testing.assert_array_equal(a, b)


def test_local_steps_refuse_an_ema():
  with pytest.raises(ValueError, match=r"local_steps=4, use_ema=True"):
    tf_adacomp.CompressedOptimizer(_sgd(), "none", local_steps=4)


def test_keras_has_what_the_deferred_average_replaces():
  # Fails loudly if a Keras release renames what tf_adacomp.ema hooks and reads.
  optimizer = _sgd()
  optimizer.build([keras.Variable(np.zeros(3, np.float32))])
  assert callable(getattr(optimizer, ema.UPDATE))
  assert callable(getattr(optimizer, ema.OVERWRITE))
  assert len(getattr(optimizer, ema.AVERAGES)) == 1
