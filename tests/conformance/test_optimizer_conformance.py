"""CompressedOptimizer against the contract Keras' own tests ask of an optimizer.

Drawn from keras/src/optimizers/optimizer_test.py (Keras 3.15) and
loss_scale_optimizer_test.py: the same calls on ``CompressedOptimizer(inner, "none")``
give what they give on ``inner`` itself, with both exchanges (one learner, eager: the
values do not depend on lossy compression). The wrapper's own refusals are in
tests/test_optimizer_dropin.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp

EXCHANGES = ["gradients", "updates"]


@pytest.fixture(params=EXCHANGES)
def wrap(request):
  return lambda inner: tf_adacomp.CompressedOptimizer(inner, "none", exchange=request.param)


def _ones():
  return tf.ones([2, 2])


def test_iterations_counter(wrap):
  v = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
  optimizer = wrap(keras.optimizers.Adam(1.0))
  assert int(optimizer.iterations.numpy()) == 0
  for step in (1, 2):
    optimizer.apply_gradients([(_ones(), v)])
    assert int(optimizer.iterations.numpy()) == step


def test_empty_gradients(wrap):
  v = keras.Variable([[3.0, 4.0], [5.0, 6.0]])
  with pytest.raises(ValueError, match="No gradients provided for any variable"):
    wrap(keras.optimizers.SGD(1.0)).apply_gradients([(None, v)])
  v2 = keras.Variable([[3.0, 4.0], [5.0, 6.0]])
  with pytest.warns(UserWarning):
    wrap(keras.optimizers.SGD(1.0)).apply_gradients([(None, v), (_ones(), v2)])
  np.testing.assert_allclose(v.numpy(), [[3.0, 4.0], [5.0, 6.0]])
  np.testing.assert_allclose(v2.numpy(), [[2.0, 3.0], [4.0, 5.0]])


@pytest.mark.parametrize("setting, grad, expected", [
    ("clipnorm", [100.0, 100.0], [2**0.5 / 2, 2**0.5 / 2]),
    ("clipvalue", [100.0, 100.0], [1.0, 1.0]),
    ("global_clipnorm", [50.0, 100.0], np.array([50.0, 100.0]) / np.hypot(50.0, 100.0)),
])
def test_clipping(wrap, setting, grad, expected):
  optimizer = wrap(keras.optimizers.SGD(1.0, **{setting: 1.0}))
  assert getattr(optimizer, setting) == 1.0
  v = keras.Variable([0.0, 0.0])
  optimizer.apply_gradients([(tf.constant(grad), v)])
  np.testing.assert_allclose(-v.numpy(), expected, rtol=1e-6)


def test_ema(wrap):
  v = keras.Variable([[3.0, 4.0], [5.0, 6.0]])
  optimizer = wrap(keras.optimizers.SGD(1.0, use_ema=True, ema_momentum=0.9,
                                        ema_overwrite_frequency=3))
  for expected in ([[2.0, 3.0], [4.0, 5.0]], [[1.0, 2.0], [3.0, 4.0]],
                   [[1.71, 2.71], [3.71, 4.71]]):  # the third step overwrites with the EMA
    optimizer.apply_gradients([(_ones(), v)])
    np.testing.assert_allclose(v.numpy(), expected, rtol=1e-5)


def test_constraints_are_applied(wrap):
  v = keras.Variable(np.random.default_rng(0).random((2, 2)) - 1.0)
  v.constraint = keras.constraints.NonNeg()
  wrap(keras.optimizers.SGD(0.0001)).apply_gradients([(tf.zeros([2, 2]), v)])
  assert np.min(v.numpy()) == pytest.approx(0.0)


def test_static_loss_scaling(wrap):
  v = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
  optimizer = wrap(keras.optimizers.SGD(1.0, loss_scale_factor=1024.0))
  optimizer.apply_gradients([(tf.constant([[1.0, 2.0], [3.0, 4.0]]) * 1024.0, v)])
  assert float(optimizer.scale_loss(1.0)) == 1024.0
  np.testing.assert_allclose(v.numpy(), np.zeros([2, 2]), atol=1e-6)


def test_set_weights(wrap):
  x = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
  first = wrap(keras.optimizers.Adam())
  first.apply_gradients([(tf.constant([[1.0, 2.0], [3.0, 4.0]]), x)])
  second = wrap(keras.optimizers.Adam())
  with pytest.raises(ValueError, match="You are calling"):
    second.set_weights(first.variables)
  second.build([x])
  second.set_weights(first.variables)
  for a, b in zip(first.variables, second.variables):
    np.testing.assert_allclose(a.numpy(), b.numpy())


def test_gradient_accumulation(wrap):
  v = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
  optimizer = wrap(keras.optimizers.SGD(1.0, gradient_accumulation_steps=3))
  assert optimizer.gradient_accumulation_steps == 3
  for expected, iterations in ((0.0, 0), (0.0, 0), (1.0, 1), (1.0, 1)):
    optimizer.apply_gradients([(_ones(), v)])
    np.testing.assert_allclose(v.numpy(), np.array([[1.0, 2.0], [3.0, 4.0]]) - expected)
    assert int(optimizer.iterations.numpy()) == iterations


def test_tf_checkpointing(wrap, tmp_path):
  model = keras.Sequential([keras.Input([2]), keras.layers.Dense(2)])
  optimizer = wrap(keras.optimizers.Adam())
  x, y = np.random.default_rng(0).random((2, 1, 2))
  model.compile(optimizer, "mse")
  model.train_on_batch(x, y)
  reference = model.predict(x, verbose=0)
  checkpoint = tf.train.Checkpoint(model, optimizer=optimizer)
  path = checkpoint.save(str(tmp_path / "tf_ckpt"))
  model.train_on_batch(x, y)
  assert not np.allclose(model.predict(x, verbose=0), reference, atol=1e-3)
  checkpoint.restore(path)
  np.testing.assert_allclose(model.predict(x, verbose=0), reference, atol=1e-5)


def test_callable_learning_rate(wrap):
  v = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
  optimizer = wrap(keras.optimizers.SGD(learning_rate=lambda: 0.1))
  optimizer.apply_gradients([(_ones(), v)])
  np.testing.assert_allclose(v.numpy(), [[0.9, 1.9], [2.9, 3.9]], rtol=1e-6)
  assert int(optimizer.iterations.numpy()) == 1


def test_overwrite_with_gradient(wrap):
  v = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
  v.overwrite_with_gradient = True
  v2 = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
  grads = tf.constant([[5.0, 6.0], [7.0, 8.0]])
  wrap(keras.optimizers.SGD(1.0)).apply_gradients([(grads, v), (grads, v2)])
  np.testing.assert_allclose(v.numpy(), grads.numpy())
  np.testing.assert_allclose(v2.numpy(), [[-4.0, -4.0], [-4.0, -4.0]])


def test_mixed_with_tf_variables(wrap):
  v = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
  tf_v = tf.Variable([[1.0, 2.0], [3.0, 4.0]])
  optimizer = wrap(keras.optimizers.Adam(0.5))
  optimizer.apply_gradients([(_ones(), v), (_ones(), tf_v)])
  np.testing.assert_allclose(v.numpy(), tf_v.numpy())
  np.testing.assert_allclose(v.numpy(), [[0.5, 1.5], [2.5, 3.5]], rtol=1e-5)


def test_loss_scale_optimizer_around_the_wrapper(wrap):
  """loss_scale_optimizer_test: finite step, downscaling, iterations."""
  optimizer = keras.optimizers.LossScaleOptimizer(wrap(keras.optimizers.SGD(0.5)),
                                                  initial_scale=400.0)
  v = keras.Variable([1.0, 2.0, 3.0, 4.0])
  for _ in range(4):
    optimizer.apply([tf.fill([4], np.inf)], [v])
  assert float(optimizer.scale_loss(1.0)) == pytest.approx(25.0)
  optimizer.apply([tf.constant([1.0, 6.0, 7.0, 2.0]) * 25.0], [v])
  np.testing.assert_allclose(v.numpy(), [0.5, -1.0, -0.5, 3.0], rtol=1e-4)
  assert int(optimizer.iterations.numpy()) == 1
