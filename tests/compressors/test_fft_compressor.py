"""FFTCompressor through the compressor contract: state, schedule, config, a real exchange."""

import json
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp import exchange

DEVICES = [f"/cpu:{i}" for i in range(2)]  # 2 replicas: XLA compiles per device


def _kept(n, theta):
  m = n // 2 + 1
  return max(1, min(m, math.ceil((1 - theta) * m)))


def test_defaults_and_registry():
  compressor = tf_adacomp.get_compressor("fft")
  assert isinstance(compressor, tf_adacomp.FFTCompressor) and compressor.name == "fft"
  assert compressor.get_config() == {"min_size": 0, "theta": 0.9, "final_theta": None,
                                     "theta_decay_steps": 0, "exponent_bits": 4,
                                     "mantissa_bits": 3}
  assert "fft" in tf_adacomp.available_compressors()


def test_config_round_trips():
  compressor = tf_adacomp.get_compressor("FFT", theta=0.95, final_theta=0.8,
                                         theta_decay_steps=100, exponent_bits=3,
                                         mantissa_bits=4, min_size=64)
  config = json.loads(json.dumps(tf_adacomp.serialize_compressor(compressor)))
  assert tf_adacomp.get_compressor(config) == compressor
  assert tf_adacomp.FFTCompressor.from_config(compressor.get_config()) == compressor
  restored = keras.saving.deserialize_keras_object(
      keras.saving.serialize_keras_object(compressor))
  assert restored == compressor and restored.final_theta == 0.8


@pytest.mark.parametrize("kwargs,match", [
    ({"theta": 1.5}, "theta=1.5"), ({"theta": 1}, "theta=1"), ({"theta": -0.5}, "theta=-0.5"),
    ({"theta": None}, "theta=None"), ({"final_theta": 1.0}, "final_theta=1.0"),
    ({"theta_decay_steps": -3}, "theta_decay_steps=-3"),
    ({"theta_decay_steps": 2.5}, "theta_decay_steps=2.5"),
    ({"final_theta": 0.5}, "theta_decay_steps=0"),
    ({"exponent_bits": 0}, "exponent_bits=0"), ({"mantissa_bits": 30}, "mantissa_bits=30"),
    ({"min_size": -1}, "min_size=-1")])
def test_bad_arguments_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tf_adacomp.FFTCompressor(**kwargs)


def test_theta_schedule():
  compressor = tf_adacomp.FFTCompressor(theta=0.9, final_theta=0.6, theta_decay_steps=3)
  assert [round(compressor.theta_at(s), 12) for s in (0, 1, 2, 3, 10)] == [0.9, 0.8, 0.7,
                                                                          0.6, 0.6]
  assert tf_adacomp.FFTCompressor(theta=0.8).theta_at(1000) == 0.8
  plan = compressor.plan([50, 20], tf.float32, "dense/kernel")
  assert compressor.width([plan]) == tf_adacomp.ops.fft_payload_words(1000, 0.6)
  state = compressor.init(plan)
  grad = np.random.default_rng(0).standard_normal([50, 20]).astype(np.float32)
  for step in range(5):
    assert int(state[1]) == step
    payload, (state,) = compressor.compress([grad], [state], [plan])
    assert int(payload[0]) == _kept(1000, [0.9, 0.8, 0.7, 0.6, 0.6][step])


def test_error_feedback_loses_nothing_over_steps():
  compressor = tf_adacomp.FFTCompressor(theta=0.9)
  plan = compressor.plan([40, 30], tf.float32, "dense/kernel")
  assert not plan.summable and not plan.dense
  residue, step = compressor.init(plan)
  assert residue.dtype == tf.float32 and step.dtype == tf.int64
  rng = np.random.default_rng(1)
  sent = np.zeros([40, 30])
  total = np.zeros([40, 30])
  for _ in range(5):
    grad = rng.standard_normal([40, 30]).astype(np.float32)
    total += grad
    previous = residue.numpy()
    payload, ((residue, step),) = compressor.compress([grad], [(residue, step)], [plan])
    decoded = compressor.decompress(payload, [plan])[0].numpy()
    np.testing.assert_array_equal(residue.numpy(), (previous + grad) - decoded)
    sent += decoded
  np.testing.assert_allclose(sent + residue.numpy(), total, atol=1e-4)
  assert int(step) == 5
  nbytes = int(compressor.nbytes(payload, [plan])[0])
  assert nbytes < plan.dense_nbytes / 15  # 1+4+3-bit floats, 10% of 601 coefficients


def test_non_finite_keeps_the_state():
  compressor = tf_adacomp.FFTCompressor()
  plan = compressor.plan([64], tf.float32)
  state = (tf.ones([64]), tf.constant(7, tf.int64))
  grad = tf.tensor_scatter_nd_update(tf.zeros([64]), [[5]], [np.nan])
  payload, ((residue, step),) = compressor.compress([grad], [state], [plan])
  np.testing.assert_array_equal(residue, state[0])
  assert int(step) == 7
  assert np.isnan(compressor.decompress(payload, [plan])[0].numpy()).all()


def test_bad_input_raises_and_leaves_the_residue_variable_unchanged():
  compressor = tf_adacomp.FFTCompressor()
  plan = compressor.plan([10, 10], tf.float32)
  residue = tf.Variable(tf.fill([10, 10], 0.5))
  with pytest.raises(ValueError, match="residue"):
    compressor.compress([tf.ones([10, 10])], [(residue[:5], tf.constant(0, tf.int64))], [plan])
  with pytest.raises(TypeError, match="grad"):
    compressor.compress([tf.ones([10, 10], tf.int32)], [(residue, tf.constant(0, tf.int64))],
                        [plan])
  np.testing.assert_array_equal(residue.numpy(), 0.5)


def test_small_and_empty_tensors_go_dense():
  compressor = tf_adacomp.FFTCompressor(min_size=100)
  plan = compressor.plan([10], tf.float32, "bias")
  assert plan.dense and compressor.init(plan) == ()
  assert compressor.plan([0, 4], tf.float32).dense


@pytest.mark.slow  # a strategy run; the fast tier checks the FFT kernels against NumPy
def test_exchange_under_mirrored_strategy_is_bit_identical_on_every_replica():
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES)
  replicas = strategy.num_replicas_in_sync
  compressor = tf_adacomp.FFTCompressor(theta=0.8, final_theta=0.5, theta_decay_steps=2)
  plans = [compressor.plan([24, 10], tf.float32, "dense/kernel"),
           compressor.plan([9], tf.float32, "dense/bias")]
  rng = np.random.default_rng(2)
  grads = [rng.standard_normal([replicas, *p.shape]).astype(np.float32) for p in plans]

  def per_replica(arrays):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(arrays[ctx.replica_id_in_sync_group]))

  @tf.function
  def step(grads, residues, steps):
    def replica_fn(grads, residues, steps):
      states = [(r, s) for r, s in zip(residues, steps)]
      exchanged = exchange.replica_exchange(compressor, plans, grads, states)
      return exchanged.sums, [s[0] for s in exchanged.states], [s[1] for s in exchanged.states]
    return strategy.run(replica_fn, args=(grads, residues, steps))

  residues = [np.zeros([replicas, *p.shape], np.float32) for p in plans]
  counters = [np.zeros([replicas], np.int64) for _ in plans]
  for _ in range(2):
    sums, new_residues, new_steps = step([per_replica(g) for g in grads],
                                         [per_replica(r) for r in residues],
                                         [per_replica(c) for c in counters])
    # The same compressor eagerly, replica by replica.
    for i, plan in enumerate(plans):
      eager = [compressor.compress([grads[i][r]], [(residues[i][r], counters[i][r])], [plan])
               for r in range(replicas)]
      eager = [(payload, state) for payload, (state,) in eager]
      expected = compressor.decompress(tf.stack([p for p, _ in eager]), [plan])[0].numpy()
      local = strategy.experimental_local_results(sums[i])
      for r in range(replicas):
        np.testing.assert_array_equal(local[r], expected)  # identical on every replica
      got_residues = strategy.experimental_local_results(new_residues[i])
      got_steps = strategy.experimental_local_results(new_steps[i])
      for r in range(replicas):
        np.testing.assert_array_equal(got_residues[r], eager[r][1][0])
        assert int(got_steps[r]) == int(eager[r][1][1])
      residues[i] = np.stack([np.asarray(x) for x in got_residues])
      counters[i] = np.stack([np.asarray(x) for x in got_steps])
  assert counters[0].tolist() == [2] * replicas


# Real-data training: the slow tier. The fast tier runs the wrapper with FFT payloads in
# tests/test_optimizer_restore.py (its step counters, on every replica, follow the
# optimizer's iterations) and the exchange above (bit-identical on every replica).
@pytest.mark.slow
def test_keras_fit_with_the_optimizer_wrapper_learns_digits():
  """model.fit with CompressedOptimizer(compressor="fft") on 2 replicas, real digits."""
  import digits_data  # pylint: disable=g-import-not-at-top

  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES)
  (x, y), (x_test, y_test) = digits_data.flat()
  with strategy.scope():
    # Every step compressed: the theta schedule's step counters count compressed
    # exchanges, and the default's choice may take dense ones (docs/fft.md).
    model = digits_data.mlp(0, tf_adacomp.CompressedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), tf_adacomp.FFTCompressor(min_size=100),
        dense_when_faster=False))
  history = model.fit(x, y, batch_size=64, epochs=2, verbose=0, shuffle=False)
  assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]
  assert model.evaluate(x_test, y_test, verbose=0)[1] > 0.8
  for variable in model.trainable_variables:
    copies = strategy.experimental_local_results(variable.value)
    np.testing.assert_array_equal(copies[0].numpy(), copies[1].numpy())
  # The step counters of the theta schedule advanced once per step on every replica.
  steps = [s for state in model.optimizer.residues for s in state if s.dtype == "int64"]
  assert steps and all(int(strategy.experimental_local_results(s.value)[1].numpy()) ==
                       model.optimizer.iterations.numpy() for s in steps)
  assert model.optimizer.compression_stats()["dense"]["ratio"] > 5
