"""Tests of the AdaComp kernels (tf_adacomp.ops) against an independent NumPy reference.

The reference (numpy_reference.py) is written from docs/algorithms.md#adacomp and the wire
format contract; it shares no code with tf_adacomp. Payload codes are compared as a SET of
(position, sign) pairs: their order in the payload is not part of the contract.
"""

import math
import zlib

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest
import tensorflow as tf

import numpy_reference as ref
from tf_adacomp.ops import adacomp_compress
from tf_adacomp.ops import adacomp_decompress
from tf_adacomp.ops import payload_nbytes
from tf_adacomp.ops import payload_words
from tf_adacomp.ops import adacomp_core
import tiers

NP_DTYPES = {
    "float16": np.float16,
    "bfloat16": ref.BFLOAT16,
    "float32": np.float32,
    "float64": np.float64,
}


# ---------------------------------------------------------------------------- helpers


def random_array(shape, dtype, rng, scale=1.0, zero_fraction=0.05):
  """Random normal values in ``dtype`` (a NumPy dtype), with a few exact zeros."""
  x = rng.standard_normal(shape).astype(np.float64) * scale
  if x.size:
    zeros = rng.random(shape) < zero_fraction
    x = np.where(zeros, 0.0, x)
  return np.asarray(x).astype(dtype)


def as_f32(x):
  return np.asarray(x).astype(np.float32)


def bits_of(x):
  """Raw bits of an array, for bit-identity checks (NaN payloads included)."""
  x = np.ascontiguousarray(np.asarray(x))
  return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def decode_dtype_for(grad_np, residue_np):
  cd = ref.compute_dtype(grad_np.dtype, residue_np.dtype)
  return tf.float64 if cd == np.float64 else tf.float32


def compress_np(grad_np, residue_np, bin_size, max_density=1.0):
  payload, new_residue = adacomp_compress(
      tf.constant(grad_np), tf.constant(residue_np), bin_size, max_density)
  return payload, new_residue


def assert_scale_close(got, exact, bins, compute_dtype):
  got, exact = np.float32(got), np.float32(exact)
  if ref.ulp_diff_f32(got, exact) <= 1:
    return
  assert compute_dtype == np.float32, (got, exact, "float64 compute must round once")
  bound = (bins + 1) * 2.0**-24 * float(exact)
  assert abs(float(got) - float(exact)) <= bound, (got, exact, bins)


def check_against_reference(grad_np, residue_np, bin_size, max_density=1.0):
  """Compresses with the kernel and checks everything against the reference.

  Returns (payload numpy, new_residue numpy, reference Result, decoded payload).
  """
  n = grad_np.size
  shape = grad_np.shape
  payload, new_residue = compress_np(grad_np, residue_np, bin_size, max_density)

  # Static types and shapes.
  assert payload.dtype == tf.int32
  assert payload.shape.rank == 1
  assert payload.shape[0] == payload_words(n, max_density) == ref.payload_words(n, max_density)
  assert new_residue.dtype == tf.as_dtype(residue_np.dtype)
  assert tuple(new_residue.shape) == tuple(residue_np.shape)

  p = payload.numpy()
  r = reference = ref.reference_compress(grad_np, residue_np, bin_size, max_density)
  dec = ref.unpack_payload(p, n)

  # Header.
  assert dec.count == r.count, (dec.count, r.count)
  assert dec.bits == r.bits == ref.code_bits(n)
  # Selected set: positions unique, in range, and exactly the reference's (with signs).
  assert len(set(dec.positions)) == dec.count, "duplicate positions in payload"
  assert all(0 <= q < n for q in dec.positions)
  assert dec.pairs == r.pairs(), (
      f"missing={sorted(r.pairs() - dec.pairs)[:10]} extra={sorted(dec.pairs - r.pairs())[:10]}")

  # Scale: the float32 mean of the bin maxima. The reference is the exactly rounded mean;
  # an implementation that sums in float32 (in any order) is within the classic summation
  # bound (bins + 1) * u of it (all terms are >= 0), and never more than that; in float64
  # it is within 1 ulp (the final rounding).
  if n:
    assert np.isfinite(dec.scale)
    assert_scale_close(dec.scale, r.scale, len(r.gmax), r.g.dtype)

  # Residue: exactly G - Q with the scale that was sent, in the residue dtype.
  r_exact = ref.reference_compress(grad_np, residue_np, bin_size, max_density, scale=dec.scale)
  np.testing.assert_array_equal(as_f32(new_residue.numpy()) if residue_np.dtype != np.float64
                                else new_residue.numpy(),
                                as_f32(r_exact.new_residue) if residue_np.dtype != np.float64
                                else r_exact.new_residue)

  # Byte accounting.
  nb = payload_nbytes(payload)
  assert nb.dtype == tf.int64 and nb.shape.rank == 0
  assert int(nb) == 4 * (3 + math.ceil(dec.count * dec.bits / 32)) == ref.nbytes_for(r.count, n)

  # Decode: exactly +-scale at the sent positions, in the compute dtype.
  out_dtype = decode_dtype_for(grad_np, residue_np)
  dense = adacomp_decompress(payload, shape, out_dtype)
  assert dense.dtype == out_dtype and tuple(dense.shape) == tuple(shape)
  want = ref.dense_from_pairs(dec.pairs, dec.scale, n, out_dtype.as_numpy_dtype)
  np.testing.assert_array_equal(dense.numpy().reshape(-1), want)

  # Only the first payload_nbytes bytes matter: the truncated payload decodes the same.
  used = int(nb) // 4
  dense_short = adacomp_decompress(p[:used], shape, out_dtype)
  np.testing.assert_array_equal(dense_short.numpy(), dense.numpy())
  return p, new_residue.numpy(), reference, dec


# ------------------------------------------------------------- reference self-checks


def test_reference_unpacker_roundtrip():
  """The reference unpacker reads what the (bit-by-bit) reference packer writes."""
  rng = np.random.default_rng(0)
  for n, count in [(1, 1), (2, 2), (33, 10), (1000, 77), (4096, 300)]:
    bits = ref.code_bits(n)
    pos = rng.choice(n, count, replace=False)
    neg = rng.random(count) < 0.5
    codes = (pos.astype(np.uint64) << 1) | neg.astype(np.uint64)
    body = ref.pack_codes(codes, bits)
    payload = np.concatenate([[count, np.float32(1.5).view(np.int32), bits],
                              body.view(np.int32)]).astype(np.int32)
    d = ref.unpack_payload(payload, n)
    assert d.positions == [int(x) for x in pos]
    assert d.pairs == {(int(a), bool(b)) for a, b in zip(pos, neg)}
    assert d.scale == np.float32(1.5)


# ------------------------------------------------------------ 1. against reference

SHAPES = [[], [1], [7], [50], [51], [3, 4, 5], [64, 33], [3, 3, 16, 32], [1000], [0], [0, 5]]
BIN_SIZES = [1, 7, 50, 500]


def _pairwise(rows, columns, fast_rows=None):
  """Every (row, column) pair; the fast tier keeps one column per row, the columns in
  turn (each compiled program costs about a second), and only the rows in ``fast_rows``
  (indices; all if None); the whole suite all of them."""
  return [pytest.param(row, column, id=f"{row}-{column}",
                       marks=() if (i + j) % len(columns) == 0 and
                       (fast_rows is None or i in fast_rows) else pytest.mark.slow)
          for i, row in enumerate(rows) for j, column in enumerate(columns)]


# Fast tier: one shape per rank class, [] (a scalar), [7] (rank 1, a short last bin),
# [64, 33] (rank 2), [0] (empty); the other shapes (the same flattened kernel) with --full.
@pytest.mark.parametrize("shape,bin_size", _pairwise(SHAPES, BIN_SIZES, fast_rows={0, 2, 6, 9}))
def test_matches_reference_float32(shape, bin_size):
  rng = np.random.default_rng(1000 + len(shape) * 100 + bin_size + int(np.prod(shape)))
  grad = random_array(shape, np.float32, rng)
  residue = random_array(shape, np.float32, rng, scale=0.5)
  check_against_reference(grad, residue, bin_size)


DTYPE_PAIRS = [
    # (grad dtype, residue dtype)
    ("float16", "float32"),
    ("bfloat16", "float32"),
    ("float64", "float32"),
    ("float32", "float16"),
    ("float16", "float16"),
    ("bfloat16", "bfloat16"),
    ("float64", "float64"),
    ("float32", "float64"),
]


# Fast tier: each dtype once, as the gradient's or the residue's: (bfloat16, float32),
# (float16, float16) and (float64, float64) (float64 compute); the other pairs with --full.
@pytest.mark.parametrize("dtypes,shape", _pairwise(DTYPE_PAIRS, [[3, 4, 5], [1000]],
                                                   fast_rows={1, 4, 6}))
def test_matches_reference_dtypes(dtypes, shape):
  grad_dtype, residue_dtype = dtypes
  rng = np.random.default_rng(zlib.crc32(f"{grad_dtype}-{residue_dtype}-{shape}".encode()))
  grad = random_array(shape, NP_DTYPES[grad_dtype], rng)
  residue = random_array(shape, NP_DTYPES[residue_dtype], rng, scale=0.5)
  if residue_dtype in ("float32", "float64") and grad.size:
    # A few elements where residue == -grad exactly, so G == 0 (must not be sent).
    idx = rng.choice(grad.size, max(1, grad.size // 20), replace=False)
    flat = residue.reshape(-1)
    flat[idx] = -grad.reshape(-1)[idx].astype(flat.dtype)
  check_against_reference(grad, residue, 50)


# float16 in the fast tier (bfloat16, the same cast, with --full).
@pytest.mark.parametrize("grad_dtype", ["float16", tiers.slow("bfloat16")])
def test_decode_in_low_precision_dtype(grad_dtype):
  """Decoding into the grad's own dtype gives +-scale rounded to that dtype."""
  rng = np.random.default_rng(7)
  grad = random_array([3, 4, 5], NP_DTYPES[grad_dtype], rng)
  residue = np.zeros([3, 4, 5], np.float32)
  payload, _ = compress_np(grad, residue, 7)
  dec = ref.unpack_payload(payload.numpy(), grad.size)
  dense = adacomp_decompress(payload, [3, 4, 5], tf.as_dtype(grad_dtype))
  assert dense.dtype == tf.as_dtype(grad_dtype)
  want = ref.dense_from_pairs(dec.pairs, dec.scale, grad.size, np.float32)
  want = want.astype(NP_DTYPES[grad_dtype]).astype(np.float32)
  np.testing.assert_array_equal(as_f32(dense.numpy()).reshape(-1), want)


# Slow: every reference check bounds the scale already; this one at 50,000 elements.
@pytest.mark.slow
def test_large_tensor_many_bins_scale():
  """A 1000-bin mean: scale within 1 ulp of the exact mean."""
  rng = np.random.default_rng(11)
  grad = random_array([50000], np.float32, rng)
  check_against_reference(grad, np.zeros_like(grad), 50)


# ------------------------------------------------------------------------ 2. edge cases


# Fast tier: the programs the shapes [7] and [50] share; the larger bins with --full.
@pytest.mark.parametrize("shape,bin_size", tiers.fast_only(
    [([7], 7), ([50], 7), ([51], 50), ([64, 33], 500)], keep={0, 1}), ids=str)
def test_all_equal_elements_are_all_sent(shape, bin_size):
  grad = np.full(shape, 0.375, np.float32)
  residue = np.zeros(shape, np.float32)
  p, new_residue, r, dec = check_against_reference(grad, residue, bin_size)
  n = grad.size
  assert dec.count == n
  assert dec.pairs == {(i, False) for i in range(n)}
  assert dec.scale == np.float32(0.375)
  np.testing.assert_array_equal(new_residue, np.zeros(shape, np.float32))


@pytest.mark.parametrize("shape,bin_size", [([7], 7), ([50], 7), ([51], 50)], ids=str)
def test_all_equal_negative_with_residue(shape, bin_size):
  grad = np.full(shape, -0.25, np.float32)
  residue = np.full(shape, -0.5, np.float32)
  _, new_residue, _, dec = check_against_reference(grad, residue, bin_size)
  assert dec.count == grad.size
  assert all(neg for _, neg in dec.pairs)
  assert dec.scale == np.float32(0.75)
  np.testing.assert_array_equal(new_residue, np.zeros(shape, np.float32))


def test_ties_at_bin_max_with_zero_grad():
  """With dW == 0, H == G: exactly the elements whose |G| equals the bin max are sent
  (>= comparison), including ties and both signs."""
  residue = np.array([1.0, -1.0, 0.5, 1.0, 0.0, -0.25, 0.25,   # bin 0: max 1 (x3)
                      0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,        # bin 1: all zero
                      -2.0, 2.0, -2.0, 1.0, 0.0, 0.0, 0.0,      # bin 2: max 2 (x3)
                      0.125, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,      # bin 3: single
                      ], np.float32)[:28]
  residue = np.pad(residue, [0, 50 - residue.size])  # bins 4-7 all zero (last short: 1)
  grad = np.zeros_like(residue)
  _, _, r, dec = check_against_reference(grad, residue, 7)
  assert dec.pairs == {(0, False), (1, True), (3, False), (14, True), (15, False), (16, True),
                       (21, False)}
  # scale = mean over all 8 bins of gmax = (1 + 0 + 2 + 0.125 + 0 * 4) / 8
  assert dec.scale == np.float32(3.125 / 8)


def test_opposing_gradient_selects_nothing_in_bin():
  """dW opposing G at the bin maximum: |H| < gmax, so a bin may send nothing."""
  residue = np.array([1.0, 0.1, 0.1, 0.1], np.float32)
  grad = np.array([-0.5, 0.0, 0.0, 0.0], np.float32)  # G = [0.5, .1, .1, .1], H = [0, ...]
  _, new_residue, _, dec = check_against_reference(grad, residue, 4)
  assert dec.count == 0
  np.testing.assert_array_equal(new_residue, np.array([0.5, 0.1, 0.1, 0.1], np.float32))


# [7] and [64, 33] in the fast tier (rank 1 and rank 2; rank 4, the same flattened kernel,
# with --full).
@pytest.mark.parametrize("shape", [[7], [64, 33], tiers.slow([3, 3, 16, 32])], ids=str)
def test_all_zeros(shape):
  z = np.zeros(shape, np.float32)
  payload, new_residue = compress_np(z, z, 50)
  p = payload.numpy()
  assert p[0] == 0
  assert p[1:2].view(np.float32)[0] == 0.0
  assert int(payload_nbytes(payload)) == 12
  np.testing.assert_array_equal(new_residue.numpy(), z)
  np.testing.assert_array_equal(adacomp_decompress(payload, shape).numpy(), z)


@pytest.mark.parametrize("shape", [[], [1]], ids=str)
@pytest.mark.parametrize("value", [1.5, -3.0, 0.0])
def test_one_element(shape, value):
  grad = np.full(shape, value, np.float32)
  residue = np.zeros(shape, np.float32)
  p, new_residue, _, dec = check_against_reference(grad, residue, 1)
  assert len(p) == 3 + 1  # bits = 1, one code
  assert dec.bits == 1
  if value == 0.0:
    assert dec.count == 0
  else:
    assert dec.pairs == {(0, value < 0)}
    assert dec.scale == np.float32(abs(value))
    np.testing.assert_array_equal(new_residue, np.zeros(shape, np.float32))


@pytest.mark.parametrize("shape", [[0], [0, 5]], ids=str)
def test_zero_elements(shape):
  z = np.zeros(shape, np.float32)
  payload, new_residue = compress_np(z, z, 7)
  assert payload.shape == [3] and payload_words(0) == 3
  p = payload.numpy()
  assert p[0] == 0 and p[2] == 1
  assert tuple(new_residue.shape) == tuple(shape)
  assert int(payload_nbytes(payload)) == 12
  out = adacomp_decompress(payload, shape)
  assert tuple(out.shape) == tuple(shape)


# ------------------------------------------------------------ 3. error-feedback invariant


def assert_invariant(dense, new_residue, grad, residue, scale):
  """decompress(payload) + new_residue == grad + residue, to rounding."""
  cd = ref.compute_dtype(grad.dtype, residue.dtype)
  lhs = dense.astype(cd).reshape(-1) + new_residue.astype(cd).reshape(-1)
  rhs = grad.astype(cd).reshape(-1) + residue.astype(cd).reshape(-1)
  eps = np.finfo(new_residue.dtype if new_residue.dtype != ref.BFLOAT16 else np.float32).eps
  if new_residue.dtype == ref.BFLOAT16:
    eps = 2.0**-8
  mag = np.abs(rhs) + np.float64(scale)
  np.testing.assert_array_less(np.abs(lhs - rhs), 2 * eps * mag + 1e-30)


# Fast tier: float32 (the dtypes are test_matches_reference_dtypes's); larger bins,
# bfloat16, float16 and a capacity (tested on its own below) with --full.
@pytest.mark.parametrize("shape,bin_size,grad_dtype,max_density", tiers.fast_only([
    ([64, 33], 50, "float32", 1.0),
    ([1000], 500, "float32", 1.0),
    ([3, 4, 5], 7, "bfloat16", 1.0),
    ([1000], 50, "float16", 1.0),
    ([64, 33], 50, "float32", 0.02),
], keep={0}), ids=str)
def test_error_feedback_over_steps(shape, bin_size, grad_dtype, max_density):
  rng = np.random.default_rng(42)
  residue = np.zeros(shape, np.float32)
  for step in range(5):
    grad = random_array(shape, NP_DTYPES[grad_dtype], rng, scale=0.1 * (step + 1))
    p, new_residue, r, dec = check_against_reference(grad, residue, bin_size, max_density)
    dense = adacomp_decompress(p, shape).numpy()
    assert_invariant(dense, new_residue, grad, residue, dec.scale)
    residue = new_residue


# ---------------------------------------------------------------------------- 4. capacity


@pytest.mark.parametrize("shape,max_density", [
    # Fast tier: a capacity of 10 codes of 1,000; the others with --full.
    tiers.slow([50], 0.3),         # B = 2
    ([1000], 0.01),      # B = 32, C = 10
    tiers.slow([1000], 0.25),
    tiers.slow([64, 33], 0.1),     # n = 2112, B = 66
    pytest.param([3, 3, 16, 32], 0.05, marks=pytest.mark.slow),  # n = 4608, B = 144
], ids=str)
def test_capacity_keeps_the_lowest_positions(shape, max_density):
  rng = np.random.default_rng(5)
  grad = random_array(shape, np.float32, rng)
  residue = np.zeros(shape, np.float32)  # bin 1: H = 2G, every nonzero element selected
  n = grad.size
  cap = ref.capacity(n, max_density)
  payload, new_residue = compress_np(grad, residue, 1, max_density)
  assert payload.shape[0] == payload_words(n, max_density) == ref.payload_words(n, max_density)
  dec = ref.unpack_payload(payload.numpy(), n)
  selected = np.nonzero(grad.reshape(-1) != 0)[0]
  assert selected.size > cap
  assert dec.count == cap
  got = {p for p, _ in dec.pairs}
  assert got == set(int(i) for i in selected[:cap]), "kept set is not the flat-order prefix"
  # Full reference check (residue keeps what was dropped) and the invariant.
  p, new_res, r, dec = check_against_reference(grad, residue, 1, max_density)
  dropped = r.selected & ~r.kept
  assert dropped.sum() == selected.size - cap
  np.testing.assert_array_equal(new_res.reshape(-1)[dropped], grad.reshape(-1)[dropped])
  dense = adacomp_decompress(p, shape).numpy()
  assert_invariant(dense, new_res, grad, residue, dec.scale)


# Slow: every max_density=1.0 case above sends all it selects; a capacity that binds is
# test_capacity_keeps_the_lowest_positions's in the fast tier.
@pytest.mark.slow
def test_capacity_not_reached_sends_all():
  rng = np.random.default_rng(6)
  grad = random_array([1000], np.float32, rng)
  residue = random_array([1000], np.float32, rng)
  _, _, r, dec = check_against_reference(grad, residue, 500, 0.5)
  assert r.selected.sum() < ref.capacity(1000, 0.5)
  assert dec.count == r.selected.sum()


def test_capacity_minimum_one():
  grad = np.arange(1, 51, dtype=np.float32)
  _, _, r, dec = check_against_reference(grad, np.zeros_like(grad), 1, 1e-6)
  assert dec.count == 1 and dec.pairs == {(0, False)}


# ------------------------------------------------------------------- 5. size accounting


@pytest.mark.parametrize("n,max_density", [(0, 1.0), (1, 1.0), (2, 1.0), (7, 1.0), (50, 1.0),
                                           (1000, 1.0), (1000, 0.01), (2112, 0.1),
                                           (4608, 0.05), (1 << 20, 0.001), (1, 0.5)])
def test_payload_words_formula(n, max_density):
  assert payload_words(n, max_density) == ref.payload_words(n, max_density)
  assert payload_words(n) == ref.payload_words(n)


def test_nbytes_rank2_per_row():
  rng = np.random.default_rng(8)
  rows, counts = [], []
  for k, density in enumerate([0.0, 0.3, 1.0]):
    grad = random_array([1000], np.float32, rng, zero_fraction=1.0 - density)
    payload, _ = compress_np(grad, np.zeros_like(grad), 1)
    rows.append(payload.numpy())
    counts.append(int(payload.numpy()[0]))
  gathered = np.stack(rows)
  nb = payload_nbytes(tf.constant(gathered))
  assert nb.dtype == tf.int64 and nb.shape == [3]
  bits = ref.code_bits(1000)
  assert list(nb.numpy()) == [4 * (3 + math.ceil(c * bits / 32)) for c in counts]
  assert len(set(counts)) == 3
  for row in rows:
    assert int(payload_nbytes(tf.constant(row))) == ref.nbytes_for(int(row[0]), 1000)


# ---------------------------------------------------------- 6. eager / graph / XLA wrapper


# float32 in the fast tier (bfloat16 with a capacity, the same three paths, with --full).
@pytest.mark.parametrize("shape,bin_size,max_density,grad_dtype", [
    ([64, 33], 50, 1.0, "float32"),
    tiers.slow([1000], 7, 0.05, "bfloat16"),
], ids=str)
def test_eager_function_and_jit_agree(shape, bin_size, max_density, grad_dtype):
  rng = np.random.default_rng(9)
  grad = tf.constant(random_array(shape, NP_DTYPES[grad_dtype], rng))
  residue = tf.constant(random_array(shape, np.float32, rng))

  def step(g, r):
    payload, new_residue = adacomp_compress(g, r, bin_size, max_density)
    return payload, new_residue, adacomp_decompress(payload, shape), payload_nbytes(payload)

  results = [step(grad, residue),
             tf.function(step)(grad, residue),
             tf.function(step, jit_compile=True)(grad, residue)]
  base = [bits_of(x.numpy()) for x in results[0]]
  for other in results[1:]:
    for a, b in zip(base, other):
      np.testing.assert_array_equal(a, bits_of(b.numpy()))
  # And the eager result is the reference's.
  check_against_reference(grad.numpy(), residue.numpy(), bin_size, max_density)


# ------------------------------------------------------------------- 7. gathered decode


def three_replicas(shape, rng, densities=(0.02, 0.5, 1.0), bin_size=50, max_density=1.0):
  payloads, refs = [], []
  for d in densities:
    grad = random_array(shape, np.float32, rng, zero_fraction=1.0 - d)
    residue = random_array(shape, np.float32, rng, scale=0.3, zero_fraction=1.0 - d)
    payload, _ = compress_np(grad, residue, bin_size, max_density)
    payloads.append(payload.numpy())
    refs.append(ref.reference_compress(grad, residue, bin_size, max_density,
                                       scale=ref.unpack_payload(payload.numpy(),
                                                                grad.size).scale))
  return payloads, refs


@pytest.mark.parametrize("trim", [True, False], ids=["trimmed", "full"])
def test_gathered_decode_three_replicas(trim):
  shape = [64, 33]
  n = 64 * 33
  rng = np.random.default_rng(10)
  payloads, refs = three_replicas(shape, rng)
  counts = [int(p[0]) for p in payloads]
  assert len(set(counts)) == 3, counts
  if trim:
    rows = [p[:int(payload_nbytes(tf.constant(p))) // 4] for p in payloads]
    assert len({len(r) for r in rows}) == 3
  else:
    rows = payloads
  gathered = ref.pad_rows(rows)
  out1 = adacomp_decompress(tf.constant(gathered), shape).numpy()
  out2 = adacomp_decompress(tf.constant(gathered), shape).numpy()
  np.testing.assert_array_equal(bits_of(out1), bits_of(out2))

  # Sum in row order, in float32: ((0 + q0) + q1) + q2.
  qs = [r.q.astype(np.float32) for r in refs]
  want = ((np.zeros(n, np.float32) + qs[0]) + qs[1]) + qs[2]
  np.testing.assert_array_equal(out1.reshape(-1), want)
  np.testing.assert_array_equal(out1.reshape(-1), ref.reference_decode_rows(gathered, n))
  # Each row's contribution is exactly +-scale_r at its positions.
  singles = [adacomp_decompress(tf.constant(p), shape).numpy().reshape(-1) for p in payloads]
  for s, r in zip(singles, refs):
    np.testing.assert_array_equal(s, r.q.astype(np.float32))
  np.testing.assert_array_equal(out1.reshape(-1), (singles[0] + singles[1]) + singles[2])


# Slow: the gathered decode is test_gathered_decode_three_replicas's in the fast tier; this
# one checks its rounding over row orders.
@pytest.mark.slow
def test_gathered_decode_row_order_matters_only_by_rounding():
  """Rows in another order: same values to rounding, and each order reproduces exactly
  its own sequential float32 sum."""
  shape = [1000]
  rng = np.random.default_rng(12)
  payloads, refs = three_replicas(shape, rng, bin_size=7)
  for order in ([0, 1, 2], [2, 0, 1]):
    gathered = ref.pad_rows([payloads[i] for i in order])
    out = adacomp_decompress(tf.constant(gathered), shape).numpy()
    acc = np.zeros(1000, np.float32)
    for i in order:
      acc = acc + refs[i].q.astype(np.float32)
    np.testing.assert_array_equal(out, acc)


# Slow: the gathered decode path of test_gathered_decode_three_replicas (fast), with one row.
@pytest.mark.slow
def test_gathered_single_row_matches_rank1():
  rng = np.random.default_rng(13)
  grad = random_array([3, 4, 5], np.float32, rng)
  payload, _ = compress_np(grad, np.zeros_like(grad), 7)
  a = adacomp_decompress(payload, [3, 4, 5]).numpy()
  b = adacomp_decompress(tf.constant(payload.numpy()[None]), [3, 4, 5]).numpy()
  np.testing.assert_array_equal(bits_of(a), bits_of(b))


# ---------------------------------------------------------------------- 8. non-finite


def _nonfinite_case(kind, rng):
  grad = random_array([7, 9], np.float32, rng)
  residue = random_array([7, 9], np.float32, rng, scale=0.5)
  if kind == "nan":
    grad[3, 4] = np.nan
  elif kind == "inf":
    grad[0, 0] = np.inf
  elif kind == "-inf":
    grad[6, 8] = -np.inf
  elif kind == "residue_nan":
    residue[2, 2] = np.nan
  elif kind == "overflow":  # finite inputs, G = grad + residue overflows float32
    grad[1, 1] = 3e38
    residue[1, 1] = 3e38
  return grad, residue


@pytest.mark.parametrize("kind", ["nan", "inf", "-inf", "residue_nan", "overflow"])
def test_nonfinite_input(kind):
  rng = np.random.default_rng(14)
  grad, residue = _nonfinite_case(kind, rng)
  payload, new_residue = compress_np(grad, residue, 7)
  p = payload.numpy()
  assert p[0] == 0
  assert np.isnan(p[1:2].view(np.float32)[0])
  np.testing.assert_array_equal(bits_of(new_residue.numpy()), bits_of(residue))
  out = adacomp_decompress(payload, [7, 9]).numpy()
  assert np.all(np.isnan(out))
  # Also through the reference.
  r = ref.reference_compress(grad, residue, 7)
  assert not r.finite and r.count == 0


# Slow: test_nonfinite_input's path (fast) with a float16 gradient.
@pytest.mark.slow
def test_nonfinite_float16_grad():
  grad = np.array([1.0, np.inf, 2.0], np.float16)
  residue = np.array([0.5, 0.25, -1.0], np.float32)
  payload, new_residue = compress_np(grad, residue, 2)
  assert payload.numpy()[0] == 0
  np.testing.assert_array_equal(new_residue.numpy(), residue)
  assert np.all(np.isnan(adacomp_decompress(payload, [3]).numpy()))


def test_gathered_with_one_bad_row_is_all_nan():
  rng = np.random.default_rng(15)
  rows = []
  for k in range(3):
    grad, residue = _nonfinite_case("nan" if k == 1 else "none", rng)
    payload, _ = compress_np(grad, residue, 7)
    rows.append(payload.numpy()[:int(payload_nbytes(payload)) // 4])
  gathered = ref.pad_rows(rows)
  out = adacomp_decompress(tf.constant(gathered), [7, 9]).numpy()
  assert np.all(np.isnan(out))


def test_scale_sum_must_not_overflow():
  """Finite G whose per-bin maxima are near float32 max: the mean of the maxima is finite
  (3e38), so the scale must be 3e38 and the residue must stay finite."""
  grad = np.array([3e38, 3e38], np.float32)
  residue = np.zeros_like(grad)
  payload, new_residue = compress_np(grad, residue, 1)
  dec = ref.unpack_payload(payload.numpy(), 2)
  assert np.all(np.isfinite(new_residue.numpy())), (
      f"residue poisoned: {new_residue.numpy()}, scale word {dec.scale}")
  check_against_reference(grad, residue, 1)


def test_scale_beyond_float32_keeps_the_residue():
  """float64 G whose mean bin maximum float32 cannot hold: nothing is sent, R is kept and
  the payload decodes to NaN, as for a non-finite G."""
  grad = np.array([1e300, 1.0], np.float64)
  residue = np.array([0.5, 0.25], np.float64)
  payload, new_residue = compress_np(grad, residue, 1)
  np.testing.assert_array_equal(new_residue.numpy(), residue)
  assert int(payload[0]) == 0
  assert np.all(np.isnan(adacomp_decompress(payload, [2], tf.float64).numpy()))


# ---------------------------------------------------------------------- 9. bad input


def _expect(exc, fn, *needles):
  with pytest.raises(exc) as info:
    fn()
  msg = str(info.value)
  for needle in needles:
    assert needle in msg, f"{needle!r} not in {msg!r}"
  return msg


def test_int_grad_raises_type_error():
  residue = tf.Variable(tf.ones([4]))
  _expect(TypeError, lambda: adacomp_compress(tf.constant([1, 2, 3, 4]), residue, 2),
          "grad", "int32")
  np.testing.assert_array_equal(residue.numpy(), np.ones(4, np.float32))


def test_int_residue_raises_type_error():
  _expect(TypeError, lambda: adacomp_compress(tf.ones([4]), tf.constant([1, 2, 3, 4]), 2),
          "residue", "int32")


@pytest.mark.parametrize("bad,text", [(0, "bin_size=0"), (-3, "bin_size=-3"),
                                      (2.5, "bin_size=2.5"), (True, "bin_size=True")])
def test_bad_bin_size(bad, text):
  residue = tf.Variable(tf.fill([4], 0.5))
  _expect(ValueError, lambda: adacomp_compress(tf.ones([4]), residue, bad), "bin_size", text)
  np.testing.assert_array_equal(residue.numpy(), np.full(4, 0.5, np.float32))


@pytest.mark.parametrize("bad,text", [(0, "max_density=0"), (1.5, "max_density=1.5"),
                                      (-0.1, "max_density=-0.1")])
def test_bad_max_density(bad, text):
  residue = tf.Variable(tf.fill([4], 0.5))
  _expect(ValueError, lambda: adacomp_compress(tf.ones([4]), residue, 2, bad),
          "max_density", text)
  np.testing.assert_array_equal(residue.numpy(), np.full(4, 0.5, np.float32))


def test_residue_shape_mismatch():
  residue = tf.Variable(tf.fill([2, 2], 0.5))
  _expect(ValueError, lambda: adacomp_compress(tf.ones([4]), residue, 2), "residue", "(2, 2)")
  np.testing.assert_array_equal(residue.numpy(), np.full([2, 2], 0.5, np.float32))


def test_decompress_int_dtype():
  payload, _ = adacomp_compress(tf.ones([4]), tf.zeros([4]), 2)
  _expect(TypeError, lambda: adacomp_decompress(payload, [4], tf.int32), "dtype", "dtype=int32")


def test_decompress_float_payload():
  _expect(TypeError, lambda: adacomp_decompress(tf.zeros([5], tf.float32), [4]),
          "payload", "float32")


def test_nbytes_float_payload():
  _expect(TypeError, lambda: payload_nbytes(tf.zeros([5], tf.float32)), "payload", "float32")


def test_decode_payload_of_other_shape_is_nan():
  """A payload whose bits word does not match the decode shape decodes to NaN."""
  payload, _ = adacomp_compress(tf.ones([1000]), tf.zeros([1000]), 50)
  assert np.all(np.isnan(adacomp_decompress(payload, [50]).numpy()))


def test_decompress_short_payload():
  _expect(ValueError, lambda: adacomp_decompress(tf.zeros([2], tf.int32), [4]), "payload")


# ------------------------------------------------------------- encoder slot tiers


@pytest.mark.parametrize("max_density", [1.0, pytest.param(0.25, marks=pytest.mark.slow)])
@pytest.mark.parametrize("residue_scale,expect_small_tier", [(20.0, True), (0.0, False)])
def test_sparse_and_dense_selections_use_either_encoder_tier(
    max_density, residue_scale, expect_small_tier):
  """A built-up residue selects < 1/16 of the elements (the small encoder tier); a
  first step (zero residue) selects more (the full-capacity tier). Both match NumPy."""
  rng = np.random.default_rng(7)
  grad = rng.standard_normal(20000).astype(np.float32)
  residue = (residue_scale * rng.standard_normal(20000)).astype(np.float32)
  payload, _, _, _ = check_against_reference(grad, residue, 50, max_density)
  assert (int(payload[0]) <= 20000 / 16) == expect_small_tier


# ------------------------------------------------------------- decoder tiers


def _payload_with_count(count, n, cap, rng, scale=0.75):
  """A tensor-scale payload of ``count`` distinct random codes, its unused words filled
  with random bits (which decoding must ignore), and its ``(position, negative)`` pairs."""
  bits = ref.code_bits(n)
  positions = rng.choice(n, count, replace=False).astype(np.uint64)
  negative = rng.random(count) < 0.5
  body = ref.pack_codes((positions << np.uint64(1)) | negative.astype(np.uint64), bits)
  words = ref.HEADER_WORDS + (cap * bits + 31) // 32
  payload = rng.integers(-2**31, 2**31, words, dtype=np.int64).astype(np.int32)
  payload[:3] = [count, np.float32(scale).view(np.int32), bits]
  payload[3:3 + len(body)] = body.view(np.int32)
  return payload, {(int(p), bool(g)) for p, g in zip(positions, negative)}


def test_decoding_reads_only_the_counted_codes_in_every_decoder_chunk():
  # n = 20,000, capacity 5,000: the decoder's loop adds chunks of DECODE_CHUNK (2,048)
  # codes, three for a full payload. Counts on each side of each chunk boundary decode
  # exactly what the NumPy reference does, and the random words after the count (and
  # after the capacity, in the last chunk) never reach the result.
  assert adacomp_core.DECODE_CHUNK == 2048
  n, cap = 20000, 5000
  rng = np.random.default_rng(11)
  rows, expected = [], np.zeros([n], np.float32)
  for count in (0, 1, 2047, 2048, 2049, 4095, 4096, 4097, 4999, 5000):
    payload, pairs = _payload_with_count(count, n, cap, rng)
    got = adacomp_decompress(tf.constant(payload), [n], tf.float32).numpy()
    np.testing.assert_array_equal(got, ref.dense_from_pairs(pairs, np.float32(0.75), n))
    if count in (1, 2049, 4097):
      rows.append(payload)
      expected += ref.dense_from_pairs(pairs, np.float32(0.75), n)
  # Gathered rows, each ending in another chunk, add up in row order.
  summed = adacomp_decompress(tf.constant(np.stack(rows)), [n], tf.float32).numpy()
  np.testing.assert_array_equal(summed, expected)


@hypothesis.settings(max_examples=tiers.examples(60), deadline=None)
@hypothesis.given(
    counts=st.lists(st.integers(0, 750), min_size=1, max_size=3),
    scale=st.sampled_from([1e-40, 1e-3, 0.75, 3.0e38]),  # subnormal to near float32's max
    seed=st.integers(0, 2**32 - 1))
def test_decoding_any_counts_matches_the_reference(counts, scale, seed):
  # One static shape (n 3,000, capacity 750: one decoder chunk) so that the kernel
  # compiles once per number of rows; counts, positions, signs, scales and the bits
  # after the count are drawn.
  n, cap = 3000, 750
  rng = np.random.default_rng(seed)
  built = [_payload_with_count(c, n, cap, rng, scale) for c in counts]
  expected = np.zeros([n], np.float32)
  with np.errstate(over="ignore"):  # 3e38 + 3e38 is inf in the kernel too
    for _, pairs in built:
      expected = expected + ref.dense_from_pairs(pairs, np.float32(scale), n)
  # XLA:CPU computes with subnormals flushed to zero: a subnormal scale decodes as 0
  # (every decoder so far has done the same).
  expected[np.abs(expected) < np.finfo(np.float32).tiny] = 0
  got = adacomp_decompress(tf.constant(np.stack([p for p, _ in built])), [n], tf.float32)
  np.testing.assert_array_equal(got.numpy(), expected)


# ----------------------------------------------------- 10. scale="bin": per-bin scales


def check_per_bin_against_reference(grad_np, residue_np, bin_size, max_density=1.0,
                                    truncated=False):
  """scale="bin" through the kernel, checked exactly against the NumPy reference (and,
  with ``truncated``, that the payload cut to its counted bytes decodes the same)."""
  n, shape = grad_np.size, grad_np.shape
  payload, new_residue = adacomp_compress(tf.constant(grad_np), tf.constant(residue_np),
                                          bin_size, max_density, scale="bin")
  width = ref.payload_words_per_bin(n, bin_size, max_density)
  assert payload.dtype == tf.int32 and payload.shape == [width]
  assert payload_words(n, max_density, "bin", bin_size) == width
  assert new_residue.dtype == tf.as_dtype(residue_np.dtype)
  p = payload.numpy()
  r = ref.reference_compress_per_bin(grad_np, residue_np, bin_size, max_density)
  dec = ref.unpack_payload_per_bin(p, n, bin_size)

  assert dec.bits_word == r.bits | ref.BIN_SCALE_FLAG
  assert dec.bins == ref.bins_for(n, bin_size)
  assert dec.marker == 0.0
  assert dec.count == r.count
  np.testing.assert_array_equal(dec.scales, r.scales)  # bfloat16 maxima, bit for bit
  assert len(set(dec.positions)) == dec.count
  assert dec.pairs == r.pairs(), (
      f"missing={sorted(r.pairs() - dec.pairs)[:10]} extra={sorted(dec.pairs - r.pairs())[:10]}")
  got, want = new_residue.numpy(), r.new_residue
  if residue_np.dtype != np.float64:
    got, want = as_f32(got), as_f32(want)
  np.testing.assert_array_equal(got, want)  # exactly G - Q

  nb = payload_nbytes(payload)
  assert int(nb) == ref.nbytes_for_per_bin(r.count, n, bin_size)

  out_dtype = decode_dtype_for(grad_np, residue_np)
  dense = adacomp_decompress(payload, shape, out_dtype, scale="bin", bin_size=bin_size)
  assert dense.dtype == out_dtype and tuple(dense.shape) == tuple(shape)
  np.testing.assert_array_equal(dense.numpy().reshape(-1),
                                r.q.astype(out_dtype.as_numpy_dtype))
  np.testing.assert_array_equal(
      dense.numpy().reshape(-1),
      ref.dense_from_pairs_per_bin(dec.pairs, dec.scales, n, bin_size,
                                   out_dtype.as_numpy_dtype))
  if truncated:  # only the counted bytes matter
    short = adacomp_decompress(p[:int(nb) // 4], shape, out_dtype, scale="bin",
                               bin_size=bin_size)
    np.testing.assert_array_equal(short.numpy(), dense.numpy())
  return p, new_residue.numpy(), r


# Most cases share one shape and bin size, so that they share compiled kernels.
PER_BIN_SHAPE = [64, 33]  # 2,112 elements: 43 bins of 50, the last of 12


@pytest.mark.parametrize("shape,bin_size,grad_dtype,max_density", [
    (PER_BIN_SHAPE, 50, "float32", 1.0),
    # the cap holds some back (slow: per-bin scales under a cap are checked against the
    # reference in tests/ops/test_adacomp_bucket.py's
    # test_the_payload_matches_the_numpy_reference[bin], max_density 0.05, in the fast tier)
    tiers.slow([3, 3, 16, 32], 50, "float32", 0.05),
    # a short last bin, odd number of bins (slow: bfloat16 is test_matches_reference_dtypes's)
    tiers.slow([51], 50, "bfloat16", 1.0),
    pytest.param([7, 9], 1, "float16", 1.0,   # one element per bin
                 marks=pytest.mark.slow),
    pytest.param([3, 4, 5], 500, "float64", 1.0,  # one bin, float64 compute
                 marks=pytest.mark.slow),
    ([0], 7, "float32", 1.0),
], ids=str)
def test_per_bin_matches_reference(shape, bin_size, grad_dtype, max_density):
  rng = np.random.default_rng(2000 + bin_size + int(np.prod(shape)))
  grad = random_array(shape, NP_DTYPES[grad_dtype], rng)
  residue_dtype = np.float64 if grad_dtype == "float64" else np.float32
  residue = random_array(shape, residue_dtype, rng, scale=0.5)
  check_per_bin_against_reference(grad, residue, bin_size, max_density,
                                  truncated=shape == PER_BIN_SHAPE)


def test_per_bin_random_values():
  """A seeded sweep over magnitudes, zeros and residue sizes (a cheap stand-in for a
  property-based test, on one compiled kernel): every case matches the reference."""
  rng = np.random.default_rng(77)
  for _ in range(8):
    magnitude = 10.0 ** rng.uniform(-6, 3)
    grad = random_array(PER_BIN_SHAPE, np.float32, rng, scale=magnitude,
                        zero_fraction=rng.uniform(0, 0.9))
    residue = random_array(PER_BIN_SHAPE, np.float32, rng,
                           scale=magnitude * rng.uniform(0, 30))
    check_per_bin_against_reference(grad, residue, 50)


def test_per_bin_error_feedback_over_steps():
  rng = np.random.default_rng(43)
  shape = PER_BIN_SHAPE
  residue = np.zeros(shape, np.float32)
  for step in range(4):
    grad = random_array(shape, np.float32, rng, scale=0.1 * (step + 1))
    p, new_residue, r = check_per_bin_against_reference(grad, residue, 50)
    dense = adacomp_decompress(p, shape, scale="bin", bin_size=50).numpy()
    assert_invariant(dense, new_residue, grad, residue, float(r.scales.max()))
    residue = new_residue


def test_per_bin_scale_is_the_bin_maximum():
  """Each bin's scale is its own max |G|: the maximum element leaves no residue, and a
  bin of small values is sent at its own small scale (tensor-wide, it would get the
  mean of all the maxima)."""
  grad = np.array([4.0, -1.0, 2.0, 0.0,      # bin 0: max 4
                   0.01, -0.03, 0.02, 0.0],  # bin 1: max 0.03
                  np.float32)
  residue = np.zeros_like(grad)
  p, new_residue, r = check_per_bin_against_reference(grad, residue, 4)
  dec = ref.unpack_payload_per_bin(p, 8, 4)
  np.testing.assert_array_equal(dec.scales, np.array([4.0, 0.03], ml_bf16()).astype(np.float32))
  dense = adacomp_decompress(p, [8], scale="bin", bin_size=4).numpy()
  assert dense[0] == 4.0 and new_residue[0] == 0.0
  assert abs(dense[5]) == np.float32(np.array(0.03, ml_bf16()))  # not ~2.0
  # The same tensor with one scale: bin 1's elements overshoot by ~2 / 0.03 = 67x.
  _, tensor_residue = compress_np(grad, residue, 4)
  assert np.abs(tensor_residue.numpy()[4:]).max() > 30 * np.abs(new_residue[4:]).max()


def ml_bf16():
  return ref.BFLOAT16


def test_per_bin_residue_smaller_when_bins_differ_in_scale():
  """Rows 1000x apart in magnitude (LSTM gates, embedding rows): after a few steps the
  per-bin residue is far smaller than the tensor-scale one, at the same selection."""
  rng = np.random.default_rng(44)
  row_scale = np.repeat(10.0 ** np.array([-3.0, 0.0]), 32)[:, None]  # rows 0-31 small
  norms = {}
  for scale in ("tensor", "bin"):
    residue = tf.zeros(PER_BIN_SHAPE)
    for _ in range(5):
      grad = tf.constant((rng.standard_normal(PER_BIN_SHAPE) * row_scale).astype(np.float32))
      _, residue = adacomp_compress(grad, residue, 50, scale=scale)
    norms[scale] = float(tf.norm(residue[:31]))
  assert norms["bin"] * 10 < norms["tensor"], norms


def test_per_bin_gathered_decode_sums_rows_in_order():
  rng = np.random.default_rng(45)
  shape, n, bin_size = PER_BIN_SHAPE, 2112, 50
  payloads, qs = [], []
  for density in (0.05, 0.5, 1.0):
    grad = random_array(shape, np.float32, rng, zero_fraction=1.0 - density)
    residue = random_array(shape, np.float32, rng, scale=0.3)
    payload, _ = adacomp_compress(grad, residue, bin_size, scale="bin")
    nb = int(payload_nbytes(payload))
    payloads.append(payload.numpy()[:nb // 4])
    qs.append(ref.reference_compress_per_bin(grad, residue, bin_size).q.astype(np.float32))
  gathered = ref.pad_rows(payloads)
  assert len({len(row) for row in payloads}) == 3
  nbytes = payload_nbytes(tf.constant(gathered)).numpy()
  assert list(nbytes) == [4 * len(row) for row in payloads]
  out = adacomp_decompress(tf.constant(gathered), shape, scale="bin", bin_size=bin_size)
  want = ((np.zeros(n, np.float32) + qs[0]) + qs[1]) + qs[2]
  np.testing.assert_array_equal(out.numpy().reshape(-1), want)


# Slow: the kernels are XLA-compiled in every mode; test_eager_function_and_jit_agree
# checks the eager, graph and jit paths in the fast tier.
@pytest.mark.slow
def test_per_bin_eager_and_function_agree():
  rng = np.random.default_rng(46)
  grad = tf.constant(random_array(PER_BIN_SHAPE, np.float32, rng))
  residue = tf.constant(random_array(PER_BIN_SHAPE, np.float32, rng))

  def step(g, r):
    payload, new_residue = adacomp_compress(g, r, 50, scale="bin")
    return (payload, new_residue,
            adacomp_decompress(payload, PER_BIN_SHAPE, scale="bin", bin_size=50),
            payload_nbytes(payload))

  # (The kernels are XLA-compiled either way; an outer jit_compile is tested above for
  # the default scale and only costs compile time here.) Eager and graph mode call the
  # same compiled program, so their agreement alone would hold even for a wrong
  # program: the graph's results are also checked against the NumPy reference.
  eager, graph = step(grad, residue), tf.function(step)(grad, residue)
  for a, b in zip(eager, graph):
    np.testing.assert_array_equal(bits_of(a.numpy()), bits_of(b.numpy()))
  payload, new_residue, decoded, nbytes = (x.numpy() for x in graph)
  r = ref.reference_compress_per_bin(grad.numpy(), residue.numpy(), 50)
  dec = ref.unpack_payload_per_bin(payload, 2112, 50)
  assert dec.bits_word == r.bits | ref.BIN_SCALE_FLAG and dec.pairs == r.pairs()
  np.testing.assert_array_equal(dec.scales, r.scales)
  np.testing.assert_array_equal(new_residue, r.new_residue)
  np.testing.assert_array_equal(decoded.reshape(-1), r.q.astype(np.float32))
  assert int(nbytes) == ref.nbytes_for_per_bin(r.count, 2112, 50)


@pytest.mark.parametrize("kind", ["nan", "inf", "bfloat16_overflow"])
def test_per_bin_nonfinite_sends_nothing_and_keeps_the_residue(kind):
  rng = np.random.default_rng(47)
  grad = random_array([7, 9], np.float32, rng)
  residue = random_array([7, 9], np.float32, rng, scale=0.5)
  if kind == "nan":
    grad[3, 4] = np.nan
  elif kind == "inf":
    grad[0, 0] = -np.inf
  else:  # finite in float32, rounds up to inf in bfloat16
    grad[2, 2], residue[2, 2] = np.float32(3.4e38), 0.0
  payload, new_residue = adacomp_compress(grad, residue, 7, scale="bin")
  p = payload.numpy()
  assert p[0] == 0 and np.isnan(p[1:2].view(np.float32)[0])
  np.testing.assert_array_equal(bits_of(new_residue.numpy()), bits_of(residue))
  assert np.all(np.isnan(adacomp_decompress(payload, [7, 9], scale="bin", bin_size=7)))
  assert not ref.reference_compress_per_bin(grad, residue, 7).finite


def test_per_bin_and_tensor_payloads_do_not_decode_as_each_other():
  grad = np.linspace(-1, 1, 2112).astype(np.float32).reshape(PER_BIN_SHAPE)
  zero = np.zeros_like(grad)
  per_bin, _ = adacomp_compress(grad, zero, 50, scale="bin")
  tensor, _ = adacomp_compress(grad, zero, 50)
  width = payload_words(2112, 1.0, "bin", 50)
  as_bin = np.pad(tensor.numpy(), [0, max(width - int(tensor.shape[0]), 0)])[:width]
  assert np.all(np.isnan(adacomp_decompress(as_bin, PER_BIN_SHAPE, scale="bin", bin_size=50)))
  assert np.all(np.isnan(adacomp_decompress(per_bin, PER_BIN_SHAPE)))
  # Another bin size (another number of bins): NaN too.
  assert np.all(np.isnan(adacomp_decompress(per_bin, PER_BIN_SHAPE, scale="bin",
                                            bin_size=100)))


def test_tensor_scale_is_the_default_bit_for_bit():
  # The default and scale="tensor" make the same static settings, so they run one cached
  # compiled program: compared with each other they could not fail, whatever that
  # program did. Each is checked against the NumPy reference's tensor-scale format
  # instead: its bits word (no per-bin flag), its codes, its scale, its residue, and what
  # it decodes to with the default and with scale="tensor".
  rng = np.random.default_rng(48)
  shape, n = [64, 33], 2112
  grad = random_array(shape, np.float32, rng)
  residue = random_array(shape, np.float32, rng)
  r = ref.reference_compress(grad, residue, 50)
  assert payload_words(n, 1.0, "tensor") == payload_words(n) == ref.payload_words(n)
  for payload, new_residue in (adacomp_compress(grad, residue, 50),
                               adacomp_compress(grad, residue, 50, scale="tensor")):
    p = payload.numpy()
    assert p.shape == (ref.payload_words(n),)
    dec = ref.unpack_payload(p, n)
    assert dec.bits == r.bits and dec.count == r.count and dec.pairs == r.pairs()
    assert_scale_close(dec.scale, r.scale, len(r.gmax), np.float32)
    exact = ref.reference_compress(grad, residue, 50, scale=dec.scale)
    np.testing.assert_array_equal(new_residue.numpy(), exact.new_residue)
    want = ref.dense_from_pairs(dec.pairs, dec.scale, n).reshape(shape)
    np.testing.assert_array_equal(adacomp_decompress(payload, shape).numpy(), want)
    np.testing.assert_array_equal(adacomp_decompress(payload, shape, scale="tensor").numpy(),
                                  want)


@pytest.mark.parametrize("bad", ["row ", "BIN", "", None, 1])
def test_bad_scale_is_named(bad):
  residue = tf.Variable(tf.fill([4], 0.5))
  _expect(ValueError, lambda: adacomp_compress(tf.ones([4]), residue, 2, scale=bad),
          "scale", f"scale={bad!r}")
  np.testing.assert_array_equal(residue.numpy(), np.full(4, 0.5, np.float32))
  _expect(ValueError, lambda: adacomp_decompress(tf.zeros([8], tf.int32), [4], scale=bad),
          "scale", f"scale={bad!r}")
  _expect(ValueError, lambda: payload_words(4, 1.0, bad, 2), "scale", f"scale={bad!r}")


def test_per_bin_decode_needs_the_bin_size():
  _expect(ValueError, lambda: adacomp_decompress(tf.zeros([8], tf.int32), [4], scale="bin"),
          "bin_size", "bin_size=None")
