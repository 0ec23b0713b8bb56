"""Decoding corrupt and hostile payloads (issue 16, item 3): every decoder that takes a wire
payload, fed random and adversarial int32 words, never crashes, returns the tensor's
shape and dtype, and either marks the result the documented way (NaN everywhere; for a
payload that carries float values, TopK's, a non-finite value where it lands) or writes
only what the payload's valid codes say, only at positions inside the tensor.

Each decode is checked against a NumPy reading of the same words (written here from
docs/wire_format.md and docs/fft.md, sharing no code with tf_adacomp): a position that no
valid code names must stay exactly 0, a position one code names holds exactly that code's
value, and a position several codes name is bounded by their sum (hostile codes repeat
positions, and the order in which the decoder adds them is not part of the contract).

Every distinct static shape, dtype and payload width compiles a new XLA program, and
XLA:CPU keeps its memory mappings for the life of the process (see tests/conftest.py):
the shapes below are few and fixed, and hypothesis varies the words, not the shapes.
"""

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest
import tensorflow as tf

import numpy_reference as ref
from tf_adacomp.ops import adacomp
from tf_adacomp.ops import adacomp_bucket
from tf_adacomp.ops import adacomp_core
from tf_adacomp.ops import fft as fft_ops
from tf_adacomp.ops import topk as topk_ops
import tiers

# Hostile words hold signalling NaNs: NumPy warns when it widens them (they stay NaN).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast")

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)

# Decoder settings, one static payload width each.
# 1,000 elements: 11-bit codes (positions up to 1,023, so beyond the tensor) and 2 spare
# bits after the 250 codes of the capacity; 7 elements: 4-bit codes, position 7 beyond.
ADACOMP_DENSITY = {(40, 25): 0.25, (7,): 1.0}
BIN_SIZE = 50
# Rank-2 payloads shorter than a full one: 6 words of codes after the header.
TRUNCATED_CODE_WORDS = 6
ROWS = 3
BUCKET_SHAPES = [(300,), (40, 5)]
BUCKET_BIN_SIZE, BUCKET_DENSITY = 50, 0.25
TOPK_SHAPE, TOPK_DENSITY = (40, 25), 0.1
FFT_SHAPE, FFT_THETA, FFT_E, FFT_M = (40, 25), 0.9, 4, 3

# What a hostile row holds: a well-formed header and random codes ("valid"); codes whose
# positions are mostly beyond the tensor; a count above the capacity, or negative; a bits
# (format, flags) word other than the decoder's; a NaN or infinite scale (TopK: values;
# FFT: an out-of-range top exponent); random words, header included.
KINDS = ["valid", "positions_beyond", "count_above_cap", "negative_count", "bits",
         "nonfinite_scale", "random"]

SETTINGS = dict(max_examples=tiers.examples(50), deadline=None,
                suppress_health_check=[hypothesis.HealthCheck.too_slow])


# ---------------------------------------------------------------------------- helpers


def _random_words(rng, size):
  return rng.integers(-2**31, 2**31, size, dtype=np.int64).astype(np.int32)


def _f32_word(value):
  return int(np.float32(value).view(np.int32))


def _scale_word(rng):
  """A finite float32 scale as a hostile sender might pick it: negative, subnormal, near
  float32's maximum, or any finite bit pattern."""
  choice = rng.integers(5)
  if choice == 0:
    return _f32_word(rng.choice([0.75, -2.5, 1e-3, 0.0]))
  if choice == 1:
    return _f32_word(rng.choice([1e-40, -3e-39]))  # subnormal
  if choice == 2:
    return _f32_word(rng.choice([3.0e38, -1.7e38]))
  while True:
    word = _random_words(rng, 1)
    if np.isfinite(word.view(np.float32)[0]):
      return int(word[0])


def _nonfinite_word(rng):
  """NaN (any payload, either sign) or +-inf, as float32 bits."""
  if rng.random() < 0.5:
    return _f32_word(rng.choice([np.inf, -np.inf]))
  nan = 0x7F800000 | int(rng.integers(1, 1 << 23))
  return int(np.uint32(nan | (int(rng.integers(2)) << 31)).view(np.int32))


def _bfloat16_bits(word):
  """The bfloat16 half (the high 16 bits) of a float32 word: still non-finite for a
  non-finite word."""
  return np.uint16((int(word) & 0xFFFFFFFF) >> 16)


def _codes_beyond(rng, count, n, bits):
  """Packed words of ``count`` codes whose positions are mostly >= n (at most
  2**(bits - 1) - 1, what a code can carry), a few inside the tensor."""
  top = 1 << (bits - 1)
  positions = np.where(rng.random(count) < 0.8, rng.integers(min(n, top - 1), top, count),
                       rng.integers(0, n, count)).astype(np.uint64)
  codes = positions << np.uint64(1) | rng.integers(0, 2, count).astype(np.uint64)
  return ref.pack_codes(codes, bits).view(np.int32)


def _read_codes(words, count, bits, start_bit=0):
  """``count`` codes of ``bits`` bits from a little-endian stream of int32 words (fewer if
  the words end first)."""
  stream = np.unpackbits(np.asarray(words, "<i4").view(np.uint8), bitorder="little")
  count = max(0, min(count, (stream.size - start_bit) // bits)) if bits else count
  if bits == 0:
    return np.zeros(count, np.int64)
  index = start_bit + np.arange(count)[:, None] * bits + np.arange(bits)
  return (stream[index].astype(np.int64) << np.arange(bits)).sum(1)


class Expected:
  """What a decoded tensor of ``n`` elements may hold: NaN everywhere (``flagged``), or
  the sum at each position of the values that valid codes put there."""

  def __init__(self, n):
    self.flagged = False
    self.hits = np.zeros(n, np.int64)
    self.first = np.zeros(n, np.float64)   # the value of a position's only code
    self.bound = np.zeros(n, np.float64)   # sum of |value| of a position's codes
    self.nonfinite = np.zeros(n, bool)     # a code put a non-finite value there

  def add(self, positions, values):
    """Adds codes; positions >= n are dropped, as every decoder documents."""
    positions, values = np.asarray(positions, np.int64), np.asarray(values, np.float64)
    inside = (positions >= 0) & (positions < self.hits.size)
    positions, values = positions[inside], values[inside]
    np.add.at(self.hits, positions, 1)
    self.first[positions] = values
    finite = np.isfinite(values)
    np.add.at(self.bound, positions[finite], np.abs(values[finite]))
    self.nonfinite[positions[~finite]] = True


def assert_decoded_safely(got, expected: Expected, shape, dtype=tf.float32):
  """The decoder's contract on any payload (see the module doc)."""
  assert got.dtype == dtype and tuple(got.shape) == tuple(shape)
  got = np.asarray(got.numpy(), np.float64).reshape(-1)
  if expected.flagged:
    assert np.isnan(got).all(), f"a bad payload must decode to NaN everywhere: {got[:8]}"
    return
  hits = expected.hits
  # Nothing is written where no valid code points: no clamped or wrapped position.
  untouched = np.nonzero((hits == 0) & (got != 0))[0]
  assert untouched.size == 0, (f"written where no valid code points: {untouched[:10]} "
                               f"{got[untouched[:10]]}")
  # One code: exactly its value (a subnormal one may be flushed to 0, as XLA:CPU does).
  once = hits == 1
  want = expected.first[once].astype(np.float32).astype(np.float64)
  ok = (got[once] == want) | (np.isnan(got[once]) & np.isnan(want))
  ok |= (np.abs(want) < F32_TINY) & (got[once] == 0)
  assert ok.all(), (np.nonzero(once)[0][~ok][:10], got[once][~ok][:10], want[~ok][:10])
  # Several codes: bounded by their magnitudes; non-finite only if a value was, or if
  # their sum can overflow float32.
  many = hits > 1
  may_overflow = expected.nonfinite | (expected.bound * (1 + 2**-20) > F32_MAX)
  finite_ok = np.isfinite(got) & (np.abs(got) <= expected.bound * (1 + 2**-20))
  bad = many & ~finite_ok & ~may_overflow
  assert not bad.any(), (np.nonzero(bad)[0][:10], got[bad][:10], expected.bound[bad][:10])


def _stack(rows):
  return np.stack(rows) if len(rows) > 1 else rows[0]


# -------------------------------------------------- AdaComp, scale="tensor" and "bin"


def _adacomp_layout(shape, scale, width=None):
  """(n, bits, header words, full width, decoder's capacity for ``width``)."""
  n = int(np.prod(shape))
  bits = adacomp.index_bits(n) + 1
  header = (adacomp.BIN_HEADER_WORDS + adacomp.scale_words(n, BIN_SIZE) if scale == "bin"
            else adacomp.HEADER_WORDS)
  full = adacomp.payload_words(n, ADACOMP_DENSITY[shape], scale, BIN_SIZE)
  width = full if width is None else width
  return n, bits, header, width, (width - header) * 32 // bits


def _adacomp_row(kind, rng, shape, scale, width):
  """One hostile row of ``width`` words for ``kind`` (see KINDS)."""
  n, bits, header, width, cap = _adacomp_layout(shape, scale, width)
  row = _random_words(rng, width)
  if kind == "random":
    return row
  bits_word = bits | (adacomp.BIN_SCALE_FLAG if scale == "bin" else 0)
  row[0] = rng.integers(0, cap + 1)
  if scale == "bin":
    bins = adacomp.num_bins(n, BIN_SIZE)
    row[1] = 0
    row[3] = bins
    halves = np.array([_scale_word(rng) for _ in range(2 * (header - 4))], np.int32)
    # bfloat16 scales: the high halves of float32 words, two per word, low half first.
    row[4:header] = (halves.view(np.uint32) >> 16).astype(np.uint16).view(np.int32)
  else:
    row[1] = _scale_word(rng)
  row[2] = bits_word
  if kind == "positions_beyond":
    body = _codes_beyond(rng, int(row[0]), n, bits)
    row[header:header + body.size] = body
  elif kind == "count_above_cap":
    row[0] = rng.choice([cap + 1, int(rng.integers(cap + 1, 2**31))])
  elif kind == "negative_count":
    row[0] = rng.choice([-1, int(rng.integers(-2**31, 0))])
  elif kind == "bits":
    row[2] = rng.choice([bits - 1, bits + 1, 0, bits_word ^ adacomp.BIN_SCALE_FLAG,
                         bits | adacomp_bucket.BUCKET_FLAG, int(_random_words(rng, 1)[0])])
  elif kind == "nonfinite_scale":
    if scale == "bin" and rng.random() < 0.5:
      # One bin's own scale (the encoder never sends one: it marks word 1 instead).
      bins = adacomp.num_bins(n, BIN_SIZE)
      halves = row[4:header].view(np.uint16)
      halves[rng.integers(bins)] = _bfloat16_bits(_nonfinite_word(rng))
    else:
      row[1] = _nonfinite_word(rng)
  return row


def _expect_adacomp(rows, shape, scale):
  """NumPy reading of per-tensor AdaComp rows (docs/wire_format.md)."""
  rows = np.atleast_2d(rows)
  n, bits, header, width, cap = _adacomp_layout(shape, scale, rows.shape[1])
  expected = Expected(n)
  for row in rows:
    count = int(row[0])
    if scale == "bin":
      bins = adacomp.num_bins(n, BIN_SIZE)
      halves = row[4:header].astype("<i4").view("<u2").astype(np.uint32) << 16
      scales = halves.view(np.float32)[:bins].astype(np.float64)
      bad = (row[2] != bits | adacomp.BIN_SCALE_FLAG or row[3] != bins
             or not np.isfinite(row[1:2].view(np.float32)[0])
             or not np.isfinite(scales).all())
    else:
      scale_value = float(row[1:2].view(np.float32)[0])
      bad = row[2] != bits or not np.isfinite(scale_value)
    if bad or count < 0 or count > cap:
      expected.flagged = True
      continue
    codes = _read_codes(row[header:], count, bits)
    positions, negative = codes >> 1, (codes & 1).astype(bool)
    magnitude = (scales[np.minimum(positions, n - 1) // BIN_SIZE] if scale == "bin"
                 else np.full(positions.shape, scale_value))
    expected.add(positions, np.where(negative, -magnitude, magnitude))
  return expected


def _decode_adacomp(payload, shape, scale):
  return adacomp.adacomp_decompress(tf.constant(payload), shape, tf.float32, scale=scale,
                                    bin_size=BIN_SIZE if scale == "bin" else None)


# Which payloads each case decodes: one row (either shape), gathered full rows, gathered
# truncated rows (a few words of codes after the header).
ADACOMP_CASES = [((40, 25), "one"), ((7,), "one"), ((40, 25), "gathered"),
                 ((40, 25), "truncated")]


def _payload(make_row, kind, rng, rows):
  """One ``kind`` row (``rows`` 1), or ``rows`` gathered rows: one ``kind`` row among
  well-formed ones (with random codes), at a place drawn from ``rng``."""
  if rows == 1:
    return make_row(kind)
  kinds = ["valid"] * rows
  kinds[rng.integers(rows)] = kind
  return np.stack([make_row(k) for k in kinds])


@hypothesis.settings(**SETTINGS)
@hypothesis.given(case=st.sampled_from(ADACOMP_CASES), kind=st.sampled_from(KINDS),
                  seed=st.integers(0, 2**32 - 1))
def test_adacomp_tensor_scale_decodes_hostile_words_safely(case, kind, seed):
  _check_adacomp(case, kind, seed, "tensor")


@hypothesis.settings(**SETTINGS)
@hypothesis.given(case=st.sampled_from([c for c in ADACOMP_CASES if c[0] != (7,)]),
                  kind=st.sampled_from(KINDS), seed=st.integers(0, 2**32 - 1))
def test_adacomp_bin_scale_decodes_hostile_words_safely(case, kind, seed):
  _check_adacomp(case, kind, seed, "bin")


def _check_adacomp(case, kind, seed, scale):
  shape, rows = case
  rng = np.random.default_rng(seed)
  _, _, header, full, _ = _adacomp_layout(shape, scale)
  width = header + TRUNCATED_CODE_WORDS if rows == "truncated" else full
  payload = _payload(lambda k: _adacomp_row(k, rng, shape, scale, width), kind, rng,
                     1 if rows == "one" else ROWS)
  got = _decode_adacomp(payload, shape, scale)
  assert_decoded_safely(got, _expect_adacomp(payload, shape, scale), shape)


def test_count_above_capacity_reads_nothing_beyond_the_capacity():
  # The decoder's add_codes on its own (the decoders mark such a payload NaN, which would
  # hide it): codes at positions 1..5 fill a capacity of 5 four-bit codes; after them
  # come the spare bits of the word and the zero padding of the decoder's last chunk,
  # which decode as codes for position 0. A count of 100 must add the 5 codes and no more.
  lay = adacomp_core.Layout((7,), 1, (5,))
  assert lay.bits == ref.code_bits(7) == 4
  words = ref.pack_codes(np.arange(1, 6, dtype=np.uint64) << np.uint64(1), lay.bits)
  for count in (5, 6, 100, 2**31 - 1):
    total = adacomp_core.add_codes(tf.zeros([lay.total + 1]), tf.constant(words),
                                   tf.constant(count), tf.constant([count]), tf.ones([1]), lay)
    want = np.zeros(lay.total + 1, np.float32)  # the tensor, its padding and the sink
    want[1:6] = 1
    np.testing.assert_array_equal(total.numpy(), want, err_msg=f"count={count}")


def test_bucket_counts_read_no_code_into_a_tensor_beyond_its_own():
  # The decoder's add_codes on its own (the decoder marks these payloads NaN): tensors
  # of 5 and 7 elements, capacities 2 and 3, codes at local positions 1..5.
  lay = adacomp_bucket.layout([5, 7], 1, max_density=0.4)
  assert lay.caps == (2, 3) and lay.bits == 4
  words = ref.pack_codes(np.arange(1, 6, dtype=np.uint64) << np.uint64(1), lay.bits)

  def decode(counts, count):
    total = adacomp_core.add_codes(
        tf.zeros([lay.total + 1]), tf.constant(words), tf.constant(count),
        tf.constant(counts, tf.int32), tf.ones([2]), lay)
    return total.numpy()[[*range(5), *range(32, 39)]]  # the two tensors' elements

  # Well-formed: tensor 0 takes codes 0-1 (positions 1, 2), tensor 1 codes 2-4 (3, 4, 5).
  np.testing.assert_array_equal(decode([2, 3], 5), [0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 0])
  # Counts adding up to less than the row's count: the codes after them (and the zero
  # padding, position 0) belong to no tensor.
  np.testing.assert_array_equal(decode([2, 1], 5), [0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0])
  # A tensor's count above its capacity: it takes its capacity of codes (positions 1, 2),
  # not codes 2-3; tensor 1 still takes its own (code 4, position 5).
  np.testing.assert_array_equal(decode([4, 1], 5), [0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0])
  # Not finite (-1): no codes of its own.
  np.testing.assert_array_equal(decode([-1, 3], 3), [0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0])


# ---------------------------------------------------------------------- AdaComp buckets


def _bucket_layout(scale):
  return adacomp_bucket.layout([int(np.prod(s)) for s in BUCKET_SHAPES], BUCKET_BIN_SIZE,
                               BUCKET_DENSITY, scale)


def _bucket_row(kind, rng, scale):
  lay = _bucket_layout(scale)
  tensors = len(lay.sizes)
  row = _random_words(rng, lay.width)
  if kind == "random":
    return row
  counts = [int(rng.integers(-1 if rng.random() < 0.2 else 0, cap + 1)) for cap in lay.caps]
  row[:4] = [sum(max(c, 0) for c in counts), lay.flags, tensors, lay.scale_words]
  row[4:4 + tensors] = counts
  if scale == "bin":
    halves = np.array([_scale_word(rng) for _ in range(2 * lay.scale_words)], np.int32)
    row[4 + tensors:lay.header_words] = (halves.view(np.uint32) >> 16).astype(
        np.uint16).view(np.int32)
  else:
    row[4 + tensors:lay.header_words] = [_scale_word(rng) for _ in range(tensors)]
  start = lay.header_words
  if kind == "positions_beyond":
    body = _codes_beyond(rng, int(row[0]), max(lay.sizes), lay.bits)
    row[start:start + body.size] = body
  elif kind == "count_above_cap":
    if rng.random() < 0.5:
      row[0] = rng.integers(lay.cap + 1, 2**31)
    else:  # one tensor's count above its capacity, the total still adding up
      t = rng.integers(tensors)
      row[4 + t] = lay.caps[t] + 1 + rng.integers(3)
      row[0] = sum(max(int(c), 0) for c in row[4:4 + tensors])
  elif kind == "negative_count":
    row[0] = rng.integers(-2**31, 0)
  elif kind == "bits":
    word = int(rng.integers(1, 4))
    row[word] = row[word] + rng.choice([-1, 1, 1 << 8, 1 << 9])
  elif kind == "nonfinite_scale":
    if scale == "bin":
      halves = row[4 + tensors:lay.header_words].view(np.uint16)
      halves[rng.integers(sum(lay.bins))] = _bfloat16_bits(_nonfinite_word(rng))
    else:
      row[4 + rng.integers(tensors) + tensors] = _nonfinite_word(rng)
  return row


def _expect_bucket(rows, scale):
  """NumPy reading of bucket rows: one Expected per tensor (docs/wire_format.md#buckets)."""
  lay = _bucket_layout(scale)
  tensors = len(lay.sizes)
  expected = [Expected(n) for n in lay.sizes]
  for row in np.atleast_2d(rows):
    count = int(row[0])
    counts = [int(c) for c in row[4:4 + tensors]]
    body = row[4 + tensors:lay.header_words]
    if (row[1] != lay.flags or row[2] != tensors or row[3] != lay.scale_words
        or not 0 <= count <= lay.cap or any(c > cap for c, cap in zip(counts, lay.caps))
        or sum(max(c, 0) for c in counts) != count):
      for e in expected:
        e.flagged = True
      continue
    if scale == "bin":
      scales = (body.astype("<i4").view("<u2").astype(np.uint32) << 16).view(np.float32)
      own = [scales[o:o + b] for o, b in zip(lay.bin_offsets, lay.bins)]
    else:
      own = [body[t:t + 1].view(np.float32) for t in range(tensors)]
    codes = _read_codes(row[lay.header_words:], count, lay.bits)
    start = 0
    for t, c in enumerate(counts):
      c = max(c, 0)
      if counts[t] < 0 or not np.isfinite(own[t]).all():
        expected[t].flagged = True
      mine = codes[start:start + c]
      start += c
      positions, negative = mine >> 1, (mine & 1).astype(bool)
      if scale == "bin":
        magnitude = own[t][np.minimum(positions, lay.sizes[t] - 1) // BUCKET_BIN_SIZE]
      else:
        magnitude = np.full(positions.shape, own[t][0])
      expected[t].add(positions, np.where(negative, -magnitude, magnitude).astype(np.float64))
  return expected


@hypothesis.settings(**SETTINGS)
@hypothesis.given(scale=st.sampled_from(["tensor", "bin"]), gathered=st.booleans(),
                  kind=st.sampled_from(KINDS), seed=st.integers(0, 2**32 - 1))
def test_bucket_decodes_hostile_words_safely(scale, gathered, kind, seed):
  rng = np.random.default_rng(seed)
  payload = _payload(lambda k: _bucket_row(k, rng, scale), kind, rng, 2 if gathered else 1)
  decoded = adacomp_bucket.decompress(tf.constant(payload), BUCKET_SHAPES, tf.float32,
                                      BUCKET_BIN_SIZE, BUCKET_DENSITY, scale)
  assert len(decoded) == len(BUCKET_SHAPES)
  for got, expected, shape in zip(decoded, _expect_bucket(payload, scale), BUCKET_SHAPES):
    assert_decoded_safely(got, expected, shape)


# ------------------------------------------------------------------------------- TopK


def _topk_sizes():
  n = int(np.prod(TOPK_SHAPE))
  k = topk_ops.topk_count(n, TOPK_DENSITY)
  bits = adacomp.index_bits(n)
  return n, k, bits, topk_ops.topk_payload_words(n, TOPK_DENSITY)


def _topk_row(kind, rng):
  n, k, bits, width = _topk_sizes()
  row = _random_words(rng, width)
  if kind == "random":
    return row
  index_words = (k * bits + 31) // 32
  row[:2] = [k, bits]
  values = np.array([_scale_word(rng) for _ in range(k)], np.int32)
  row[2 + index_words:] = values
  if kind == "positions_beyond":
    positions = np.where(rng.random(k) < 0.8, rng.integers(n, 1 << bits, k),
                         rng.integers(0, n, k)).astype(np.uint64)
    row[2:2 + index_words] = ref.pack_codes(positions, bits).view(np.int32)
  elif kind == "count_above_cap":
    row[0] = rng.integers(k + 1, 2**31)
  elif kind == "negative_count":
    row[0] = rng.integers(-2**31, 0)
  elif kind == "bits":
    row[1] = rng.choice([bits - 1, bits + 1, 0, 32, int(_random_words(rng, 1)[0])])
  elif kind == "nonfinite_scale":  # the values are TopK's scales
    row[2 + index_words + rng.integers(k, size=3)] = [_nonfinite_word(rng) for _ in range(3)]
  return row


def _expect_topk(rows):
  n, k, bits, _ = _topk_sizes()
  index_words = (k * bits + 31) // 32
  expected = Expected(n)
  for row in np.atleast_2d(rows):
    if row[0] != k or row[1] != bits:
      expected.flagged = True
      continue
    positions = _read_codes(row[2:2 + index_words], k, bits)
    expected.add(positions, row[2 + index_words:].view(np.float32).astype(np.float64))
  return expected


@hypothesis.settings(**SETTINGS)
@hypothesis.given(gathered=st.booleans(), kind=st.sampled_from(KINDS),
                  seed=st.integers(0, 2**32 - 1))
def test_topk_decodes_hostile_words_safely(gathered, kind, seed):
  rng = np.random.default_rng(seed)
  payload = _payload(lambda k: _topk_row(k, rng), kind, rng, 2 if gathered else 1)
  got = topk_ops.topk_decompress(tf.constant(payload), TOPK_SHAPE, TOPK_DENSITY, tf.float32)
  assert_decoded_safely(got, _expect_topk(payload), TOPK_SHAPE)


# ------------------------------------------------------------------ FFT / range floats


def _fft_sizes():
  n = int(np.prod(FFT_SHAPE))
  m = fft_ops.coefficient_count(n)
  cap = fft_ops.capacity(n, FFT_THETA)
  return (n, m, cap, adacomp.index_bits(m), 1 + FFT_E + FFT_M,
          fft_ops.fft_payload_words(n, FFT_THETA, FFT_E, FFT_M))


def _fft_row(kind, rng):
  n, m, cap, ib, vb, width = _fft_sizes()
  row = _random_words(rng, width)
  if kind == "random":
    return row
  fmt = ib | FFT_E << 8 | FFT_M << 16
  # A moderate top exponent (float32 sums of the coefficients cannot overflow), or the
  # extremes of its range.
  top = int(rng.integers(-30, 31)) if rng.random() < 0.8 else int(rng.choice([-126, 127]))
  row[:3] = [rng.integers(1, cap + 1), fmt, top]
  if kind == "positions_beyond":
    count = int(row[0])
    positions = np.where(rng.random(count) < 0.8, rng.integers(m, 1 << ib, count),
                         rng.integers(0, m, count)).astype(np.uint64)
    body = ref.pack_codes(positions, ib).view(np.int32)
    row[3:3 + body.size] = body
  elif kind == "count_above_cap":
    row[0] = rng.integers(cap + 1, 2**31)
  elif kind == "negative_count":
    row[0] = rng.choice([0, int(rng.integers(-2**31, 0))])
  elif kind == "bits":
    row[1] = rng.choice([fmt + 1, fmt - 1, fmt ^ 1 << 8, fmt ^ 1 << 16,
                         int(_random_words(rng, 1)[0])])
  elif kind == "nonfinite_scale":  # the top exponent is the range floats' scale
    row[2] = rng.choice([fft_ops.NONFINITE, -127, 128, int(_random_words(rng, 1)[0])])
  return row


def _range_float(codes, top):
  e_max = (1 << FFT_E) - 1
  sign = np.where((codes >> (FFT_E + FFT_M)) & 1, -1.0, 1.0)
  field_e = (codes >> FFT_M) & e_max
  field_m = codes & ((1 << FFT_M) - 1)
  value = sign * (1 + field_m / 2**FFT_M) * np.ldexp(1.0, top - e_max + field_e)
  return np.where(field_e == 0, 0.0, value)


def _expect_fft(rows):
  """(flagged, the dense float64 decode by numpy.fft, the sum of the coefficients'
  magnitudes) of FFT rows (docs/fft.md)."""
  n, m, cap, ib, vb, _ = _fft_sizes()
  spectrum = np.zeros(m, np.complex128)
  for row in np.atleast_2d(rows):
    count, fmt, top = (int(w) for w in row[:3])
    if (fmt != ib | FFT_E << 8 | FFT_M << 16 or not 1 <= count <= cap
        or not -126 <= top <= 127):
      return True, None, None
    body = row[3:]
    positions = _read_codes(body, count, ib)
    values = _range_float(_read_codes(body, 2 * count, vb, 32 * ((count * ib + 31) // 32)),
                          top)
    inside = positions < m  # a coefficient beyond the spectrum is dropped
    np.add.at(spectrum, positions[inside], (values[0::2] + 1j * values[1::2])[inside])
  return False, np.fft.irfft(spectrum, n), float(np.abs(spectrum).sum())


@hypothesis.settings(**SETTINGS)
@hypothesis.given(gathered=st.booleans(), kind=st.sampled_from(KINDS),
                  seed=st.integers(0, 2**32 - 1))
def test_fft_decodes_hostile_words_safely(gathered, kind, seed):
  rng = np.random.default_rng(seed)
  payload = _payload(lambda k: _fft_row(k, rng), kind, rng, 2 if gathered else 1)
  got = fft_ops.fft_decompress(tf.constant(payload), FFT_SHAPE, FFT_THETA, tf.float32,
                               FFT_E, FFT_M)
  assert got.dtype == tf.float32 and tuple(got.shape) == FFT_SHAPE
  got = got.numpy().reshape(-1).astype(np.float64)
  flagged, want, magnitude = _expect_fft(payload)
  if flagged:
    assert np.isnan(got).all()
    return
  # The float32 inverse FFT against NumPy's float64 one: a bound on its rounding, from
  # the largest magnitude a sum of the coefficients can reach (2/n of their total).
  reach = 2.0 * magnitude / want.size
  if magnitude > 1e37:
    # The float32 FFT sums the coefficients before it scales by 1/n: near float32's
    # range (a top exponent of 127) non-finite results are allowed; no crash.
    return
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * reach + 1e-37)


# ------------------------------------------------------- static problems raise in Python


def test_payloads_of_a_wrong_static_shape_are_refused_before_decoding():
  # Python-side checks, documented as ValueError/TypeError: nothing is compiled or run.
  n = int(np.prod(TOPK_SHAPE))
  rank3 = tf.zeros([2, 2, 10], tf.int32)
  with pytest.raises(ValueError, match="payload"):
    adacomp.adacomp_decompress(rank3, [10])
  with pytest.raises(ValueError, match="payload"):  # shorter than its header
    adacomp.adacomp_decompress(tf.zeros([ROWS, 2], tf.int32), [10])
  with pytest.raises(ValueError, match="payload"):  # shorter than header and scales
    adacomp.adacomp_decompress(tf.zeros([5], tf.int32), [1000], scale="bin", bin_size=50)
  with pytest.raises(TypeError, match="payload"):
    adacomp.adacomp_decompress(tf.zeros([10], tf.float32), [10])
  lay = _bucket_layout("tensor")
  with pytest.raises(ValueError, match="payload"):  # a truncated bucket row
    adacomp_bucket.decompress(tf.zeros([2, lay.width - 1], tf.int32), BUCKET_SHAPES,
                              tf.float32, BUCKET_BIN_SIZE, BUCKET_DENSITY)
  with pytest.raises(ValueError, match="payload"):
    topk_ops.topk_decompress(tf.zeros([2, topk_ops.topk_payload_words(n, TOPK_DENSITY) - 1],
                                      tf.int32), TOPK_SHAPE, TOPK_DENSITY)
  with pytest.raises(ValueError, match="payload"):
    fft_ops.fft_decompress(tf.zeros([2, 3], tf.int32), FFT_SHAPE, FFT_THETA)
