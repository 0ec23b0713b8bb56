"""Independent NumPy reference for AdaComp (docs/algorithms.md#adacomp) and its wire format.

Written from the maths and the documented contract only; nothing here imports
tf_adacomp. bfloat16 values are handled with ml_dtypes (a TensorFlow dependency).

Contract implemented:
- compute dtype float32, or float64 if grad or residue is float64;
  G = float(residue) + float(grad); H = G + float(grad)
- bins of ``bin_size`` consecutive elements of the flat G (last may be short);
  gmax[b] = max |G| in bin b; scale = mean(gmax), rounded to float32
- selected = (|H| >= gmax[bin(i)]) & (G != 0)
- capacity C = 0 if n == 0 else max(1, min(n, ceil(max_density * n))); if more than C are
  selected, the first C in flat order (the lowest positions) are kept
- Q_i = sign(G_i) * scale for kept i, else 0; new_residue = G - Q in the residue dtype
- non-finite G: nothing kept, residue unchanged, scale word NaN
- payload: [count, float32 bits of scale, bits, codes packed little-endian], code =
  position << 1 | (G < 0), bits = (max(n - 1, 0)).bit_length() + 1
"""

import dataclasses
import math

import ml_dtypes
import numpy as np

HEADER_WORDS = 3


def index_bits(n: int) -> int:
  return max(n - 1, 0).bit_length()


def code_bits(n: int) -> int:
  return index_bits(n) + 1


def capacity(n: int, max_density: float) -> int:
  if n == 0:
    return 0
  return max(1, min(n, math.ceil(max_density * n)))


def payload_words(n: int, max_density: float = 1.0) -> int:
  return HEADER_WORDS + (capacity(n, max_density) * code_bits(n) + 31) // 32


def nbytes_for(count: int, n: int) -> int:
  return 4 * (HEADER_WORDS + -(-(count * code_bits(n)) // 32))


def compute_dtype(grad_dtype, residue_dtype):
  if np.dtype(grad_dtype) == np.float64 or np.dtype(residue_dtype) == np.float64:
    return np.float64
  return np.float32


def cast(x, dtype):
  """Casts an array to a NumPy dtype (including ml_dtypes.bfloat16), round to nearest."""
  return np.asarray(x).astype(dtype)


def exact_mean_f32(values: np.ndarray) -> np.float32:
  """Mean computed with (near-)exact float64 / fsum accumulation, rounded to float32."""
  if values.size == 0:
    return np.float32(0.0)
  return np.float32(math.fsum(values.astype(np.float64).tolist()) / values.size)


@dataclasses.dataclass
class Result:
  g: np.ndarray          # flat G in the compute dtype
  h: np.ndarray          # flat H in the compute dtype
  gmax: np.ndarray       # per-bin max |G|
  selected: np.ndarray   # bool [n], before the cap
  kept: np.ndarray       # bool [n], after the cap
  scale: np.float32      # the float32 scale (NaN if G is not finite)
  q: np.ndarray          # flat Q in the compute dtype
  new_residue: np.ndarray  # residue dtype and shape
  count: int
  bits: int
  finite: bool
  scales: np.ndarray = None  # scale="bin": each bin's scale (float32 values of bfloat16)

  def pairs(self):
    """Set of (position, negative) of the kept elements."""
    pos = np.nonzero(self.kept)[0]
    return {(int(p), bool(self.g[p] < 0)) for p in pos}


def reference_compress(grad, residue, bin_size: int, max_density: float = 1.0,
                       scale=None) -> Result:
  """Reference compress.

  Args:
    grad, residue: NumPy arrays (any float dtype, bfloat16 via ml_dtypes).
    scale: optional float32 scale to use instead of the computed one (to check the
      residue exactly against an implementation whose mean differs by an ulp).
  """
  grad = np.asarray(grad)
  residue = np.asarray(residue)
  assert grad.shape == residue.shape
  cd = compute_dtype(grad.dtype, residue.dtype)
  n = grad.size
  dw = grad.reshape(-1).astype(cd)  # exact: every float dtype here widens exactly
  r = residue.reshape(-1).astype(cd)
  with np.errstate(over="ignore", invalid="ignore"):
    g = (r + dw).astype(cd)
    h = (g + dw).astype(cd)
  finite = bool(np.all(np.isfinite(g)))
  bins = -(-n // bin_size)
  absg = np.abs(g)
  gmax = np.array([absg[b * bin_size:(b + 1) * bin_size].max() for b in range(bins)], cd)
  if scale is None:
    scale = exact_mean_f32(gmax) if finite else np.float32(np.nan)
  scale = np.float32(scale)
  if not finite:
    kept = np.zeros([n], bool)
    return Result(g, h, gmax, kept.copy(), kept, np.float32(np.nan), np.zeros([n], cd),
                  residue.copy(), 0, code_bits(n), False)
  threshold = np.repeat(gmax, bin_size)[:n] if n else np.zeros([0], cd)
  with np.errstate(invalid="ignore"):
    selected = (np.abs(h) >= threshold) & (g != 0)
  cap = capacity(n, max_density)
  kept = selected.copy()
  if selected.sum() > cap:
    kept = np.zeros([n], bool)
    kept[np.nonzero(selected)[0][:cap]] = True
  s = cd(scale)
  q = np.where(kept, np.where(g < 0, -s, s), cd(0)).astype(cd)
  with np.errstate(over="ignore", invalid="ignore"):
    new_residue = cast((g - q).astype(cd), residue.dtype).reshape(residue.shape)
  return Result(g, h, gmax, selected, kept, scale, q, new_residue, int(kept.sum()),
                code_bits(n), True)


def pack_codes(codes, bits: int) -> np.ndarray:
  """Packs codes little-endian into uint32 words (reference packer, bit by bit)."""
  codes = np.asarray(codes, np.uint64)
  total = len(codes) * bits
  stream = np.zeros([(total + 31) // 32 * 32], np.uint8)
  for j, c in enumerate(codes):
    for k in range(bits):
      stream[j * bits + k] = (int(c) >> k) & 1
  if stream.size == 0:
    return np.zeros([0], np.uint32)
  return np.packbits(stream, bitorder="little").view("<u4").astype(np.uint32)


@dataclasses.dataclass
class Decoded:
  count: int
  scale: np.float32
  bits: int
  pairs: set   # {(position, negative)}
  positions: list  # in payload order


def unpack_payload(payload, n: int) -> Decoded:
  """Independent unpacker of one payload row (int32 words)."""
  words = np.asarray(payload).astype(np.int32).reshape(-1)
  assert words.size >= HEADER_WORDS
  count = int(words[0])
  scale = words[1:2].view(np.float32)[0]
  bits = int(words[2])
  body = words[HEADER_WORDS:].astype("<i4").view("<u4")
  stream = np.unpackbits(body.view(np.uint8), bitorder="little")
  assert count * bits <= stream.size, (count, bits, stream.size)
  pairs = set()
  positions = []
  weights = 1 << np.arange(bits, dtype=np.uint64)
  for j in range(count):
    chunk = stream[j * bits:(j + 1) * bits].astype(np.uint64)
    code = int((chunk * weights).sum())
    pos, neg = code >> 1, bool(code & 1)
    positions.append(pos)
    pairs.add((pos, neg))
  return Decoded(count, np.float32(scale), bits, pairs, positions)


def dense_from_pairs(pairs, scale, n: int, dtype=np.float32) -> np.ndarray:
  out = np.zeros([n], dtype)
  s = dtype(scale)
  for p, neg in pairs:
    out[p] = -s if neg else s
  return out


def reference_decode_rows(rows, n: int, dtype=np.float32) -> np.ndarray:
  """Sum over rows (in row order) of each row's Q, in ``dtype``; all-NaN if any row's
  scale is not finite."""
  acc = np.zeros([n], dtype)
  for row in rows:
    d = unpack_payload(row, n)
    if not np.isfinite(d.scale):
      acc = acc + dtype(np.nan)
      continue
    acc = (acc + dense_from_pairs(d.pairs, d.scale, n, dtype)).astype(dtype)
  return acc


def pad_rows(rows) -> np.ndarray:
  """Stacks 1-D int32 payloads zero-padded to the longest."""
  width = max(len(r) for r in rows)
  out = np.zeros([len(rows), width], np.int32)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return out


def ulp_diff_f32(a, b) -> int:
  """Distance in float32 ulps between two finite float32 numbers of the same sign."""
  ai = np.array([a], np.float32).view(np.int32)[0]
  bi = np.array([b], np.float32).view(np.int32)[0]
  return abs(int(ai) - int(bi))


BFLOAT16 = ml_dtypes.bfloat16


# --------------------------------------------------------------- scale="bin" variant
#
# Contract (docs/wire_format.md, "Per-bin scales"):
# - gmax, H, G, the selection rule and the cap as above; each bin's scale is its gmax
#   rounded to float32 then to bfloat16 (round to nearest even both times);
# - selected additionally needs the element's bin scale > 0;
# - Q_i = sign(G_i) * scale[bin(i)] for kept i; non-finite G, or a scale that is not
#   finite in bfloat16: nothing kept, residue unchanged, word 1 NaN (else word 1 = 0);
# - payload: [count, word 1, bits | 256, bins, ceil(bins / 2) words of the bfloat16
#   scales (bin b in the low half of word 4 + b // 2 when b is even, the high half when
#   odd), codes packed little-endian from word 4 + ceil(bins / 2)].

BIN_HEADER_WORDS = 4
BIN_SCALE_FLAG = 256


def bins_for(n: int, bin_size: int) -> int:
  return -(-n // bin_size)


def payload_words_per_bin(n: int, bin_size: int, max_density: float = 1.0) -> int:
  return (BIN_HEADER_WORDS + -(-bins_for(n, bin_size) // 2)
          + (capacity(n, max_density) * code_bits(n) + 31) // 32)


def nbytes_for_per_bin(count: int, n: int, bin_size: int) -> int:
  return 4 * (BIN_HEADER_WORDS + -(-bins_for(n, bin_size) // 2)
              + -(-(count * code_bits(n)) // 32))


def reference_compress_per_bin(grad, residue, bin_size: int,
                               max_density: float = 1.0) -> Result:
  """Reference compress with one bfloat16 scale per bin; ``Result.scales`` holds them
  (as float32) and ``Result.scale`` is 0 (NaN when not finite)."""
  grad = np.asarray(grad)
  residue = np.asarray(residue)
  assert grad.shape == residue.shape
  cd = compute_dtype(grad.dtype, residue.dtype)
  n = grad.size
  dw = grad.reshape(-1).astype(cd)
  r = residue.reshape(-1).astype(cd)
  with np.errstate(over="ignore", invalid="ignore"):
    g = (r + dw).astype(cd)
    h = (g + dw).astype(cd)
  bins = bins_for(n, bin_size)
  absg = np.abs(g)
  gmax = np.array([absg[b * bin_size:(b + 1) * bin_size].max() for b in range(bins)], cd)
  with np.errstate(over="ignore", invalid="ignore"):
    scales = gmax.astype(np.float32).astype(BFLOAT16).astype(np.float32)
  finite = bool(np.all(np.isfinite(g))) and bool(np.all(np.isfinite(scales)))
  if not finite:
    kept = np.zeros([n], bool)
    return Result(g, h, gmax, kept.copy(), kept, np.float32(np.nan), np.zeros([n], cd),
                  residue.copy(), 0, code_bits(n), False, scales)
  bin_of = np.arange(n) // bin_size
  threshold = gmax[bin_of] if n else np.zeros([0], cd)
  element_scale = scales[bin_of].astype(cd) if n else np.zeros([0], cd)
  selected = (np.abs(h) >= threshold) & (g != 0) & (element_scale > 0)
  cap = capacity(n, max_density)
  kept = selected.copy()
  if selected.sum() > cap:
    kept = np.zeros([n], bool)
    kept[np.nonzero(selected)[0][:cap]] = True
  q = np.where(kept, np.where(g < 0, -element_scale, element_scale), cd(0)).astype(cd)
  with np.errstate(over="ignore", invalid="ignore"):
    new_residue = cast((g - q).astype(cd), residue.dtype).reshape(residue.shape)
  return Result(g, h, gmax, selected, kept, np.float32(0), q, new_residue, int(kept.sum()),
                code_bits(n), True, scales)


@dataclasses.dataclass
class DecodedPerBin:
  count: int
  marker: np.float32   # word 1: 0, or NaN for a non-finite step
  bits_word: int
  bins: int
  scales: np.ndarray   # float32 [bins], from the bfloat16 halves
  pairs: set
  positions: list


def unpack_payload_per_bin(payload, n: int, bin_size: int) -> DecodedPerBin:
  """Independent unpacker of one scale="bin" payload row."""
  words = np.asarray(payload).astype(np.int32).reshape(-1)
  bins = bins_for(n, bin_size)
  start = BIN_HEADER_WORDS + -(-bins // 2)
  assert words.size >= start
  halves = words[BIN_HEADER_WORDS:start].astype("<i4").view("<u2")  # low half first
  scales = halves.view(BFLOAT16)[:bins].astype(np.float32)
  bits = code_bits(n)
  rest = unpack_payload(np.concatenate([[words[0], 0, bits], words[start:]]).astype(np.int32),
                        n)
  return DecodedPerBin(int(words[0]), words[1:2].view(np.float32)[0], int(words[2]),
                       int(words[3]), scales, rest.pairs, rest.positions)


def dense_from_pairs_per_bin(pairs, scales, n: int, bin_size: int,
                             dtype=np.float32) -> np.ndarray:
  out = np.zeros([n], dtype)
  for p, neg in pairs:
    s = dtype(scales[p // bin_size])
    out[p] = -s if neg else s
  return out


# ----------------------------------------------------------------- buckets (several tensors)
# docs/wire_format.md#buckets: [count, bits | 512 (| 256 for per-bin scales), tensors T,
# scale words S, T counts (-1: not finite), S scale words, packed codes]. Codes carry a
# position within their tensor, in code_bits(largest tensor) bits, tensor by tensor
# (count_t of them each); in the decoded bucket, tensor t starts at 32 * (the words of
# the tensors before it).

BUCKET_FLAG = 1 << 9
BIN_SCALE_FLAG = 1 << 8
BIN_POSITIONS_FLAG = 1 << 10
ELIAS_FANO_FLAG = 1 << 11


def bucket_offsets(sizes):
  words = [-(-n // 32) for n in sizes]
  return [32 * sum(words[:t]) for t in range(len(sizes))], 32 * sum(words)


@dataclasses.dataclass
class DecodedBucket:
  count: int
  flags: int
  counts: list
  scales: np.ndarray      # float32: [T] (tensor scales) or [bins] (per-bin scales)
  pairs: list             # per tensor: {(local position, negative)}


def unpack_bucket(payload, sizes, bin_size, per_bin=False, max_density=None) -> DecodedBucket:
  """Independent unpacker of one bucket payload row (docs/wire_format.md#buckets,
  #positions-in-bins and #positions-elias-fano: that one needs ``max_density``)."""
  words = np.asarray(payload).astype(np.int32).reshape(-1)
  count, flags, tensors, scale_words = (int(w) for w in words[:4])
  assert tensors == len(sizes)
  counts = [int(c) for c in words[4:4 + tensors]]
  body = words[4 + tensors:4 + tensors + scale_words]
  if per_bin:
    halves = body.astype("<i4").view("<u2").astype(np.uint32) << 16
    scales = halves.view(np.float32)[:sum(bins_for(n, bin_size) for n in sizes)]
  else:
    scales = body.view(np.float32)
  in_bins = bool(flags & BIN_POSITIONS_FLAG)
  elias_fano = bool(flags & ELIAS_FANO_FLAG)
  bits = (flags & 0xFF)
  if elias_fano:  # the payload's own width: its low bits and a sign
    assert bits == elias_fano_low_bits(count, sizes, bin_size, max_density) + 1, (bits, count)
  else:
    assert bits == (code_bits(min(bin_size, max(sizes))) if in_bins else code_bits(max(sizes)))
  ends = np.cumsum(np.maximum(counts, 0))
  stream = np.unpackbits(words[4 + tensors + scale_words:].astype("<i4").view(np.uint8),
                         bitorder="little")
  weights = 1 << np.arange(bits, dtype=np.uint64)
  fields = [int((stream[j * bits:(j + 1) * bits].astype(np.uint64) * weights).sum())
            for j in range(count)]
  if in_bins:
    bins = [bins_for(n, bin_size) for n in sizes]
    code_bin = unary_bins(stream[32 * (-(-count * bits // 32)):], count, sum(bins))
    first_bin = np.cumsum([0] + bins)
  if elias_fano:
    low_bits, universe = bits - 1, sum(sizes)
    code_bucket = unary_bins(stream[32 * (-(-count * bits // 32)):], count,
                             -(-universe // 2**low_bits))
    starts = np.cumsum([0] + list(sizes))
  pairs = [set() for _ in sizes]
  for j, code in enumerate(fields):
    pos, neg = code >> 1, bool(code & 1)
    t = int(np.searchsorted(ends, j, side="right"))
    if in_bins:
      assert pos < bin_size and first_bin[t] <= code_bin[j] < first_bin[t + 1], (j, t)
      pos += (code_bin[j] - first_bin[t]) * bin_size
    if elias_fano:  # its place among all the tensors' elements
      place = code_bucket[j] * 2**low_bits + pos
      assert starts[t] <= place < starts[t + 1], (j, t, place)
      pos = place - starts[t]
    assert pos < sizes[t], (pos, t)
    pairs[t].add((pos, neg))
  return DecodedBucket(count, flags, counts, np.asarray(scales, np.float32), pairs)


def elias_fano_words(count, low_bits, universe):
  """Body words of docs/wire_format.md#positions-elias-fano: ``count`` codes of
  ``low_bits + 1`` bits, then one unary bit per code and per bucket of ``2**low_bits``."""
  return -(-count * (low_bits + 1) // 32) + -(-(-(-universe // 2**low_bits) + count) // 32)


def elias_fano_low_bits(count, sizes, bin_size, max_density):
  """The low bits the encoder chooses: the fewest body words, the smallest of equals,
  among those whose unary counts are no longer than positions="bin"'s longest (a bit
  per bin and per code of the capacities)."""
  universe = sum(sizes)
  longest = sum(bins_for(n, bin_size) + capacity(n, max_density) for n in sizes)
  candidates = [low for low in range(index_bits(universe) + 1)
                if -(-universe // 2**low) + count <= longest]
  return min(candidates, key=lambda low: (elias_fano_words(count, low, universe), low))


def unary_bins(stream, count, bins):
  """The bin of each of ``count`` codes from unary counts (a 1 per code of a bin, then a
  0 closing it), read bit by bit; asserts that they hold ``count`` ones and ``bins``
  zeros."""
  code_bin, b = [], 0
  for bit in stream[:bins + count]:
    if bit:
      code_bin.append(b)
    else:
      b += 1
  assert len(code_bin) == count and b == bins, (len(code_bin), count, b, bins)
  return code_bin
