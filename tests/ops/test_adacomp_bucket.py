"""Tests of the bucket kernels (tf_adacomp.ops.adacomp_bucket): several tensors in one XLA
call and one payload, bit-identical to the per-tensor kernels, and checked against the
independent NumPy reference (numpy_reference.py: the per-tensor algorithm and its own
bucket unpacker written from docs/wire_format.md#buckets)."""

import os

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest
import tensorflow as tf

import bucket_checks
import numpy_reference as ref
from tf_adacomp.ops import adacomp_bucket
from tf_adacomp.ops import adacomp_core
import tiers


# ------------------------------------------------------- 1. bit-identical to per tensor


# The fast tier keeps one bucket (per-bin scales: test_the_payload_matches_the_numpy_
# reference); the others (and the hypothesis search below) run in the whole suite.
@pytest.mark.parametrize("bucket,max_density,scale,positions", [
    pytest.param(bucket_checks.MLP_LIKE, 0.25, "tensor", "tensor", marks=pytest.mark.slow),
    pytest.param(bucket_checks.MLP_LIKE, 0.25, "tensor", "bin", marks=pytest.mark.slow),
    pytest.param(bucket_checks.MLP_LIKE, 1.0, "bin", "tensor", marks=pytest.mark.slow),
    (bucket_checks.CONV_LIKE, 0.01, "tensor", "tensor"), (bucket_checks.CONV_LIKE, 0.25, "tensor", "bin"),
    pytest.param(bucket_checks.CONV_LIKE, 0.25, "bin", "tensor", marks=pytest.mark.slow),
    pytest.param(bucket_checks.CONV_LIKE, 0.25, "bin", "bin", marks=pytest.mark.slow),
    pytest.param(bucket_checks.EVERY_ELEMENT, 1.0, "tensor", "tensor", marks=pytest.mark.slow),
    pytest.param(bucket_checks.EVERY_ELEMENT, 1.0, "bin", "bin", marks=pytest.mark.slow),
    (bucket_checks.CONV_LIKE, 0.25, "tensor", "elias_fano"),
    pytest.param(bucket_checks.MLP_LIKE, 0.25, "tensor", "elias_fano", marks=pytest.mark.slow),
    pytest.param(bucket_checks.MLP_LIKE, 1.0, "bin", "elias_fano", marks=pytest.mark.slow),
    pytest.param(bucket_checks.CONV_LIKE, 0.01, "bin", "elias_fano", marks=pytest.mark.slow),
    pytest.param(bucket_checks.EVERY_ELEMENT, 1.0, "tensor", "elias_fano",
                 marks=pytest.mark.slow)])
def test_a_bucket_is_bit_identical_to_per_tensor_kernels(bucket, max_density, scale,
                                                         positions):
  # Short last bins, tensors smaller than a word, and capacities that overflow; with
  # positions="bin" or "elias_fano" the same values (the per-tensor kernels send
  # positions in tensors).
  shapes, bin_size = bucket
  _, _, payload = bucket_checks.check_bit_identical(shapes, bin_size, max_density, scale,
                                                    seed=len(shapes), positions=positions)
  if bucket is bucket_checks.EVERY_ELEMENT:  # three chunks
    assert int(payload[0]) > 2 * adacomp_core.DECODE_CHUNK


# Sizes from a few values (each new layout compiles two kernels): around a word, a bin
# and capacities of one code.
@pytest.mark.slow
@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(
    sizes=st.lists(st.sampled_from([1, 3, 31, 33, 64, 501, 700]), min_size=1, max_size=4),
    bin_size=st.sampled_from([1, 7, 32, 50, 500]),
    max_density=st.sampled_from([1.0, 0.25, 0.02]),
    scale=st.sampled_from(["tensor", "bin"]),
    positions=st.sampled_from(["tensor", "bin", "elias_fano"]),
    seed=st.integers(0, 2**31 - 1))
def test_any_bucket_is_bit_identical_to_per_tensor_kernels(sizes, bin_size, max_density,
                                                             scale, positions, seed):
  bucket_checks.check_bit_identical([(n,) for n in sizes], bin_size, max_density, scale, seed,
                       positions=positions)


@pytest.mark.slow  # float64 decoding: also tests/ops/test_adacomp.py's float64 reference cases
def test_float64_buckets_are_bit_identical_too():
  bucket_checks.check_bit_identical([(40, 30), (30,)], 50, 0.25, "tensor", 3, dtype=np.float64)


# bucket_checks.CONV_LIKE's layouts, as test_a_bucket_is_bit_identical_to_per_tensor_kernels runs them
# (its fast case for "tensor"): the process has compiled their kernels already.
@pytest.mark.parametrize("scale,max_density", [
    ("tensor", 0.01), pytest.param("bin", 0.25, marks=pytest.mark.slow)], ids=["tensor", "bin"])
def test_one_non_finite_tensor_keeps_its_residue_and_decodes_to_nan_alone(scale, max_density):
  shapes, bin_size = bucket_checks.CONV_LIKE
  grads, residues, payload = bucket_checks.check_bit_identical(
      shapes, bin_size, max_density, scale, 4, nan_at=1)
  _, new = adacomp_bucket.compress(grads, residues, bin_size, max_density, scale)
  np.testing.assert_array_equal(new[1].numpy(), residues[1])  # kept as it was
  assert int(payload[4 + 1]) == -1  # tensor 1's count marks it
  decoded = adacomp_bucket.decompress(payload, shapes, tf.float32, bin_size, max_density,
                                      scale)
  assert np.isnan(decoded[1].numpy()).all()
  for t in (0, 2, 3):
    assert np.isfinite(decoded[t].numpy()).all()
  assert np.count_nonzero(decoded[0].numpy()) > 0  # the others were sent


# ------------------------------------------------------ 2. against the NumPy reference


@pytest.mark.parametrize("scale,positions", [
    ("tensor", "tensor"), ("bin", "tensor"), ("tensor", "bin"),
    pytest.param("bin", "bin", marks=pytest.mark.slow)])
def test_the_payload_matches_the_numpy_reference(scale, positions):
  rng = np.random.default_rng(5)
  shapes = [(30, 40), (40,), (40, 10), (10,)]
  grads, residues = bucket_checks.random_arrays(shapes, rng), bucket_checks.random_arrays(shapes, rng, scale=0.3)
  payload, new = adacomp_bucket.compress(grads, residues, 50, 0.05, scale, positions)
  bucket_checks.check_reference(payload, new, grads, residues, 50, 0.05, scale, positions)


def test_tensor_nbytes_add_up_to_the_used_words():
  rng = np.random.default_rng(6)
  # test_the_payload_matches_the_numpy_reference's layouts (both scales): the process has
  # compiled their kernels already.
  shapes = [(30, 40), (40,), (40, 10), (10,)]
  sizes = [int(np.prod(s)) for s in shapes]
  grads, residues = bucket_checks.random_arrays(shapes, rng), bucket_checks.random_arrays(shapes, rng)
  for scale, positions in (("tensor", "tensor"), ("bin", "tensor"), ("tensor", "bin")):
    payload, _ = adacomp_bucket.compress(grads, residues, 50, 0.05, scale, positions)
    shares = adacomp_bucket.tensor_nbytes(payload, sizes, 50, 0.05, scale,
                                          positions).numpy()
    count = int(payload[0])
    # docs/wire_format.md#buckets: 4 * (4 + T + S + ceil(count * bits / 32)), S = T
    # tensor scales or the bins' bfloat16 scales two per word; bits for the largest;
    # #positions-in-bins: bits for a bin, and ceil((bins + count) / 32) unary words.
    tensors = len(sizes)
    bins = sum(ref.bins_for(n, 50) for n in sizes)
    scale_words = tensors if scale == "tensor" else -(-bins // 2)
    if positions == "bin":
      body = -(-count * ref.code_bits(50) // 32) + -(-(bins + count) // 32)
    else:
      body = -(-count * ref.code_bits(max(sizes)) // 32)
    assert shares.sum() == 4 * (4 + tensors + scale_words + body)
    assert (shares > 0).all()
    # The used words are all that a receiver needs: the rest of the payload is zeros.
    assert not payload.numpy()[shares.sum() // 4:].any()


# -------------------------------------------------- 3. corrupt payloads and bad input


def _bucket_payload(positions="tensor"):
  rng = np.random.default_rng(7)
  shapes = [(300,), (40, 5)]
  payload, _ = adacomp_bucket.compress(bucket_checks.random_arrays(shapes, rng), bucket_checks.random_arrays(shapes, rng), 50, 0.25,
                                       positions=positions)
  return payload.numpy(), shapes


@pytest.mark.parametrize("word,value", [(0, -1), (0, 10**6), (1, 7), (2, 3), (3, 9), (4, 10**6)])
def test_a_payload_that_does_not_match_its_layout_decodes_to_nan_everywhere(word, value):
  payload, shapes = _bucket_payload()
  payload[word] = value
  for decoded in adacomp_bucket.decompress(payload, shapes, tf.float32, 50, 0.25):
    assert np.isnan(decoded.numpy()).all()


@hypothesis.settings(max_examples=tiers.examples(40), deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), keep_header=st.booleans())
def test_random_words_never_crash_and_never_write_outside_their_tensors(seed, keep_header):
  payload, shapes = _bucket_payload()
  rng = np.random.default_rng(seed)
  start = 4 + 2 + 2 if keep_header else 0
  payload[start:] = rng.integers(-2**31, 2**31, payload.size - start, dtype=np.int64)
  decoded = adacomp_bucket.decompress(payload, shapes, tf.float32, 50, 0.25)
  assert [d.shape for d in decoded] == [tuple(s) for s in shapes]
  if keep_header:
    # The header is the encoder's (counts within the capacities, finite scales): each
    # tensor decodes to its own codes at positions inside it, and nothing else.
    sizes, caps, bits = [300, 200], [75, 50], ref.code_bits(300)
    counts, scales = payload[4:6], payload[6:8].view(np.float32)
    stream = np.unpackbits(payload[8:].astype("<i4").view(np.uint8), bitorder="little")
    codes = [int((stream[j * bits:(j + 1) * bits].astype(np.int64) << np.arange(bits)).sum())
             for j in range(int(payload[0]))]
    start = 0
    for t, (got, n) in enumerate(zip(decoded, sizes)):
      want = np.zeros(n, np.float64)
      for code in codes[start:start + min(int(counts[t]), caps[t])]:
        if code >> 1 < n:
          want[code >> 1] += -scales[t] if code & 1 else scales[t]
      start += int(counts[t])
      # Repeated positions add in an order that is not part of the contract.
      np.testing.assert_allclose(got.numpy().reshape(-1), want, rtol=1e-5, atol=0)


def _unary_start(payload):
  """Stream bit where a positions="bin" payload of _bucket_payload's layout (two tensors,
  tensor scales) has its unary counts."""
  return 32 * (8 + -(-int(payload[0]) * ref.code_bits(50) // 32))


@pytest.mark.parametrize("flip", ["a bin's closing zero", "a code's one", "past the end"])
def test_unary_counts_that_do_not_hold_the_codes_decode_to_nan(flip):
  payload, shapes = _bucket_payload("bin")
  bins, count = 6 + 4, int(payload[0])
  stream = np.unpackbits(payload.view(np.uint8), bitorder="little")
  start = _unary_start(payload)
  unary = stream[start:start + bins + count]
  assert unary.sum() == count and unary[-1] == 0  # as the encoder wrote them
  # Which stream bit to flip: the first 0 or 1 of the counts, or the bit after them
  # (not read: the row still decodes).
  bit = start + {"a bin's closing zero": int(np.argmin(unary)),
                 "a code's one": int(np.argmax(unary)),
                 "past the end": bins + count}[flip]
  stream[bit] ^= 1
  corrupt = np.packbits(stream, bitorder="little").view(np.int32)
  decoded = adacomp_bucket.decompress(corrupt, shapes, tf.float32, 50, 0.25, positions="bin")
  intact = adacomp_bucket.decompress(payload, shapes, tf.float32, 50, 0.25, positions="bin")
  for got, want in zip(decoded, intact):
    if flip == "past the end":
      np.testing.assert_array_equal(got.numpy(), want.numpy())
    else:
      assert np.isnan(got.numpy()).all()


@hypothesis.settings(max_examples=tiers.examples(20), deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_random_codes_in_bins_never_crash_and_decode_as_the_reference_reads_them(seed):
  # The header and the counts are the encoder's; the codes' words are random: each
  # tensor decodes to the codes the reference finds in its own bins, at offsets inside
  # them, and nothing else.
  payload, shapes = _bucket_payload("bin")
  rng = np.random.default_rng(seed)
  count, bits, sizes = int(payload[0]), ref.code_bits(50), [300, 200]
  code_words = -(-count * bits // 32)
  payload[8:8 + code_words] = rng.integers(-2**31, 2**31, code_words, dtype=np.int64)
  decoded = adacomp_bucket.decompress(payload, shapes, tf.float32, 50, 0.25, positions="bin")
  stream = np.unpackbits(payload[8:].view(np.uint8), bitorder="little")
  code_bin = ref.unary_bins(stream[32 * code_words:], count, 6 + 4)
  counts, scales = payload[4:6], payload[6:8].view(np.float32)
  want = [np.zeros(n, np.float64) for n in sizes]
  first_bin = [0, 6]
  for j in range(count):
    code = int((stream[j * bits:(j + 1) * bits].astype(np.int64) << np.arange(bits)).sum())
    t = 0 if j < counts[0] else 1
    pos = (code_bin[j] - first_bin[t]) * 50 + (code >> 1)
    if code >> 1 < 50 and pos < sizes[t]:
      want[t][pos] += -scales[t] if code & 1 else scales[t]
  for got, w in zip(decoded, want):
    np.testing.assert_allclose(got.numpy().reshape(-1), w, rtol=1e-5, atol=0)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts Linux mappings")
def test_a_payload_of_a_new_count_decodes_without_compiling_again():
  # XLA takes some ops' operands (tf.slice's start) as compile-time constants: one that
  # followed the count compiled a program per count, whose memory mappings XLA:CPU keeps
  # until the process ends (tests/conftest.py), and ResNet-20 training crashed at the
  # mapping limit after a few hundred steps.
  shapes = [(3, 3, 8, 16), (300,)]
  rng = np.random.default_rng(11)
  payloads = []
  for scale in np.geomspace(1e-3, 1.0, 14):  # new counts, mostly in the smallest tier
    grads = bucket_checks.random_arrays(shapes, rng, scale=1.0)
    residues = bucket_checks.random_arrays(shapes, rng, scale=float(scale))
    payloads.append(adacomp_bucket.compress(grads, residues, 50, 0.25, positions="bin")[0])
  assert len({int(p[0]) for p in payloads}) >= 10

  def decode(payload):
    return adacomp_bucket.decompress(tf.stack([payload] * 2), shapes, tf.float32, 50, 0.25,
                                     positions="bin")[0].numpy()

  for payload in payloads[:2]:
    decode(payload)
  with open("/proc/self/maps") as f:
    before = sum(1 for _ in f)
  for payload in payloads[2:]:
    decode(payload)
  with open("/proc/self/maps") as f:
    after = sum(1 for _ in f)
  assert after - before < 40, (before, after)


def test_bad_arguments_are_refused_naming_them():
  x = tf.zeros([10])
  with pytest.raises(ValueError, match="grads"):
    adacomp_bucket.compress([], [], 50)
  with pytest.raises(ValueError, match="residues"):
    adacomp_bucket.compress([x, x], [x], 50)
  with pytest.raises(ValueError, match="share one dtype"):
    adacomp_bucket.compress([x, tf.zeros([3], tf.float64)], [x, tf.zeros([3])], 50)
  with pytest.raises(ValueError, match="grads\\[1\\]"):
    adacomp_bucket.compress([x, tf.zeros([3])], [x, tf.zeros([4])], 50)
  with pytest.raises(ValueError, match="bin_size"):
    adacomp_bucket.compress([x], [x], 0)
  with pytest.raises(ValueError, match="max_density"):
    adacomp_bucket.compress([x], [x], 5, max_density=2.0)
  with pytest.raises(ValueError, match="positions='bins'"):
    adacomp_bucket.compress([x], [x], 5, positions="bins")
  with pytest.raises(ValueError, match="payload"):
    adacomp_bucket.decompress(tf.zeros([3], tf.int32), [[10]], tf.float32, 5)
  with pytest.raises(ValueError, match="shapes"):
    adacomp_bucket.decompress(tf.zeros([3], tf.int32), [], tf.float32, 5)
