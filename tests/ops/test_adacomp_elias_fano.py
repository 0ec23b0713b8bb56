"""Positions as Elias-Fano codes (``positions="elias_fano"``,
docs/wire_format.md#positions-elias-fano): the width each payload chooses, its bytes,
and corrupt or hostile rows, against the independent NumPy reference
(numpy_reference.unpack_bucket and elias_fano_low_bits, written from the format's
description). That its buckets are bit-identical to the per-tensor kernels is
tests/ops/test_adacomp_bucket.py's, with the other positions."""

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

EF = "elias_fano"


def _compressed(shapes, residue_scale, positions, seed=0, bin_size=50, nonzero=None):
  """A bucket payload and its bytes; ``nonzero``: that many nonzero gradient elements,
  residues zero (about one code each)."""
  rng = np.random.default_rng(seed)
  grads = bucket_checks.random_arrays(shapes, rng)
  residues = bucket_checks.random_arrays(shapes, rng, scale=residue_scale)
  if nonzero is not None:
    for g, r in zip(grads, residues):
      g[rng.random(g.shape) >= nonzero / sum(x.size for x in grads)] = 0
      r[...] = 0
  payload, _ = adacomp_bucket.compress(grads, residues, bin_size, 0.25, positions=positions)
  sizes = [int(np.prod(s)) for s in shapes]
  nbytes = int(tf.reduce_sum(adacomp_bucket.tensor_nbytes(payload, sizes, bin_size, 0.25,
                                                          positions=positions)))
  return payload.numpy(), nbytes


SHAPES = [(3, 3, 8, 16), (300,)]


def test_each_payload_takes_the_width_of_fewest_words_and_never_more_than_bins():
  # From a few codes in the bucket to several per bin.
  sizes = [int(np.prod(s)) for s in SHAPES]
  widths = set()
  for nonzero in (2, 20, 200, None):
    payload, nbytes = _compressed(SHAPES, 0.3, EF, nonzero=nonzero)
    count, bits = int(payload[0]), int(payload[1]) & 0xFF
    low_bits = ref.elias_fano_low_bits(count, sizes, 50, 0.25)
    assert bits == low_bits + 1
    # docs/wire_format.md#positions-elias-fano: the header, the scales, then the body.
    assert nbytes == 4 * (4 + 2 + 2 + ref.elias_fano_words(count, low_bits, sum(sizes)))
    assert not payload[nbytes // 4:].any()  # the used words are all that is sent
    _, bin_nbytes = _compressed(SHAPES, 0.3, "bin", nonzero=nonzero)
    assert nbytes <= bin_nbytes, (nonzero, count, nbytes, bin_nbytes)
    widths.add(bits)
  assert len(widths) >= 3, widths  # the width follows the count


def _payload():
  return _compressed(SHAPES, 0.3, EF)[0]


def _decode(payload, rows=1):
  return adacomp_bucket.decompress(np.stack([payload] * rows), SHAPES, tf.float32, 50, 0.25,
                                   positions=EF)


@pytest.mark.parametrize("change", ["width 0", "width too wide", "width one less",
                                    "another flag", "a bucket's closing zero", "a code's one",
                                    "past the end"])
def test_a_row_whose_width_or_unary_counts_do_not_hold_its_codes_decodes_to_nan(change):
  payload = _payload()
  count, bits = int(payload[0]), int(payload[1]) & 0xFF
  universe = sum(int(np.prod(s)) for s in SHAPES)
  buckets = -(-universe // 2**(bits - 1))
  start = 32 * (8 + -(-count * bits // 32))
  stream = np.unpackbits(payload.view(np.uint8), bitorder="little")
  unary = stream[start:start + buckets + count]
  assert unary.sum() == count and unary[-1] == 0  # as the encoder wrote them
  corrupt = payload.copy()
  if change.startswith("width"):
    new_bits = {"width 0": 0, "width too wide": adacomp_core.index_bits(universe) + 2,
                "width one less": bits - 1}[change]
    corrupt[1] = (int(payload[1]) & ~0xFF) | new_bits
  elif change == "another flag":
    corrupt[1] = int(payload[1]) | adacomp_bucket.BIN_POSITIONS_FLAG
  else:
    bit = start + {"a bucket's closing zero": int(np.argmin(unary)),
                   "a code's one": int(np.argmax(unary)),
                   "past the end": buckets + count}[change]
    stream[bit] ^= 1
    corrupt = np.packbits(stream, bitorder="little").view(np.int32)
  for got, want in zip(_decode(corrupt), _decode(payload)):
    if change == "past the end":  # not read: the row still decodes
      np.testing.assert_array_equal(got.numpy(), want.numpy())
    else:
      assert np.isnan(got.numpy()).all(), change


@hypothesis.settings(max_examples=tiers.examples(20), deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), keep_header=st.booleans())
def test_random_codes_never_crash_and_decode_as_the_reference_reads_them(seed, keep_header):
  # The header and the counts are the encoder's, the codes' words random: each tensor
  # decodes to the codes the reference places in it, and nothing else. Without the
  # header, anything decodes to the right shapes.
  payload = _payload()
  rng = np.random.default_rng(seed)
  count, bits = int(payload[0]), int(payload[1]) & 0xFF
  code_words = -(-count * bits // 32)
  start = 8 if keep_header else 0
  payload[start:8 + code_words] = rng.integers(-2**31, 2**31, 8 + code_words - start,
                                               dtype=np.int64)
  decoded = _decode(payload)
  assert [d.shape for d in decoded] == [tuple(s) for s in SHAPES]
  if not keep_header:
    return
  sizes = [int(np.prod(s)) for s in SHAPES]
  stream = np.unpackbits(payload[8:].view(np.uint8), bitorder="little")
  buckets = ref.unary_bins(stream[32 * code_words:], count, -(-sum(sizes) // 2**(bits - 1)))
  counts, scales = payload[4:6], payload[6:8].view(np.float32)
  want = [np.zeros(n, np.float64) for n in sizes]
  for j in range(count):
    code = int((stream[j * bits:(j + 1) * bits].astype(np.int64) << np.arange(bits)).sum())
    t = 0 if j < counts[0] else 1
    place = buckets[j] * 2**(bits - 1) + (code >> 1) - (0 if t == 0 else sizes[0])
    if 0 <= place < sizes[t]:  # a place in another tensor is dropped
      want[t][place] += -scales[t] if code & 1 else scales[t]
  for got, w in zip(decoded, want):
    np.testing.assert_allclose(got.numpy().reshape(-1), w, rtol=1e-5, atol=0)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts Linux mappings")
def test_new_counts_and_widths_decode_without_compiling_again():
  # The width is read from the row: a program per width (or per count) would fill
  # the process's memory mappings (test_adacomp_bucket's test of counts says why).
  payloads = [_compressed(SHAPES, float(s), EF, seed=i)[0]
              for i, s in enumerate(np.geomspace(1e-3, 30.0, 14))]
  assert len({int(p[1]) & 0xFF for p in payloads}) >= 3
  for payload in payloads[:2]:
    _decode(payload, rows=2)
  with open("/proc/self/maps") as f:
    before = sum(1 for _ in f)
  for payload in payloads[2:]:
    _decode(payload, rows=2)
  with open("/proc/self/maps") as f:
    after = sum(1 for _ in f)
  assert after - before < 40, (before, after)


def test_a_code_counted_for_one_tensor_at_a_place_in_another_is_dropped():
  # Tensor 1's first code, counted as tensor 0's last: its place is in tensor 1, so
  # neither tensor takes it (a tensor takes only codes at its own places).
  payload = _payload()
  counts = payload[4:6].copy()
  assert 0 < counts[0] < adacomp_core.capacity(1152, 0.25) and counts[1] > 0
  moved = payload.copy()
  moved[4:6] = [counts[0] + 1, counts[1] - 1]
  intact = [d.numpy().reshape(-1) for d in _decode(payload)]
  got = [d.numpy().reshape(-1) for d in _decode(moved)]
  np.testing.assert_array_equal(got[0], intact[0])
  first = np.flatnonzero(intact[1])[0]  # tensor 1's codes come in increasing positions
  want = intact[1].copy()
  want[first] = 0
  np.testing.assert_array_equal(got[1], want)
