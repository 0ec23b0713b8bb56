"""Property-based tests of the AdaComp kernels (scale="tensor" and "bin") against the
independent NumPy reference (numpy_reference.py) on magnitudes that stress them:
subnormals, values near float32's maximum (1e38), exact ties at the bin maxima, all-zero
bins and mixed signs, for float32, float16, bfloat16 and float64 gradients (issue 16,
item 3). tests/ops/test_adacomp.py covers random normal values and chosen edge cases;
here hypothesis draws the magnitudes.

Subnormals: XLA:CPU computes with subnormals flushed to zero (as TensorFlow does on
CPU), other backends may keep them. A kernel's result must match the reference either
on the inputs as they are or on the inputs with every element that is subnormal in the
compute dtype set to 0, exactly, and nothing else (a float16 subnormal widens to a
normal float32, so it is never flushed). The inputs keep normal values far enough above
the smallest normal that no operation of the algorithm makes a new subnormal of them.

Every distinct shape, dtype and bin size compiles new XLA programs that XLA:CPU keeps
for the life of the process (tests/conftest.py): the cases are a small fixed set, and
hypothesis varies the values.
"""

import hypothesis
from hypothesis import strategies as st
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import numpy_reference as ref
from tf_adacomp.ops import adacomp
import tiers

# float64 maxima beyond float32 overflow when the reference rounds them.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered")

NP_DTYPES = {"float16": np.float16, "bfloat16": ref.BFLOAT16, "float32": np.float32,
             "float64": np.float64}
# (shape, bin size, grad dtype, residue dtype): 50 elements in bins of 7 (the last holds
# one element) in every dtype; one bin of a whole 8x8 tensor in float32.
CASES = [((50,), 7, "float32", "float32"), ((50,), 7, "float16", "float32"),
         ((50,), 7, "bfloat16", "float32"), ((50,), 7, "float64", "float64"),
         ((8, 8), 64, "float32", "float32")]
MAGNITUDES = ["subnormal", "huge", "ties", "zero_bins", "mixed"]


def _finfo(dtype):
  return ml_dtypes.finfo(dtype) if dtype == ref.BFLOAT16 else np.finfo(dtype)


def _values(kind, shape, dtype, rng, residue=False):
  """Values of ``dtype`` for one magnitude ``kind`` (see MAGNITUDES)."""
  info = _finfo(dtype)
  n = int(np.prod(shape))
  sign = rng.choice([-1.0, 1.0], n)
  mantissa = 1 + rng.random(n)
  if kind == "subnormal":
    # A third of the elements subnormal in ``dtype``, a third normal (far above the
    # smallest normal, so no difference or mean of them is subnormal), a third zero.
    subnormal = float(info.smallest_subnormal) * rng.integers(1, 64, n)
    low, high = (-12, 4) if dtype == np.float16 else (-30, -10)
    normal = mantissa * 2.0 ** rng.integers(low, high, n)
    which = rng.integers(0, 3, n)
    x = np.where(which == 0, subnormal, np.where(which == 1, normal, 0.0))
  elif kind == "huge":
    # Near the largest finite value of float32 (of float16 for float16 gradients): G and
    # H may overflow, and a scale may round beyond float32 or bfloat16.
    top = float(info.max) if dtype == np.float16 else 3.4e38
    x = np.where(rng.random(n) < 0.8, top * rng.uniform(0.1, 1.0, n), mantissa)
    if dtype == np.float64 and rng.random() < 0.3:
      x = x * 1e200  # a scale that float32 cannot hold at all
  elif kind == "ties":
    # Few distinct magnitudes: |H| equals its bin maximum often, in both signs.
    x = rng.choice([0.0, 0.5, 1.0, 2.0], n)
  elif kind == "zero_bins":
    x = mantissa * 2.0 ** rng.integers(-8, 8, n)  # zeroed by bins in _inputs
  else:  # "mixed": magnitudes over many binades, mixed signs
    low, high = (-14, 15) if dtype == np.float16 else (-60, 60)
    x = mantissa * 2.0 ** rng.integers(low, high, n)
  x = sign * x
  if residue and kind != "ties" and rng.random() < (0.5 if kind == "huge" else 0.3):
    x = np.zeros(n)  # a first step (for "huge", G then stays within float32)
  return x.reshape(shape).astype(dtype)


def _inputs(kind, shape, bin_size, grad_dtype, residue_dtype, rng):
  grad = _values(kind, shape, NP_DTYPES[grad_dtype], rng)
  residue = _values(kind, shape, NP_DTYPES[residue_dtype], rng, residue=True)
  if kind == "zero_bins":
    n = grad.size
    bins = -(-n // bin_size)
    zero = np.repeat(rng.random(bins) < 0.5, bin_size)[:n].reshape(shape)
    grad = np.where(zero, 0, grad).astype(grad.dtype)
    residue = np.where(zero, 0, residue).astype(residue.dtype)
  return grad, residue


def _flushed(x, compute_dtype):
  """``x`` with the elements that are subnormal in ``compute_dtype`` set to 0."""
  wide = np.asarray(x).astype(compute_dtype)
  return np.where(np.abs(wide) < np.finfo(compute_dtype).tiny, 0, x).astype(x.dtype)


def _same(got, want):
  """Exact equality of float arrays, NaN equal to NaN (and -0 to 0: a flushed negative
  subnormal is -0)."""
  np.testing.assert_array_equal(np.asarray(got).astype(np.float64),
                                np.asarray(want).astype(np.float64))


def _check_tensor_scale(payload, new_residue, decoded, grad, residue, bin_size):
  n = grad.size
  r = ref.reference_compress(grad, residue, bin_size)
  dec = ref.unpack_payload(payload, n)
  assert dec.bits == r.bits
  # A mean of the bin maxima beyond float32 is sent as not finite too (docs/algorithms.md;
  # the reference leaves that case out).
  if not (r.finite and np.isfinite(r.scale)):
    assert dec.count == 0 and np.isnan(dec.scale)
    _same(new_residue, residue)
    assert np.isnan(decoded).all()
    return
  assert dec.count == r.count and dec.pairs == r.pairs()
  # The mean of the bin maxima: in float64, rounded once to float32 (an ulp either way
  # from the exactly rounded mean).
  assert np.isfinite(dec.scale) and ref.ulp_diff_f32(dec.scale, r.scale) <= 1, (
      dec.scale, r.scale)
  exact = ref.reference_compress(grad, residue, bin_size, scale=dec.scale)
  _same(new_residue, exact.new_residue)
  _same(decoded.reshape(-1), ref.dense_from_pairs(dec.pairs, dec.scale, n, decoded.dtype.type))


def _check_bin_scale(payload, new_residue, decoded, grad, residue, bin_size):
  n = grad.size
  r = ref.reference_compress_per_bin(grad, residue, bin_size)
  dec = ref.unpack_payload_per_bin(payload, n, bin_size)
  assert dec.bits_word == r.bits | ref.BIN_SCALE_FLAG and dec.bins == ref.bins_for(n, bin_size)
  if not r.finite:
    assert dec.count == 0 and np.isnan(dec.marker)
    _same(new_residue, residue)
    assert np.isnan(decoded).all()
    return
  assert dec.marker == 0 and dec.count == r.count and dec.pairs == r.pairs()
  _same(dec.scales, r.scales)  # the bfloat16 maxima, bit for bit
  _same(new_residue, r.new_residue)
  _same(decoded.reshape(-1), r.q.astype(decoded.dtype))


@pytest.mark.slow  # the fast tier checks the kernels against NumPy in tests/ops/test_adacomp.py
@hypothesis.settings(max_examples=tiers.examples(80), deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(case=st.sampled_from(CASES), scale=st.sampled_from(["tensor", "bin"]),
                  magnitude=st.sampled_from(MAGNITUDES), seed=st.integers(0, 2**32 - 1))
def test_kernels_match_the_reference_on_stressing_magnitudes(case, scale, magnitude, seed):
  shape, bin_size, grad_dtype, residue_dtype = case
  rng = np.random.default_rng(seed)
  grad, residue = _inputs(magnitude, shape, bin_size, grad_dtype, residue_dtype, rng)
  payload, new_residue = adacomp.adacomp_compress(tf.constant(grad), tf.constant(residue),
                                                  bin_size, scale=scale)
  compute = ref.compute_dtype(grad.dtype, residue.dtype)
  decoded = adacomp.adacomp_decompress(payload, shape, tf.as_dtype(compute), scale=scale,
                                       bin_size=bin_size if scale == "bin" else None)
  assert decoded.dtype == compute and tuple(decoded.shape) == shape
  assert new_residue.dtype == residue.dtype and tuple(new_residue.shape) == shape
  check = _check_bin_scale if scale == "bin" else _check_tensor_scale
  got = (payload.numpy(), new_residue.numpy(), decoded.numpy())
  # The inputs as they are, or with their subnormals flushed (see the module doc).
  candidates = [(grad, residue),
                (_flushed(grad, compute), _flushed(residue, compute))]
  failures = []
  for g, r in candidates:
    try:
      check(*got, g, r, bin_size)
      return
    except AssertionError as e:
      failures.append(e)
  raise failures[0]
