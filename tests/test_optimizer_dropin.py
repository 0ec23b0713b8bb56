"""CompressedOptimizer as a drop-in Keras optimizer (issue 19): what Keras' own optimizers
accept and expose, the wrapper accepts and exposes, or refuses naming the argument.

Small eager models and the "none" compressor (exact values) keep these fast.
"""

import logging
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp

EXCHANGES = ["gradients", "updates"]


def _wrapped(inner, exchange="gradients", compressor="none"):
  return tf_adacomp.CompressedOptimizer(inner, compressor, exchange=exchange)


# --- Item 3: plain tf.Variables -------------------------------------------------------

@pytest.mark.parametrize("exchange", EXCHANGES)
def test_apply_gradients_to_plain_tf_variables_mixed_with_keras_variables(exchange):
  expected = [keras.Variable([1.0, 2.0, 3.0]), tf.Variable([4.0, 5.0, 6.0])]
  keras.optimizers.SGD(0.1, momentum=0.9).apply_gradients(
      [(tf.ones([3]), expected[0]), (tf.fill([3], 2.0), expected[1])])
  variables = [keras.Variable([1.0, 2.0, 3.0]), tf.Variable([4.0, 5.0, 6.0], name="plain")]
  optimizer = _wrapped(keras.optimizers.SGD(0.1, momentum=0.9), exchange)
  optimizer.apply_gradients([(tf.ones([3]), variables[0]), (tf.fill([3], 2.0), variables[1])])
  for a, b in zip(expected, variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
  assert int(optimizer.iterations.numpy()) == 1


def test_a_plain_tf_variable_gets_a_residue_named_after_it():
  variables = [keras.Variable([1.0, 2.0, 3.0]), tf.Variable([4.0, 5.0, 6.0], name="plain")]
  optimizer = _wrapped(keras.optimizers.SGD(0.1), "gradients", tf_adacomp.TopK(0.34))
  optimizer.apply_gradients([(tf.ones([3]), variables[0]), (tf.fill([3], 2.0), variables[1])])
  (residue,) = optimizer.residues[1]
  assert "plain" in residue.path and ":" not in residue.name
  held = residue.numpy()  # top-k sent part of the gradient and holds back the rest
  assert set(held.tolist()) == {0.0, 2.0}


# --- Item 5: exclude_from_weight_decay ----------------------------------------------------

@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("by", ["var_names", "var_list"])
def test_exclude_from_weight_decay_reaches_the_inner_optimizer(exchange, by):
  decayed = keras.Variable(2.0, name="decayed")
  kept = keras.Variable(2.0, name="exclude_me")
  optimizer = _wrapped(keras.optimizers.SGD(1.0, weight_decay=0.004), exchange)
  if by == "var_names":
    optimizer.exclude_from_weight_decay(var_names=["exclude"])
  else:
    optimizer.exclude_from_weight_decay(var_list=[kept])
  optimizer.apply_gradients([(tf.zeros([]), decayed), (tf.zeros([]), kept)])
  assert float(decayed.numpy()) == pytest.approx(1.992)
  assert float(kept.numpy()) == 2.0


# --- Item 6: get_weights / set_weights ------------------------------------------------------

@pytest.mark.parametrize("exchange", EXCHANGES)
def test_set_weights_restores_the_inner_optimizers_iterations_and_slots(exchange):
  def trained(steps):
    variable = keras.Variable([1.0, 2.0])
    optimizer = _wrapped(keras.optimizers.Adam(0.1), exchange, tf_adacomp.TopK(0.5))
    for _ in range(steps):
      optimizer.apply_gradients([(tf.constant([1.0, -3.0]), variable)])
    return optimizer, variable

  source, _ = trained(3)
  target, _ = trained(1)
  weights = [v.numpy() for v in source.variables]
  target.set_weights(weights)
  for a, b in zip(weights, [v.numpy() for v in target.variables]):
    np.testing.assert_array_equal(a, b)
  assert int(target.iterations.numpy()) == 3
  assert int(target.inner_optimizer.iterations.numpy()) == 3
  with pytest.raises(ValueError, match="2 values.*variables"):
    target.set_weights(weights[:2])


# --- Item 7: the base settings of the inner optimizer ----------------------------------------

@pytest.mark.parametrize("setting, value", [
    ("clipnorm", 1.5), ("clipvalue", 0.5), ("global_clipnorm", 2.0),
    ("gradient_accumulation_steps", 3), ("weight_decay", 0.01)])
def test_base_settings_read_the_inner_optimizers(setting, value):
  inner = keras.optimizers.SGD(0.1, **{setting: value})
  optimizer = _wrapped(inner)
  assert getattr(optimizer, setting) == value
  setattr(optimizer, setting, None)
  assert getattr(inner, setting) is None and getattr(optimizer, setting) is None


def test_gradient_accumulation_steps_of_the_inner_optimizer_build_nothing_in_the_wrapper():
  variable = keras.Variable([1.0, 2.0])
  optimizer = _wrapped(keras.optimizers.SGD(1.0, gradient_accumulation_steps=2))
  for _ in range(2):
    optimizer.apply_gradients([(tf.constant([1.0, 1.0]), variable)])
  np.testing.assert_allclose(variable.numpy(), [0.0, 1.0])
  assert int(optimizer.iterations.numpy()) == 1
  assert not any("accumulator" in v.path for v in optimizer._variables)  # pylint: disable=protected-access


# --- Item 4: LossScaleOptimizer, in the order that works -------------------------------------

def test_a_loss_scale_optimizer_inside_the_wrapper_is_refused_naming_the_order():
  inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5))
  with pytest.raises(ValueError, match=r"LossScaleOptimizer\(CompressedOptimizer\(.*"
                                       r"inner_optimizer=<.*LossScaleOptimizer"):
    tf_adacomp.CompressedOptimizer(inner)


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_the_loss_scale_optimizer_around_the_wrapper_scales_as_keras_own(exchange):
  # Keras' loss_scale_optimizer_test: test_downscaling, test_upscaling, test_finite_step.
  def scaled(initial_scale, **kwargs):
    return keras.optimizers.LossScaleOptimizer(
        _wrapped(keras.optimizers.SGD(0.5), exchange), initial_scale=initial_scale, **kwargs)

  variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
  optimizer = scaled(400.0)
  for _ in range(4):
    optimizer.apply([tf.fill([4], np.inf)], variables)
  assert float(optimizer.scale_loss(1.0)) == pytest.approx(25.0)
  np.testing.assert_array_equal(variables[0].numpy(), [1.0, 2.0, 3.0, 4.0])

  optimizer = scaled(2.0, dynamic_growth_steps=2)
  for _ in range(8):
    optimizer.apply([tf.constant([1.0, 6.0, 7.0, 2.0])], variables)
  assert float(optimizer.scale_loss(1.0)) == pytest.approx(32.0)
  assert int(optimizer.iterations.numpy()) == 8

  variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
  optimizer = scaled(1024.0)
  optimizer.apply([tf.constant([1.0, 6.0, 7.0, 2.0]) * 1024.0], variables)
  np.testing.assert_allclose(variables[0].numpy(), [0.5, -1.0, -0.5, 3.0], rtol=1e-4)


# --- Item 8: residues through model.save / load_model under MirroredStrategy ------------------

def _small_model(optimizer):
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input([8]), keras.layers.Dense(4, name="dense")])
  model.compile(optimizer, "mse")
  return model


def _replica_sums(optimizer):
  """Each residue summed over the replicas' copies (what a checkpoint stores)."""
  return [sum(c.numpy() for c in r.value.values) for state in optimizer.residues
          for r in state]


# Residues and slots through a checkpoint under MirroredStrategy are in the fast tier in
# tests/test_optimizer.py (test_residues_survive_model_save_and_checkpoint),
# tests/test_optimizer_updates.py (test_update_exchange_checkpoints_the_mean_of_the_
# replicas_slots) and tests/test_backup.py; through load_model here, with --full.
@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["gradients", "updates"])
def test_residues_survive_model_save_and_load_model_under_mirrored_strategy(exchange, tmp_path):
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=["/cpu:0", "/cpu:1"])
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(32, 8)).astype("float32"), rng.normal(size=(32, 4)).astype("float32")
  with strategy.scope():
    model = _small_model(tf_adacomp.CompressedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), tf_adacomp.TopK(0.25), exchange=exchange))
  model.fit(x, y, batch_size=16, epochs=1, verbose=0)
  residues = _replica_sums(model.optimizer)
  assert any(np.abs(r).sum() > 0 for r in residues)
  path = str(tmp_path / "m.keras")
  model.save(path)
  with strategy.scope():
    loaded = keras.models.load_model(path)
  assert int(loaded.optimizer.iterations.numpy()) == 2
  for a, b in zip(residues, _replica_sums(loaded.optimizer)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)  # and training goes on


# --- Item 10: the first step's XLA compilation is announced and timed -----------------------

def _compile_lines(caplog):
  return [r.getMessage() for r in caplog.records if "XLA programs" in r.getMessage()]


# Eagerly in the fast tier (the same log line from a tf.function with --full).
@pytest.mark.parametrize("in_function", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_first_compressed_step_logs_its_xla_compilation(in_function, caplog):
  # A shape and density no other test uses: their kernels are new to the process.
  variable = keras.Variable(np.ones([7, 13 + in_function], np.float32))
  density = 0.41 if in_function else 0.37
  optimizer = _wrapped(keras.optimizers.SGD(0.1), "gradients", tf_adacomp.TopK(density))
  optimizer.build([variable])

  def step():
    optimizer.apply([tf.ones_like(variable)], [variable])

  with caplog.at_level(logging.INFO, logger="tf_adacomp"):
    if in_function:
      step = tf.function(step)
    step()
    step()
    if optimizer._compile_log.thread is not None:  # pylint: disable=protected-access
      optimizer._compile_log.thread.join(timeout=10)  # pylint: disable=protected-access
  lines = _compile_lines(caplog)
  assert len(lines) == (2 if in_function else 1), lines
  assert "CompressedOptimizer" in lines[-1] and re.search(r"in \d+\.\d s", lines[-1])
  if in_function:
    assert "compiles" in lines[0]
