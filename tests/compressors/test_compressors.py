"""Each compressor through the contract: error feedback, gathered decoding, casts, TopK."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
import tiers


def _combine(compressor, plan, payloads):
  if plan.summable:
    return compressor.decompress(tf.add_n(payloads), [plan])[0]
  return compressor.decompress(tf.stack(payloads), [plan])[0]


# "topk" in the fast tier (AdaComp's error feedback over steps is tests/ops/test_adacomp.py's
# test_error_feedback_over_steps there, through this contract
# tests/compressors/test_adacomp_scale.py's test_error_feedback_loses_nothing_and_scales_are_counted).
@pytest.mark.parametrize("name", [tiers.slow("adacomp"), "topk", "sign"])
def test_error_feedback_loses_nothing_over_steps(name):
  """sum of what was sent + final residue == sum of all gradients (to rounding)."""
  compressor = tf_adacomp.get_compressor(name)
  plan = compressor.plan([40, 30], tf.float32, "dense/kernel")
  state = compressor.init(plan)
  rng = np.random.default_rng(0)
  sent = np.zeros([40, 30], np.float64)
  total = np.zeros([40, 30], np.float64)
  for _ in range(6):
    grad = rng.standard_normal([40, 30]).astype(np.float32)
    total += grad
    payload, (state,) = compressor.compress([grad], [state], [plan])
    step = compressor.decompress(payload, [plan])[0].numpy()
    assert np.count_nonzero(step) < step.size  # it did compress
    sent += step
  np.testing.assert_allclose(sent + state[0].numpy(), total, atol=1e-4)


# AdaComp with --full: its gathered payloads decode to the replicas' sum in replica order
# in tests/ops/test_adacomp.py's test_gathered_decode_three_replicas (the fast tier; TopK
# here takes the same gathered path of the contract).
@pytest.mark.parametrize("name", [tiers.slow("adacomp"), "topk", "sign", "none", "fp16", "bf16"])
def test_combined_payload_is_the_sum_over_replicas(name):
  compressor = tf_adacomp.get_compressor(name)
  plan = compressor.plan([3, 3, 4, 8], tf.float32, "conv/kernel")
  rng = np.random.default_rng(1)
  payloads, singles = [], []
  for _ in range(3):
    payload, _ = compressor.compress(
        [rng.standard_normal(plan.shape).astype(np.float32)], [compressor.init(plan)], [plan])
    payloads.append(payload)
    singles.append(compressor.decompress(payload, [plan])[0].numpy())
  combined = _combine(compressor, plan, payloads).numpy()
  tol = {"fp16": 2e-3, "bf16": 3e-2}.get(name, 1e-6)
  np.testing.assert_allclose(combined, np.sum(singles, 0), rtol=tol, atol=tol)
  if not plan.summable:
    # Gathered payloads are decoded and added in replica order, in float32: every replica
    # adds the same floats in the same order, and gets the same sum bit for bit.
    in_order = singles[0]
    for single in singles[1:]:
      in_order = in_order + single
    np.testing.assert_array_equal(combined, in_order)


@pytest.mark.parametrize("name,wire,rtol", [("fp16", tf.float16, 1e-3), ("bf16", tf.bfloat16, 1e-2)])
def test_casts_halve_the_bytes(name, wire, rtol):
  compressor = tf_adacomp.get_compressor(name)
  plan = compressor.plan([100], tf.float32)
  grad = tf.linspace(-3.0, 3.0, 100)
  payload, (state,) = compressor.compress([grad], [compressor.init(plan)], [plan])
  assert payload.dtype == wire and state == ()
  assert int(compressor.nbytes(payload, [plan])[0]) == 200
  np.testing.assert_allclose(compressor.decompress(payload, [plan])[0], grad, rtol=rtol,
                             atol=1e-3)


def test_none_is_exact():
  compressor = tf_adacomp.NoCompression()
  plan = compressor.plan([5, 5], tf.float32)
  grad = tf.random.normal([5, 5])
  payload, _ = compressor.compress([grad], [()], [plan])
  np.testing.assert_array_equal(compressor.decompress(payload, [plan])[0], grad)
  assert int(compressor.nbytes(payload, [plan])[0]) == 100


def _topk_reference(grad, residue, density):
  g = residue.astype(np.float32) + grad.astype(np.float32)
  flat = g.reshape(-1)
  k = max(1, int(np.ceil(density * flat.size)))
  order = np.argsort(-np.abs(flat), kind="stable")[:k]
  sent = np.zeros_like(flat)
  sent[order] = flat[order]
  return sent.reshape(g.shape), (flat - sent).reshape(g.shape), k


@pytest.mark.parametrize("shape,density", [([1000], 0.01), ([37, 3], 0.1), ([1], 0.5), ([2048], 1.0)])
def test_topk_matches_numpy(shape, density):
  rng = np.random.default_rng(2)
  grad = rng.standard_normal(shape).astype(np.float32)
  residue = rng.standard_normal(shape).astype(np.float32)
  payload, new_residue = tf_adacomp.ops.topk_compress(grad, residue, density)
  sent, expected_residue, k = _topk_reference(grad, residue, density)
  assert payload.shape == [tf_adacomp.ops.topk_payload_words(int(np.prod(shape)), density)]
  assert int(payload[0]) == k
  decoded = tf_adacomp.ops.topk_decompress(payload, shape, density).numpy()
  np.testing.assert_array_equal(decoded, sent)
  np.testing.assert_array_equal(new_residue.numpy(), expected_residue)


def test_topk_non_finite_keeps_the_residue_and_decodes_to_nan():
  residue = tf.ones([64])
  grad = tf.tensor_scatter_nd_update(tf.zeros([64]), [[3]], [np.inf])
  payload, new_residue = tf_adacomp.ops.topk_compress(grad, residue, 0.1)
  np.testing.assert_array_equal(new_residue, residue)
  assert np.isnan(tf_adacomp.ops.topk_decompress(payload, [64], 0.1).numpy()).any()


def test_topk_rejects_a_payload_of_another_shape():
  payload, _ = tf_adacomp.ops.topk_compress(tf.ones([100]), tf.zeros([100]), 0.1)
  with pytest.raises(ValueError, match="payload"):
    tf_adacomp.ops.topk_decompress(payload, [200], 0.1)


@pytest.mark.parametrize("dtype", [  # the fast tier: bfloat16; --full all three
    pytest.param(tf.float16, marks=pytest.mark.slow), tf.bfloat16,
    pytest.param(tf.float64, marks=pytest.mark.slow)])
def test_adacomp_residues_are_at_least_float32(dtype):
  compressor = tf_adacomp.AdaComp()
  plan = compressor.plan([600], dtype)
  (residue,) = compressor.init(plan)
  assert residue.dtype == (tf.float64 if dtype == tf.float64 else tf.float32)
  payload, ((new_residue,),) = compressor.compress([tf.ones([600], dtype)], [(residue,)], [plan])
  assert new_residue.dtype == residue.dtype
  assert compressor.decompress(payload, [plan])[0].dtype == dtype


@pytest.mark.parametrize("name", ["adacomp", "topk", "fft"])
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64])
def test_error_feedback_residues_have_the_residue_dtype_of_base(name, dtype):
  from tf_adacomp.compressors import base  # pylint: disable=g-import-not-at-top
  assert base.residue_dtype(dtype) == (tf.float64 if dtype == tf.float64 else tf.float32)
  compressor = tf_adacomp.get_compressor(name)
  residue = compressor.init(compressor.plan([600], dtype))[0]
  assert residue.dtype == base.residue_dtype(dtype)


def test_min_size_must_be_an_integer_at_least_0():
  assert tf_adacomp.AdaComp(min_size=0).min_size == 0
  for value in (-1, 1.5, True, None):
    with pytest.raises(ValueError, match=re.escape(
        f"`min_size` must be an integer >= 0. Received: min_size={value!r}")):
      tf_adacomp.TopK(min_size=value)
