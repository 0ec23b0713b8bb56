"""The rotating-sign compressor (``compressor="sign"``) against a NumPy reference:
the share each call sends, the signs and scales, error feedback, several replicas, bytes,
arguments."""

import hypothesis
from hypothesis import strategies as st
import keras
import numpy as np
import pytest
import tensorflow as tf

import digits_data
import tf_adacomp


def _reference_call(total, call, stride, block):
  """What one replica sends of ``total`` (flat) at its ``call``-th call, and its residue:
  the elements at ``call % stride``, ``call % stride + stride``, ..., each as its sign
  times the mean magnitude of its block of ``block`` sent elements."""
  sent = np.zeros_like(total)
  positions = np.arange(call % stride, total.size, stride)
  for start in range(0, positions.size, block):
    chosen = positions[start:start + block]
    scale = np.abs(total[chosen]).mean()
    sent[chosen] = np.where(total[chosen] >= 0, scale, -scale)
  return sent, total - sent


@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(size=st.integers(1, 90), stride=st.integers(1, 5), block=st.integers(1, 40),
                  replicas=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_calls_match_the_numpy_reference(size, stride, block, replicas, seed):
  compressor = tf_adacomp.get_compressor("sign", stride=stride, block=block)
  plan = compressor.plan([size], tf.float32, "dense/kernel")
  rng = np.random.default_rng(seed)
  states = [compressor.init(plan) for _ in range(replicas)]
  residues = [np.zeros(size, np.float32) for _ in range(replicas)]
  for call in range(stride + 1):  # every share, then the first again
    # Some exact zeros: a zero's sign is sent as +.
    grads = [(rng.normal(size=size) * (rng.random(size) < 0.7)).astype(np.float32)
             for _ in range(replicas)]
    payloads, expected = [], np.zeros(size, np.float64)
    for r in range(replicas):
      payload, (states[r],) = compressor.compress([grads[r]], [states[r]], [plan])
      payloads.append(payload)
      sent, residues[r] = _reference_call(residues[r] + grads[r], call, stride, block)
      expected += sent
      np.testing.assert_allclose(states[r][0].numpy(), residues[r], rtol=1e-6, atol=1e-6)
      assert int(compressor.nbytes(payload, [plan])[0]) == 4 * int(payload.shape[0])
    (total,) = compressor.decompress(tf.stack(payloads), [plan])
    np.testing.assert_allclose(total.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_a_matrix_sends_one_element_in_stride_and_its_bytes_are_a_bit_each():
  compressor = tf_adacomp.get_compressor("sign", stride=4, block=1024)
  plan = compressor.plan([256, 64], tf.float32, "dense/kernel")
  grad = tf.random.stateless_normal(plan.shape, [1, 2])
  payload, ((residue, calls),) = compressor.compress([grad], [compressor.init(plan)], [plan])
  (total,) = compressor.decompress(payload[None], [plan])
  assert np.count_nonzero(total.numpy()) == 256 * 64 // 4
  np.testing.assert_allclose(total + residue, grad, atol=1e-6)  # nothing lost
  assert int(calls) == 1
  # 4,096 signs in 128 words, 4 scales and the share's index: 133 words.
  assert int(compressor.nbytes(payload, [plan])[0]) == 4 * (1 + 128 + 4)


def test_config_round_trips_and_bad_arguments_are_named():
  compressor = tf_adacomp.get_compressor("sign", stride=3, block=64, min_size=10)
  assert tf_adacomp.get_compressor(tf_adacomp.serialize_compressor(compressor)) == compressor
  for name in ("stride", "block"):
    for bad in (0, -1, 2.5):
      with pytest.raises(ValueError, match=f"`{name}`.*Received: {name}={bad!r}"):
        tf_adacomp.get_compressor("sign", **{name: bad})


def test_it_compiles_once_for_every_share():
  # The share is a tensor: a compiled step does not retrace as it rotates.
  compressor = tf_adacomp.get_compressor("sign", stride=3)
  plan = compressor.plan([50], tf.float32, "dense/kernel")
  step = tf.function(lambda g, s: compressor.compress([g], [s], [plan]), jit_compile=True)
  state = compressor.init(plan)
  for _ in range(4):
    _, (state,) = step(tf.ones([50]), state)
  assert step.experimental_get_tracing_count() == 1


def test_through_the_optimizer_on_two_replicas_the_share_rotates_and_is_checkpointed(tmp_path):
  # Every step's exchange sends the next share; the replicas stay equal; the share's
  # count (an int32 beside the residue) is saved and restored with the residues.
  (x, y), _ = digits_data.flat()
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=["/cpu:0", "/cpu:1"])
  with strategy.scope():
    model = digits_data.mlp(0, tf_adacomp.CompressedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), tf_adacomp.RotatingSign(stride=3, min_size=100),
        dense_when_faster=False))
  model.fit(x[:320], y[:320], batch_size=64, epochs=1, verbose=0, shuffle=False)
  optimizer = model.optimizer
  for variable in model.trainable_variables:
    copies = [v.numpy() for v in variable.value.values]
    np.testing.assert_array_equal(copies[0], copies[1])
  kernel_state = optimizer.residues[0]
  calls = [int(c.numpy()) for c in kernel_state[1].value.values]
  assert calls == [5, 5]  # 5 steps, one share each, on both replicas
  residues = [r.numpy() for r in kernel_state[0].value.values]
  assert not np.array_equal(residues[0], residues[1])
  stats = optimizer.compression_stats()
  assert 20 < stats["dense"]["ratio"] < 32 * 3
  checkpoint = tf.train.Checkpoint(optimizer=optimizer)
  saved = checkpoint.save(str(tmp_path / "ckpt"))
  for entry in kernel_state:
    entry.assign(tf.zeros_like(entry))
  checkpoint.restore(saved)
  assert [int(c.numpy()) for c in kernel_state[1].value.values] == calls
  for before, after in zip(residues, [r.numpy() for r in kernel_state[0].value.values]):
    np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("dtype", [tf.float64, tf.bfloat16])
def test_other_float_dtypes_lose_nothing_to_their_residue(dtype):
  compressor = tf_adacomp.get_compressor("sign", stride=2, block=8)
  plan = compressor.plan([5, 7], dtype, "dense/kernel")
  grad = tf.cast(tf.random.stateless_normal(plan.shape, [3, 4]), dtype)
  payload, ((residue, _),) = compressor.compress([grad], [compressor.init(plan)], [plan])
  (total,) = compressor.decompress(payload[None], [plan])
  assert total.dtype == dtype and residue.dtype == (tf.float64 if dtype == tf.float64
                                                     else tf.float32)
  np.testing.assert_allclose(tf.cast(total, tf.float64) + tf.cast(residue, tf.float64),
                             tf.cast(grad, tf.float64), atol=1e-2 if dtype == tf.bfloat16
                             else 1e-12)
