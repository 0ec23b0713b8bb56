"""AdaComp's selection step, encoder and decoder, written once for a bucket of tensors.

Per tensor, with residue R and new gradient dW (docs/algorithms.md#adacomp):

    G = R + dW;  H = G + dW
    gmax[b] = max |G| over bin b of ``bin_size`` consecutive elements of the flat tensor
    S = {i : |H_i| >= gmax[bin(i)]}
    scale = mean(gmax);  Q_i = sign(G_i) * scale on S, else 0;  R <- G - Q

``scale="bin"``: every bin has its own scale, its maximum ``gmax[b]`` rounded to
bfloat16, and ``Q_i = sign(G_i) * scale[bin(i)]``.

Choices of this implementation, none of which changes Q:
- elements with G_i == 0 are not sent: their Q_i is sign(0) * scale = 0 anyway (this
  keeps an all-zero bin, where every |H_i| >= 0 = gmax, from sending every element);
- each tensor has a static capacity (its payload's); if more are selected, its first
  ones (lowest positions) are sent and the rest stay in R;
- a tensor whose G is not finite, or whose scale the wire cannot hold, sends nothing
  and keeps R.

Two wire formats sit on this module (docs/wire_format.md), the public kernels:
``ops.adacomp`` (one payload per tensor) and ``ops.adacomp_bucket`` (one for several).
Both compress with ``compress`` and decode with ``decode``; a single tensor is a
``Layout`` of one, and the two modules only write and read the words around the codes.

Why not a single tensor as a bucket of one: the per-tensor format (documented, checked
against an independent NumPy reference, sent by ``AdaComp(fuse=False)`` and
``adacomp_compress``) needs none of a bucket's header words (tensors, scale words, a
count besides the payload's). The kernel, not the format, is shared: buckets and single
tensors run one selection, encoder and decoder, which cannot drift apart.
"""

import dataclasses
import functools
import math
from typing import Callable, List, NamedTuple, Sequence, Tuple

import tensorflow as tf

from tf_adacomp.ops import bitpack
from tf_adacomp.ops import checks
from tf_adacomp.ops import compaction
from tf_adacomp.ops import variant

SCALES = ("tensor", "bin")
# What a code's position is relative to: its tensor (a position of index_bits(n) bits),
# or its bin (an offset of index_bits(L_T) bits, the bins' counts sent in unary beside
# the codes; docs/wire_format.md#positions-in-bins), or the Elias-Fano code of its place
# among all the bucket's positions: its low bits in the code, the rest in unary, the
# split chosen per payload to take the fewest words
# (docs/wire_format.md#positions-elias-fano).
POSITIONS = ("tensor", "bin", "elias_fano")
# Smaller encoder tiers, as fractions 1/d of the positions (see _packed_codes).
SLOT_TIERS = (128, 16)
# The GPU form encodes every slot of the capacity up to this many; past it, the tiers'
# two conditionals (two host round trips) cost less than encoding every slot: on an
# H200 the tiered encode was faster from 24M elements (6M slots) on (docs/gpu.md).
GPU_FULL_ENCODE_MAX_SLOTS = 1 << 22
# Codes the decoder unpacks and adds per loop iteration (see add_codes); a multiple of
# 32, so that every chunk starts on a word boundary whatever the code width.
DECODE_CHUNK = 2048


def index_bits(num_elements: int) -> int:
  """Bits needed for a position in a tensor of ``num_elements`` (0 for 0 or 1 element)."""
  return max(num_elements - 1, 0).bit_length()


def capacity(num_elements: int, max_density: float) -> int:
  """Static number of elements one tensor's payload can carry."""
  if num_elements == 0:
    return 0
  return max(1, min(num_elements, math.ceil(max_density * num_elements)))


def num_bins(num_elements: int, bin_size: int) -> int:
  """Bins of ``bin_size`` elements (the last may be short) in a tensor."""
  return -(-num_elements // bin_size)


def check_positions(positions) -> str:
  """Returns ``positions`` if it is one of ``POSITIONS``.

  Raises:
    ValueError: ``positions`` is not one of ``POSITIONS``.
  """
  if not isinstance(positions, str) or positions not in POSITIONS:
    raise ValueError(f"`positions` must be one of {POSITIONS}. Received: positions={positions!r}")
  return positions


def check_scale(scale, bin_size=None) -> str:
  """Returns ``scale`` if it is one of ``SCALES``.

  Args:
    scale: the scale option to check.
    bin_size: the bin length; needed with ``scale="bin"`` (it maps positions to bins).

  Returns:
    ``scale``.

  Raises:
    ValueError: ``scale`` is not one of ``SCALES``, or is "bin" without a ``bin_size``.
  """
  if not isinstance(scale, str) or scale not in SCALES:
    raise ValueError(f"`scale` must be one of {SCALES}. Received: scale={scale!r}")
  if scale == "bin" and bin_size is None:
    raise ValueError("`bin_size` is needed with scale='bin' (it maps positions to bins). "
                     "Received: bin_size=None")
  return scale


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static layout of the tensors that one kernel call compresses or decodes.

  The tensors lie in one flat buffer of positions, each starting at a multiple of 32 (a
  bitmap word of its own) and zero-padded to the next: a zero changes no bin maximum and
  is never selected (AdaComp does not send G_i == 0), and each tensor's bins are taken
  on its own elements, so every tensor is selected as it would be alone.

  Attributes:
    sizes: elements of each tensor.
    bin_size: L_T, shared by the tensors.
    caps: codes each tensor may send at most (its payload capacity).
    scale: "tensor" or "bin".
    positions: "tensor" (a code carries its position in its tensor), "bin" (its offset
      in its bin; the bins' counts travel in unary after the codes) or "elias_fano"
      (the low bits of its place among all the positions, the high bits in unary).
  """
  sizes: Tuple[int, ...]
  bin_size: int
  caps: Tuple[int, ...]
  scale: str = "tensor"
  positions: str = "tensor"

  @functools.cached_property
  def blocks(self) -> Tuple[int, ...]:
    """Bitmap words of each tensor (its elements rounded up to whole words)."""
    return tuple(compaction.blocks_for(n) for n in self.sizes)

  @functools.cached_property
  def offsets(self) -> Tuple[int, ...]:
    """First position of each tensor in the buffer (a multiple of 32)."""
    return tuple(compaction.WORD_BITS * sum(self.blocks[:i]) for i in range(len(self.sizes)))

  @property
  def total(self) -> int:
    """Positions of the buffer, padding included."""
    return compaction.WORD_BITS * sum(self.blocks)

  @property
  def bits(self) -> int:
    """Code width: a position within its tensor (of the largest tensor), or with
    ``positions="bin"`` an offset within its bin, and a sign. With
    ``positions="elias_fano"`` each payload chooses its own width; this one (a bin's
    offset and a sign) sizes the static buffer, which every choice fits (see
    ``elias_fano_low_bits``)."""
    if self.positions in ("bin", "elias_fano"):
      return index_bits(min(self.bin_size, max(self.sizes))) + 1
    return index_bits(max(self.sizes)) + 1

  @property
  def unary_bits(self) -> int:
    """``positions="bin"`` (and the static buffer of ``"elias_fano"``): the most bits the
    bins' unary counts take (a one per code and a zero closing each bin); 0 otherwise."""
    return sum(self.bins) + self.cap if self.positions in ("bin", "elias_fano") else 0

  @property
  def body_words(self) -> int:
    """Static words of the codes and, with ``positions="bin"``, the unary counts."""
    return bitpack.packed_words(self.cap, self.bits) + -(-self.unary_bits // 32)

  @property
  def cap(self) -> int:
    """Codes all the tensors may send together."""
    return sum(self.caps)

  @functools.cached_property
  def bins(self) -> Tuple[int, ...]:
    """Each tensor's bins (its last may be short)."""
    return tuple(num_bins(n, self.bin_size) for n in self.sizes)

  @property
  def bin_offsets(self) -> Tuple[int, ...]:
    """Index of each tensor's first bin among all the tensors' bins."""
    return tuple(sum(self.bins[:i]) for i in range(len(self.sizes)))

  @property
  def universe(self) -> int:
    """``positions="elias_fano"``: the places of all the tensors' elements, end to end."""
    return sum(self.sizes)

  @property
  def starts(self) -> Tuple[int, ...]:
    """Each tensor's first place among ``universe`` (no padding between tensors)."""
    return tuple(sum(self.sizes[:i]) for i in range(len(self.sizes)))

  @property
  def max_low_bits(self) -> int:
    """``positions="elias_fano"``: the most low bits a code may carry (then one bucket
    of ``2**low_bits`` places holds the whole universe)."""
    return index_bits(self.universe)


# ------------------------------------------------------------------------ compress


class Compressed(NamedTuple):
  """What ``compress`` gives a wire format to write.

  Attributes:
    count: int32, the codes sent by all the tensors.
    counts: one int32 per tensor, the codes it sent (0 when it was not finite).
    finite: one bool per tensor: its G and its scales were finite (else it sent nothing
      and kept its residue).
    scales: one per tensor, what goes on the wire for its scale: the float32 tensor scale
      (NaN when not finite), or with ``scale="bin"`` its bins' bfloat16 scales.
    codes: int32 words (``Layout.body_words``), the bit-packed codes (``position in its
      tensor << 1 | (G < 0)``, or with ``positions="bin"`` ``offset in its bin << 1 |
      (G < 0)``, or with ``"elias_fano"`` ``low bits of its place << 1 | (G < 0)``,
      ``bits`` each, tensor by tensor, positions increasing); with ``positions="bin"``
      or ``"elias_fano"`` the unary counts follow from the word after the last code
      (``body_used_words``); zeros after.
    residues: the new residue of each tensor, of its residue's dtype and shape.
    bits: int32, the width of the codes: ``Layout.bits``, or with ``"elias_fano"`` the
      payload's own (its low bits and a sign).
  """
  count: tf.Tensor
  counts: List[tf.Tensor]
  finite: List[tf.Tensor]
  scales: List[tf.Tensor]
  codes: tf.Tensor
  residues: List[tf.Tensor]
  bits: tf.Tensor


class _Selection(NamedTuple):
  words: tf.Tensor      # uint32 bitmap of the selection, before the capacity
  signs: tf.Tensor      # uint32 bitmap of G < 0
  finite: tf.Tensor
  wire_scale: tf.Tensor
  new_residue: Callable[[tf.Tensor], tf.Tensor]  # of the bitmap of what was sent


def compress(grads: Sequence[tf.Tensor], residues: Sequence[tf.Tensor],
             lay: Layout) -> Compressed:
  """AdaComp of each gradient with its residue, the tensors of ``lay`` in one pass.

  To be called inside a compiled kernel (``compiled.kernel``); the arguments are checked
  by the public wrappers.

  Args:
    grads: float tensors, one per tensor of ``lay`` (any shape of its size).
    residues: float tensors of the gradients' shapes.
    lay: their ``Layout``.

  Returns:
    A ``Compressed``.
  """
  parts = [_select(g, r, n, lay) for g, r, n in zip(grads, residues, lay.sizes)]
  words = _kept_words(tf.concat([p.words for p in parts], 0), lay)
  signs = tf.concat([p.signs for p in parts], 0)
  popcounts = compaction.popcount(words)
  spans = [(o // compaction.WORD_BITS, o // compaction.WORD_BITS + blocks)
           for o, blocks in zip(lay.offsets, lay.blocks)]
  counts = [tf.reduce_sum(popcounts[start:end]) for start, end in spans]
  count = tf.add_n(counts)
  codes, bits = _body(words, signs, count, lay)
  return Compressed(count, counts, [p.finite for p in parts], [p.wire_scale for p in parts],
                    codes, [p.new_residue(words[start:end])
                            for p, (start, end) in zip(parts, spans)], bits)


def _body(words, signs, count, lay: Layout):
  """The body words of the sent positions (codes, and unary counts after them), and
  the codes' width (int32)."""
  if lay.positions == "elias_fano":
    low_bits = elias_fano_low_bits(count, lay)
    body = _by_tier(lambda slots: _elias_fano_body(words, signs, slots, count, low_bits, lay),
                    words, lay.cap, count, lay.body_words)
    return body, tf.cast(low_bits + 1, tf.int32)
  index_of = None
  if len(lay.sizes) > 1:
    offsets = tf.constant(lay.offsets, tf.int32)

    def index_of(positions):  # a code carries the position within its own tensor
      return positions - tf.gather(offsets, _tensor_of(positions, lay))

  if lay.positions == "bin":
    in_tensor = index_of or (lambda positions: positions)
    index_of = lambda positions: in_tensor(positions) % lay.bin_size  # pylint: disable=g-long-lambda
  codes = _packed_codes(words, signs, lay.cap, count, lay.bits, index_of)
  if lay.positions == "bin":
    codes = _joined(codes, _unary_counts(words, count, lay), count, lay)
  return codes, tf.constant(lay.bits, tf.int32)


def _select(grad, residue, n: int, lay: Layout) -> _Selection:
  """One tensor's selection on its own elements."""
  b = lay.bin_size
  cd = checks.compute_dtype(grad.dtype, residue.dtype)
  dw = tf.cast(tf.reshape(grad, [-1]), cd)
  r = tf.cast(tf.reshape(residue, [-1]), cd)
  g = r + dw
  h = g + dw
  # NaN is counted as inf, so that the bin maxima reveal any non-finite element of G
  # without a separate pass over it (XLA's max does not propagate NaN).
  gmax = _bin_maxima(tf.where(tf.math.is_nan(g), tf.constant(float("inf"), cd), tf.abs(g)), b)
  element_bin = tf.range(n, dtype=tf.int32) // b
  selected = (tf.abs(h) >= tf.gather(gmax, element_bin)) & tf.not_equal(g, 0)
  if lay.scale == "bin":
    # The scales on the wire: float32 first (float64 maxima round there, as the tensor
    # scale does), then bfloat16, round to nearest even both times; the receiver
    # decodes exactly the Q subtracted here.
    scales16 = tf.cast(tf.cast(gmax, tf.float32), tf.bfloat16)
    scales = tf.cast(scales16, cd)
    # A non-finite G, or a maximum that bfloat16 cannot hold: nothing is sent.
    finite = tf.reduce_all(tf.math.is_finite(scales))
    element_scale = tf.gather(scales, element_bin)
    # A bin whose scale rounds to 0 would send codes worth nothing: it sends none.
    selected = selected & (element_scale > 0) & finite
    wire_scale = scales16
  else:
    # One scale per tensor, rounded to the float32 that goes on the wire, so that the
    # receiver decodes exactly the Q subtracted here.
    scale32 = _mean_as_float32(gmax) if n else tf.zeros([], tf.float32)
    element_scale = tf.cast(scale32, cd)
    # A non-finite G or a scale that float32 cannot hold: nothing is sent.
    finite = tf.math.is_finite(scale32) & tf.reduce_all(tf.math.is_finite(gmax))
    selected = selected & finite
    wire_scale = tf.where(finite, scale32, tf.constant(float("nan"), tf.float32))
  blocks = compaction.blocks_for(n)
  words = compaction.pack_mask(compaction.to_words(selected, blocks))
  # G's signs as a bitmap (streamed in the same pass): the encoder reads only the bits
  # of the sent positions, and its branches get n/32 words, not G.
  signs = compaction.pack_mask(compaction.to_words(g < 0, blocks))

  def new_residue(sent_words):
    # What was selected but not sent (beyond the capacity) stays in R with the rest.
    sent = tf.reshape(compaction.unpack_mask(sent_words), [-1])[:n]
    q = tf.where(g < 0, -element_scale, element_scale)
    new = tf.where(finite, tf.where(sent, g - q, g), r)
    return tf.reshape(tf.cast(new, residue.dtype), residue.shape)

  return _Selection(words, signs, finite, wire_scale, new_residue)


def _bin_maxima(magnitude, bin_size: int):
  """Maximum of each run of ``bin_size`` elements (the last run may be short)."""
  n = int(magnitude.shape[0])
  full = n // bin_size
  parts = []
  if full:
    parts.append(tf.reduce_max(tf.reshape(magnitude[:full * bin_size], [full, bin_size]), 1))
  if n % bin_size:
    parts.append(tf.reduce_max(magnitude[full * bin_size:], keepdims=True))
  return tf.concat(parts, 0) if len(parts) > 1 else (parts[0] if parts else magnitude)


def _mean_as_float32(values):
  """Mean of non-negative values, in float64 and scaled by their maximum so that the sum
  cannot overflow, rounded to float32 (inf when the mean exceeds float32's range)."""
  values = tf.cast(values, tf.float64)
  top = tf.reduce_max(values)
  safe_top = tf.where(top > 0, top, tf.ones_like(top))
  return tf.cast(safe_top * tf.reduce_mean(values / safe_top), tf.float32)


def _per_word(values, lay: Layout):
  """One int32 value per tensor, repeated over each of its bitmap words."""
  return tf.concat([tf.fill([blocks], tf.cast(v, tf.int32))
                    for v, blocks in zip(values, lay.blocks)], 0)


def _kept_words(words, lay: Layout):
  """Each tensor's selection bitmap with its own capacity applied (its lowest
  positions), with one cumulative sum over the whole buffer."""
  if all(cap >= n for cap, n in zip(lay.caps, lay.sizes)):
    return words
  offsets = compaction.cumsum(compaction.popcount(words), exclusive=True)
  starts = [offsets[o // compaction.WORD_BITS] if blocks else 0
            for o, blocks in zip(lay.offsets, lay.blocks)]
  own_offsets = offsets - _per_word(starts, lay)
  return compaction.keep_lowest_set_bits(
      words, tf.maximum(_per_word(lay.caps, lay) - own_offsets, 0))


def _unary_counts(words, count, lay: Layout):
  """int32 words of the bins' sent counts in unary, every bin of every tensor in order:
  ``c_b`` ones then a zero for bin ``b``, ``sum(bins) + count`` bits in all."""
  sent = tf.cast(tf.reshape(compaction.unpack_mask(words), [-1]), tf.int32)
  per_bin = []
  for n, o, bins in zip(lay.sizes, lay.offsets, lay.bins):
    if bins:
      own = tf.pad(sent[o:o + n], [[0, bins * lay.bin_size - n]])
      per_bin.append(tf.reduce_sum(tf.reshape(own, [bins, lay.bin_size]), 1))
  nwords = -(-lay.unary_bits // 32)
  if not per_bin:
    return tf.zeros([nwords], tf.int32)
  bins = sum(lay.bins)
  # Bin b's closing zero comes after the ones of bins 0..b and the zeros of bins 0..b-1.
  stops = compaction.cumsum(tf.concat(per_bin, 0)) + tf.range(bins, dtype=tf.int32)
  # Distinct bits: their sum within a word is their bitwise or (int32 wraps bit 31).
  stop_words = tf.scatter_nd(stops[:, None] // 32,
                             tf.bitwise.left_shift(tf.ones([bins], tf.int32), stops % 32),
                             [nwords])
  return tf.bitwise.bitwise_xor(_low_bits_set(bins + count, nwords), stop_words)


def _low_bits_set(length, nwords: int):
  """int32 words whose first ``length`` stream bits are ones and the rest zeros."""
  room = tf.clip_by_value(length - 32 * tf.range(nwords, dtype=tf.int32), 0, 32)
  part = tf.bitwise.left_shift(tf.ones([nwords], tf.int32), tf.minimum(room, 31)) - 1
  return tf.where(room >= 32, tf.fill([nwords], tf.constant(-1, tf.int32)), part)


def body_used_words(count, lay: Layout):
  """Words of a body that carry its ``count`` codes (and, with ``positions="bin"`` or
  ``"elias_fano"``, the unary counts after them): what must be sent."""
  count = tf.cast(count, tf.int64)
  if lay.positions == "elias_fano":
    low_bits = elias_fano_low_bits(count, lay)
    return _elias_fano_words(count, low_bits + 1, _buckets(low_bits, lay))
  used = (count * lay.bits + 31) // 32
  if lay.positions == "bin":
    used += (sum(lay.bins) + count + 31) // 32
  return used


# ----------------------------------------------------- positions="elias_fano"
#
# The sent positions, as places among all the bucket's elements (tensor after tensor,
# ``Layout.starts``), form one increasing sequence; Elias-Fano splits each place into
# its ``low_bits`` low bits, sent in the code beside the sign, and its high part, the
# bucket of ``2**low_bits`` places it falls in, sent in unary: one 1 per code of a
# bucket, then a 0. ``positions="bin"`` is the same code with buckets of L_T places
# restarted at each tensor; a width chosen from the count fits the codes' real spacing
# (about ``universe / count``): on Adam's flat updates a bin of 500 sends ten codes,
# and a 9-bit offset wastes four bits of each.


def _buckets(low_bits, lay: Layout):
  """int64: buckets of ``2**low_bits`` places that cover the universe."""
  low_bits = tf.cast(low_bits, tf.int64)
  return tf.bitwise.right_shift(lay.universe + tf.bitwise.left_shift(
      tf.constant(1, tf.int64), low_bits) - 1, low_bits)


def _elias_fano_words(count, bits, buckets):
  """Words of ``count`` codes of ``bits`` bits, then ``buckets + count`` unary bits."""
  return (count * bits + 31) // 32 + (buckets + count + 31) // 32


def elias_fano_low_bits(count, lay: Layout):
  """int64: the low bits whose body takes the fewest words for ``count`` codes (an int
  tensor of any shape; the smallest of equals), in ``[0, lay.max_low_bits]``, among
  those whose unary counts take at most ``lay.unary_bits`` bits (those of
  ``positions="bin"``: the decoder's arrays stay that size; only rows of nearly their
  capacity are held to longer codes by it).

  ``lay.bits - 1`` (a bin's offset, or the largest tensor's index) is among the
  candidates (its buckets of ``2**(bits - 1)`` places are no more than the bins), and
  its body fits the static buffer (``Layout.body_words``), so the smallest one does too.
  """
  low_bits = tf.range(lay.max_low_bits + 1, dtype=tf.int64)
  count = tf.cast(count, tf.int64)[..., None]
  buckets = _buckets(low_bits, lay)
  words = tf.where(buckets + count <= lay.unary_bits,
                   _elias_fano_words(count, low_bits + 1, buckets), lay.body_words + 1)
  return tf.argmin(words, axis=-1, output_type=tf.int64)


def _elias_fano_body(words, signs, slots: int, count, low_bits, lay: Layout):
  """The body of ``count`` codes (at most ``slots``) with ``low_bits``: the codes
  packed from bit 0, the unary high parts from the word after the last code, in one
  scatter of disjoint bits."""
  nwords = lay.body_words
  positions, _, _ = compaction.select_positions(words, slots)
  negative = tf.bitwise.bitwise_and(
      tf.bitwise.right_shift(tf.gather(signs, positions // compaction.WORD_BITS),
                             tf.cast(positions % compaction.WORD_BITS, tf.uint32)), 1)
  tensor = _tensor_of(positions, lay)
  place = (tf.cast(positions, tf.int64) - tf.gather(tf.constant(lay.offsets, tf.int64), tensor)
           + tf.gather(tf.constant(lay.starts, tf.int64), tensor))
  ordinal = tf.range(slots, dtype=tf.int64)
  live = ordinal < tf.cast(count, tf.int64)
  low = tf.bitwise.bitwise_and(
      place, tf.bitwise.left_shift(tf.constant(1, tf.int64), low_bits) - 1)
  codes = tf.bitwise.bitwise_or(tf.bitwise.left_shift(low, 1), tf.cast(negative, tf.int64))
  bits = low_bits + 1
  code_ids, code_values = bitpack.pack_at(codes, bits, live, nwords)
  # The j-th one of the unary stream is at bit (its bucket) + j.
  one = 32 * ((tf.cast(count, tf.int64) * bits + 31) // 32) + (
      tf.bitwise.right_shift(place, low_bits) + ordinal)
  one_ids = tf.where(live, tf.bitwise.right_shift(one, 5), nwords)
  one_values = tf.where(live, tf.bitwise.left_shift(
      tf.constant(1, tf.int64), tf.bitwise.bitwise_and(one, 31)), 0)
  return tf.bitcast(bitpack.scatter_words(tf.concat([code_ids, one_ids], 0),
                                          tf.concat([code_values, one_values], 0), nwords),
                    tf.int32)


def _from_elias_fano(low, bucket, low_bits, lay: Layout):
  """Positions within their tensors of codes with ``low`` bits in ``bucket``, and the
  tensor each lies in (-1 for a place outside the universe: only a corrupt row has
  them)."""
  low_bits = tf.cast(low_bits, tf.int64)
  buckets = _buckets(low_bits, lay)
  bucket = tf.cast(bucket, tf.int64)
  place = tf.bitwise.bitwise_or(
      tf.bitwise.left_shift(tf.clip_by_value(bucket, 0, buckets), low_bits),
      tf.cast(low, tf.int64))
  tensor = tf.reduce_sum(tf.cast(
      place[:, None] >= tf.constant(lay.starts[1:], tf.int64)[None], tf.int32), 1)
  local = place - tf.gather(tf.constant(lay.starts, tf.int64), tensor)
  ok = (bucket >= 0) & (bucket < buckets) & (place < lay.universe)
  return tf.cast(tf.where(ok, local, 0), tf.int32), tf.where(ok, tensor, -1)


def _joined(codes, unary, count, lay: Layout):
  """The codes' words, then the unary counts from the word after the last used code."""
  if not int(unary.shape[0]):
    return codes
  code_words = int(codes.shape[0])
  start = (count * lay.bits + 31) // 32
  k = tf.range(code_words + int(unary.shape[0]), dtype=tf.int32)
  padded_codes = tf.pad(codes, [[0, int(unary.shape[0])]])
  from_unary = tf.gather(unary, tf.clip_by_value(k - start, 0, max(int(unary.shape[0]) - 1, 0)))
  inside = (k >= start) & (k - start < int(unary.shape[0]))
  return tf.where(k < start, padded_codes, tf.where(inside, from_unary, tf.zeros_like(k)))


def _tensor_of(positions, lay: Layout):
  """Which tensor each buffer position lies in: one comparison per tensor boundary."""
  return tf.reduce_sum(tf.cast(positions[:, None] >= tf.constant(lay.offsets[1:], tf.int32),
                               tf.int32), 1)


def _packed_codes(words, signs, cap: int, count, bits: int, index_of=None):
  """The bit-packed codes of the sent elements, as int32 words for ``cap`` codes.

  Compaction and packing cost grows with the number of slots, and AdaComp usually
  selects a few percent of a tensor: the smallest tier (1/128 or 1/16 of the positions,
  or the capacity) that holds the ``count`` sent codes is the one encoded, and the rest
  of the buffer is zeros. The branches take only bitmaps (``words``, what is sent, and
  ``signs``, G < 0), n/32 words each: XLA:CPU copies a conditional's operands into it.
  ``index_of`` maps buffer positions to the index a code carries (with several tensors,
  the position within its own); by default they are the same.

  The GPU form (``ops.variant``) has no conditional up to ``GPU_FULL_ENCODE_MAX_SLOTS``
  slots: it encodes every slot; the slots past ``count`` are zeros in every form, so the
  words are the same.
  """
  full_words = bitpack.packed_words(cap, bits)

  def encode(slots):
    positions, _, _ = compaction.select_positions(words, slots)
    negative = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(tf.gather(signs, positions // compaction.WORD_BITS),
                               tf.cast(positions % compaction.WORD_BITS, tf.uint32)), 1)
    index = positions if index_of is None else index_of(positions)
    codes = tf.bitwise.bitwise_or(tf.bitwise.left_shift(tf.cast(index, tf.uint32), 1), negative)
    # Zeros after the sent codes: the slots past them would read position 0's sign.
    codes = tf.where(tf.range(slots) < count, codes, tf.zeros_like(codes))
    packed = tf.bitcast(bitpack.pack(codes, bits), tf.int32)
    return tf.pad(tf.reshape(packed, [-1]), [[0, full_words - int(packed.shape[0])]])

  return _by_tier(encode, words, cap, count, 0)


def _by_tier(encode, words, cap: int, count, empty_words: int):
  """``encode(slots)`` for as many slots as the tier of ``count`` holds (every slot of
  the capacity in the GPU form); ``empty_words`` zeros when nothing can be sent."""
  if cap == 0:
    return tf.zeros([empty_words], tf.int32)
  if variant.gpu_form(words) and cap <= GPU_FULL_ENCODE_MAX_SLOTS:
    return encode(cap)
  return _in_smallest_tier(encode, count, cap, int(words.shape[0]) * compaction.WORD_BITS)


def _in_smallest_tier(fn, count, cap: int, positions: int):
  """``fn(slots)`` for the smallest tier (1/128 or 1/16 of ``positions``, or ``cap``)
  that holds ``count``, chosen by a chain of conditionals."""
  tiers = sorted({min(cap, -(-positions // d)) for d in SLOT_TIERS} | {cap})

  def smallest_tier_from(i):
    if i == len(tiers) - 1:
      return fn(tiers[i])
    return tf.cond(count <= tiers[i], lambda: fn(tiers[i]), lambda: smallest_tier_from(i + 1))

  return smallest_tier_from(0)


def bfloat16_words(scales16):
  """bfloat16 scales as int32 words, two per word: scale ``2k`` in the low half of word
  ``k``, ``2k + 1`` in its high half (0 when their number is odd)."""
  padded = tf.pad(scales16, [[0, int(scales16.shape[0]) % 2]])
  return tf.bitcast(tf.reshape(padded, [-1, 2]), tf.int32)


def bfloat16_scales(words, count: int, dtype: tf.DType):
  """The first ``count`` bfloat16 scales of ``bfloat16_words``, cast to ``dtype``."""
  return tf.cast(tf.reshape(tf.bitcast(words, tf.bfloat16), [-1])[:count], dtype)


# -------------------------------------------------------------------------- decode


class Row(NamedTuple):
  """One payload row as a wire format reads it, for ``decode``.

  Attributes:
    count: int32, the row's codes.
    counts: int32 ``[tensors]``, each tensor's codes (negative: none).
    scales: the row's scales in the compute dtype: ``[tensors]`` tensor scales, or with
      ``scale="bin"`` every tensor's bin scales, tensor by tensor.
    codes: uint32 words, the bit-packed codes.
    bad: bool, the row does not match what the decoder expects: every tensor decodes
      to NaN.
    bad_tensors: one bool per tensor: that tensor decodes to NaN.
    bits: int32, the row's code width (``positions="elias_fano"``: read from the row,
      in ``[1, lay.max_low_bits + 1]``); None: ``Layout.bits``.
  """
  count: tf.Tensor
  counts: tf.Tensor
  scales: tf.Tensor
  codes: tf.Tensor
  bad: tf.Tensor
  bad_tensors: List[tf.Tensor]
  bits: tf.Tensor = None


def decode(payload, lay: Layout, shapes, dtype: tf.DType,
           read_row: Callable[[tf.Tensor, tf.DType], Row]) -> List[tf.Tensor]:
  """Sum, row by row in row order, of the tensors that payload rows carry.

  To be called inside a compiled kernel; ``read_row`` reads one row's words in its wire
  format.

  Args:
    payload: int32 ``[words]`` or ``[rows, words]``.
    lay: the tensors' ``Layout``.
    shapes: the static shape of each tensor.
    dtype: float dtype of the results.
    read_row: ``(row, compute dtype) -> Row``.

  Returns:
    One tensor of ``dtype`` per shape: the sum of the rows' ternary values, NaN where a
    row was bad for it.
  """
  rows = payload if payload.shape.rank == 2 else payload[None]
  cd = checks.compute_dtype(dtype)
  total, bad = tf.zeros([lay.total + 1], cd), tf.constant(False)
  bad_tensors = [tf.constant(False)] * len(lay.sizes)
  # A fixed, sequential order over rows (replicas): every replica adds the same floats
  # in the same order and gets a bit-identical sum.
  for i in range(int(rows.shape[0])):
    row = read_row(rows[i], cd)
    total = add_codes(total, row.codes, row.count, row.counts, row.scales, lay, row.bits)
    bad |= row.bad
    bad_tensors = [x | y for x, y in zip(bad_tensors, row.bad_tensors)]
  # NaN for a bad row, so that loss scaling and finiteness checks see it.
  nan = tf.constant(float("nan"), cd)
  return [tf.reshape(tf.cast(tf.where(bad | bad_t, nan, total[o:o + n]), dtype), shape)
          for shape, n, o, bad_t in zip(shapes, lay.sizes, lay.offsets, bad_tensors)]


def add_codes(total, words, count, counts, scales, lay: Layout, row_bits=None):
  """``total`` (``[lay.total + 1]``, the last element a sink) plus one row's codes.

  Codes come tensor by tensor, ``counts[t]`` of them for tensor ``t``, each carrying a
  position within its tensor, and add ``±scale`` there (its tensor's scale, or with
  ``scale="bin"`` its bin's; ``scales`` as ``Row.scales``). A tensor takes only its own
  codes, at most its capacity of them, and only positions inside it: with corrupt counts
  (above a tensor's capacity, adding up to more or less than ``count``, or ``count``
  above ``lay.cap``; the caller marks such rows NaN) no code is read into a tensor from
  beyond its own, and neither the spare bits of the last word nor the zero padding of the
  last chunk (which would decode as codes for position 0) are read as codes.

  A while loop unpacks and adds ``DECODE_CHUNK`` codes per iteration, for as many
  iterations as ``count`` needs (the codes are packed in order): decoding costs the codes
  sent, not the capacity, plus the zero fill of ``total``. The GPU form (``ops.variant``)
  adds every chunk at once, with no loop. A loop rather than tiers of a
  conditional: with ``total`` passing through a switch, XLA:CPU copied the sum into and
  out of the conditional, which cost more than the decoding (docs/performance.md). A
  row's positions are distinct, so adding them in chunks equals adding them at once, and
  adding a row's values to the running sum equals adding a dense copy of the row
  (``x + (0 + v) == x + v`` in floating point).

  Args:
    total: ``[lay.total + 1]`` float, the running sum.
    words: uint32 words of the packed codes (any length; missing words read as 0).
    count: int32, the row's codes.
    counts: int32 ``[tensors]``, each tensor's codes (negative: none).
    scales: float ``[tensors]`` or ``[bins of all tensors]``, of ``total``'s dtype.
    lay: the ``Layout``.
    row_bits: ``Row.bits``: with ``positions="elias_fano"``, the row's code width.

  Returns:
    The new ``total``.
  """
  cap, bits = lay.cap, lay.bits
  chunk = min(DECODE_CHUNK, -(-cap // 32) * 32)
  if chunk == 0:
    return total
  chunk_words = chunk * bits // 32
  iterations = -(-cap // chunk)
  # Zero words after the last chunk: a dynamic slice past the end would be clamped
  # (shifted back), not cut.
  padded = tf.pad(words, [[0, max(iterations * chunk_words - int(words.shape[0]), 0)]])
  steps = (tf.clip_by_value(count, 0, cap) + chunk - 1) // chunk
  elias_fano = lay.positions == "elias_fano"
  if elias_fano:
    # A corrupt width (the caller marks its row NaN) is clipped to one the code can hold.
    row_bits = tf.clip_by_value(row_bits, 1, lay.max_low_bits + 1)
    buckets = tf.cast(tf.minimum(_buckets(row_bits - 1, lay), lay.unary_bits), tf.int32)
  ranks = (_unary_ranks(words, count, lay, row_bits)
           if lay.positions in ("bin", "elias_fano") else None)

  def add(i, total, chunks=1):  # chunks i, ..., i + chunks - 1
    if elias_fano:
      codes = bitpack.unpack_at(words, i * chunk, chunks * chunk, row_bits)
    else:
      codes = bitpack.unpack(tf.slice(padded, [i * chunk_words], [chunks * chunk_words]),
                             chunks * chunk, bits)
    local = tf.cast(tf.bitwise.right_shift(codes, 1), tf.int32)
    ordinals = i * chunk + tf.range(chunks * chunk, dtype=tf.int32)
    if elias_fano:  # local is the low bits of the code's place, its bucket in unary
      high = _bins_of_codes(ordinals, *ranks, buckets, lay.unary_bits)
      local, in_bin = _from_elias_fano(local, high, row_bits - 1, lay)
    elif ranks is not None:  # local is the offset in the code's bin
      bins = sum(lay.bins)
      local, in_bin = _from_bin(local, _bins_of_codes(ordinals, *ranks, bins, bins), lay)
    tensor, inside = _locate(ordinals, local, counts, lay)
    if ranks is not None:
      inside &= in_bin == tensor
    # min(count, cap): a corrupt count above the capacity must not turn the padding
    # after it into codes.
    valid = (ordinals < tf.minimum(count, cap)) & inside
    local = tf.where(valid, local, 0)
    if lay.scale == "bin":
      magnitude = tf.gather(scales, tf.gather(tf.constant(lay.bin_offsets, tf.int32), tensor)
                            + local // lay.bin_size)
    else:
      magnitude = tf.gather(scales, tensor)
    values = tf.where(tf.bitwise.bitwise_and(codes, 1) > 0, -magnitude, magnitude)
    positions = tf.gather(tf.constant(lay.offsets, tf.int32), tensor) + local
    return i + 1, tf.tensor_scatter_nd_add(total, tf.where(valid, positions, lay.total)[:, None],
                                           tf.where(valid, values, tf.zeros_like(values)))

  if variant.gpu_form(total):
    return add(tf.constant(0), total, chunks=iterations)[1]
  _, total = tf.while_loop(lambda i, _: i < steps, add, (tf.constant(0), total),
                           maximum_iterations=iterations)
  return total


def _unary_words(words, count, lay: Layout, row_bits=None):
  """The unary counts of a ``positions="bin"`` or ``"elias_fano"`` body (uint32
  ``words``), read from the word after its last code (of ``row_bits`` bits with
  ``"elias_fano"``); ``Layout.unary_bits`` bits, rounded up to words."""
  count = tf.clip_by_value(count, 0, lay.cap)
  nwords = -(-lay.unary_bits // 32)
  if lay.positions == "elias_fano":
    widest = lay.max_low_bits + 1
    start = (count * row_bits + 31) // 32
  else:
    widest = lay.bits
    start = (count * lay.bits + 31) // 32
  room = bitpack.packed_words(lay.cap, widest) + nwords - int(words.shape[0])
  padded = tf.pad(words, [[0, max(room, 0)]])
  # A gather, not tf.slice: XLA takes a slice's start as a compile-time constant, and a
  # start that follows the count would compile a new program for every count.
  return tf.gather(padded, start + tf.range(nwords, dtype=start.dtype))


def unary_mismatch(words, count, lay: Layout, row_bits=None):
  """bool: a corrupt row. With ``positions="bin"``: unary counts that do not hold
  exactly ``count`` ones and ``sum(bins)`` zeros in their first ``sum(bins) + count``
  bits. With ``"elias_fano"``: a width ``row_bits`` outside ``[1, max_low_bits + 1]``,
  a body longer than the buffer or unary counts longer than ``Layout.unary_bits``, or
  unary counts without exactly ``count`` ones in their first ``buckets + count`` bits.
  False for ``positions="tensor"``."""
  if lay.positions == "elias_fano":
    clipped = tf.clip_by_value(row_bits, 1, lay.max_low_bits + 1)
    unary = _unary_words(words, count, lay, clipped)
    nwords = int(unary.shape[0])
    count64 = tf.cast(tf.clip_by_value(count, 0, lay.cap), tf.int64)
    buckets = _buckets(clipped - 1, lay)
    length = tf.minimum(buckets + count64, 32 * nwords + 1)
    used = tf.bitcast(_low_bits_set(tf.cast(length, tf.int32), nwords), tf.uint32)
    return ((row_bits != clipped) | (buckets + count64 > lay.unary_bits)
            | (_elias_fano_words(count64, tf.cast(clipped, tf.int64), buckets) > lay.body_words)
            | (tf.reduce_sum(compaction.popcount(tf.bitwise.bitwise_and(unary, used))) != count))
  if lay.positions != "bin" or not lay.unary_bits:
    return tf.constant(False)
  unary = _unary_words(words, count, lay)
  nwords = int(unary.shape[0])
  used = tf.bitcast(_low_bits_set(sum(lay.bins) + tf.clip_by_value(count, 0, lay.cap), nwords),
                    tf.uint32)
  return tf.reduce_sum(compaction.popcount(tf.bitwise.bitwise_and(unary, used))) != count


def _unary_ranks(words, count, lay: Layout, row_bits=None):
  """The unary counts of a ``positions="bin"`` or ``"elias_fano"`` body (uint32 words)
  and, for each of their words, the ones before it: what ``_bins_of_codes`` searches."""
  unary = _unary_words(words, count, lay, row_bits)
  return unary, compaction.cumsum(compaction.popcount(unary), exclusive=True)


def _bins_of_codes(ordinals, unary, before, bins, most_bins: int):
  """The bin (among all the tensors' bins; with ``positions="elias_fano"``, the bucket)
  of each code ``ordinals`` (its place in the row, below the row's count): the ``j``-th
  one of the unary counts, at stream bit ``p``, has ``p - j`` closing zeros before it.
  Its word is the last one with at most ``j`` ones before it: a binary search over
  ``before`` (one gather per halving), among the words of bits ``j`` to ``j + bins``
  (the ``bins`` zeros are all the bits that are not ones; with ``"elias_fano"`` the
  row's buckets, a tensor, at most ``most_bins``), then the bit within the word. Per
  chunk of codes and with no conditional: selecting the ones' positions in tiers of
  slots, as the encoder does, made the decoder three times the program to compile."""
  n = int(before.shape[0])

  def halve(lo, hi):  # lo: the first word with more than j ones before it
    mid = tf.bitwise.right_shift(lo + hi, 1)  # not //: XLA floors a signed division
    below = (tf.gather(before, tf.minimum(mid, n - 1)) <= ordinals) & (lo < hi)
    return tf.where(below, mid + 1, lo), tf.where(below | (lo >= hi), hi, mid)

  first = tf.bitwise.right_shift(ordinals, 5)  # the word of bit j (32 bits a word)
  bounds = (tf.minimum(first, n), tf.minimum(first + (bins // 32 + 2), n))
  halvings = (most_bins // 32 + 2).bit_length()
  if variant.gpu_form(ordinals):  # no control flow in the GPU form
    for _ in range(halvings):
      bounds = halve(*bounds)
    lo = bounds[0]
  else:
    # A loop on CPU, not unrolled halvings: XLA's fusion copied each halving's lo and
    # hi into every later one, and the decoder grew by thousands of instructions. It
    # stops when every search has (a row of few buckets needs fewer halvings).
    lo, _ = tf.while_loop(lambda lo, hi: tf.reduce_any(lo < hi), halve, bounds,
                          maximum_iterations=halvings)
  word = tf.maximum(lo - 1, 0)
  bit = compaction.nth_set_bit(tf.gather(unary, word), ordinals - tf.gather(before, word))
  return word * compaction.WORD_BITS + bit - ordinals


def _from_bin(offset, code_bin, lay: Layout):
  """Positions within their tensors of codes that carry an ``offset`` in bin
  ``code_bin``, and the tensor each bin belongs to (-1 for an offset outside a bin or a
  negative bin: only a corrupt row has them)."""
  bin_offsets = tf.constant(lay.bin_offsets, tf.int32)
  tensor = tf.reduce_sum(tf.cast(code_bin[:, None] >= bin_offsets[None, 1:], tf.int32), 1)
  local = (code_bin - tf.gather(bin_offsets, tensor)) * lay.bin_size + offset
  return local, tf.where((offset < lay.bin_size) & (code_bin >= 0), tensor, -1)


def _locate(ordinals, local, counts, lay: Layout):
  """The tensor of each code of a row (by its ordinal ``ordinals`` and the counts), and
  whether it is one of that tensor's own codes, within its capacity, at a position
  ``local`` inside it."""
  tensors = len(lay.sizes)
  counts = tf.maximum(counts, 0)
  ends = tf.cumsum(counts)
  tensor = tf.minimum(tf.reduce_sum(tf.cast(ordinals[:, None] >= ends, tf.int32), 1),
                      tensors - 1)
  own = ordinals - tf.gather(ends - counts, tensor)  # the code's ordinal in its tensor
  inside = ((ordinals < ends[-1]) & (own < tf.gather(tf.constant(lay.caps, tf.int32), tensor))
            & (local < tf.gather(tf.constant(lay.sizes, tf.int32), tensor)))
  return tensor, inside
