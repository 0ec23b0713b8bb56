"""AdaComp (Chen et al., AAAI 2018) compress and decode kernels, compiled with XLA.

Per tensor, with residue R and new gradient dW (docs/algorithms.md#adacomp):

    G = R + dW;  H = G + dW
    gmax[b] = max |G| over bin b of ``bin_size`` consecutive elements of the flat tensor
    S = {i : |H_i| >= gmax[bin(i)]}
    scale = mean(gmax);  Q_i = sign(G_i) * scale on S, else 0;  R <- G - Q

Two choices of this implementation, neither of which changes Q:
- elements with G_i == 0 are not sent: their Q_i is sign(0) * scale = 0 anyway (this
  keeps an all-zero bin, where every |H_i| >= 0 = gmax, from sending every element);
- a payload has a static capacity (``max_density`` of the elements, all by default); if
  more are selected, the first ones (lowest positions) are sent and the rest stay in
  R.

Wire format (docs/wire_format.md): int32 words
``[count, scale (float32 bits), bits, packed codes...]`` where each code is
``position << 1 | (G < 0)`` in ``bits = index_bits(n) + 1`` bits.

``scale="bin"`` (an option; "tensor" above is the default): every bin has its own scale,
its maximum ``gmax[b]`` rounded to bfloat16, and ``Q_i = sign(G_i) * scale[bin(i)]``. The
payload is then ``[count, 0 (NaN: not finite), bits | BIN_SCALE_FLAG, bins,
ceil(bins / 2) words of bfloat16 scales, packed codes...]``.
"""

import math

import tensorflow as tf

from tf_adacomp.ops import bitpack
from tf_adacomp.ops import checks
from tf_adacomp.ops import compiled
from tf_adacomp.ops import compaction

HEADER_WORDS = 3
# scale="bin": one more header word (the number of bins), then the bins' bfloat16 scales.
BIN_HEADER_WORDS = 4
BIN_SCALE_FLAG = 1 << 8  # or-ed into the bits word of a scale="bin" payload
SCALES = ("tensor", "bin")
# Smaller encoder tiers, as fractions 1/d of the elements (see _packed_codes).
SLOT_TIERS = (128, 16)
# Codes the decoder unpacks and adds per loop iteration (see _add_codes); a multiple of
# 32, so that every chunk starts on a word boundary whatever the code width.
DECODE_CHUNK = 2048


def index_bits(num_elements: int) -> int:
  """Bits needed for a position in a tensor of ``num_elements`` (0 for 0 or 1 element)."""
  return max(num_elements - 1, 0).bit_length()


def capacity(num_elements: int, max_density: float) -> int:
  """Static number of elements one payload can carry."""
  if num_elements == 0:
    return 0
  return max(1, min(num_elements, math.ceil(max_density * num_elements)))


def num_bins(num_elements: int, bin_size: int) -> int:
  """Bins of ``bin_size`` elements (the last may be short) in a tensor."""
  return -(-num_elements // bin_size)


def scale_words(num_elements: int, bin_size: int) -> int:
  """int32 words of a scale="bin" payload's bfloat16 scales (two per word)."""
  return -(-num_bins(num_elements, bin_size) // 2)


def check_scale(scale, bin_size=None) -> str:
  """Returns ``scale`` if it is one of ``SCALES``, else raises ValueError naming it."""
  if not isinstance(scale, str) or scale not in SCALES:
    raise ValueError(f"`scale` must be one of {SCALES}. Received: scale={scale!r}")
  if scale == "bin" and bin_size is None:
    raise ValueError("`bin_size` is needed with scale='bin' (it maps positions to bins). "
                     "Received: bin_size=None")
  return scale


def _header_words(num_elements: int, scale: str, bin_size) -> int:
  if scale == "bin":
    return BIN_HEADER_WORDS + scale_words(num_elements, bin_size)
  return HEADER_WORDS


def payload_words(num_elements: int, max_density: float = 1.0, scale: str = "tensor",
                  bin_size=None) -> int:
  """Static length in int32 words of the payload for a tensor of ``num_elements``
  (``bin_size`` is needed, and only used, with ``scale="bin"``)."""
  check_scale(scale, bin_size)
  bits = index_bits(num_elements) + 1
  return (_header_words(num_elements, scale, bin_size)
          + bitpack.packed_words(capacity(num_elements, max_density), bits))


def _compress(grad, residue, bin_size: int, cap: int, per_bin: bool = False):
  if per_bin:
    return _compress_per_bin(grad, residue, bin_size, cap)
  n = grad.shape.num_elements()
  bits = index_bits(n) + 1
  cd = checks.compute_dtype(grad.dtype, residue.dtype)
  dw = tf.cast(tf.reshape(grad, [-1]), cd)
  r = tf.cast(tf.reshape(residue, [-1]), cd)
  g = r + dw
  h = g + dw

  # NaN is counted as inf, so that the bin maxima reveal any non-finite element of G
  # without a separate pass over it (XLA's max does not propagate NaN).
  gmax = _bin_maxima(tf.where(tf.math.is_nan(g), tf.constant(float("inf"), cd), tf.abs(g)),
                     bin_size)
  # One scale per tensor, rounded to the float32 that goes on the wire, so that the
  # receiver decodes exactly the Q subtracted here.
  scale32 = _mean_as_float32(gmax) if n else tf.zeros([], tf.float32)
  scale = tf.cast(scale32, cd)
  # A non-finite G or a scale that float32 cannot hold: nothing is sent and R is kept.
  finite = tf.math.is_finite(scale32) & tf.reduce_all(tf.math.is_finite(gmax))

  element = tf.range(n, dtype=tf.int32)
  selected = (tf.abs(h) >= tf.gather(gmax, element // bin_size)) & tf.not_equal(g, 0) & finite
  blocks = compaction.blocks_for(n)
  words = compaction.pack_mask(compaction.to_words(selected, blocks))
  # G's signs as a bitmap (streamed in the same pass): the encoder reads only the bits
  # of the sent positions, and its branches get n/32 words, not G.
  signs = compaction.pack_mask(compaction.to_words(g < 0, blocks))
  total = tf.reduce_sum(compaction.popcount(words))
  count = tf.minimum(total, cap)

  if cap < n:
    # When more is selected than the payload holds, what is left out stays in R.
    words = compaction.kept_words(words, cap)
  sent = tf.reshape(compaction.unpack_mask(words), [-1])[:n]
  q = tf.where(g < 0, -scale, scale)
  new_residue = tf.where(finite, tf.where(sent, g - q, g), r)

  nan = tf.constant(float("nan"), tf.float32)
  header = tf.stack([
      count,
      tf.bitcast(tf.where(finite, scale32, nan), tf.int32),
      tf.constant(bits, tf.int32),
  ])
  payload = tf.concat([header, _packed_codes(words, signs, cap, total, bits)], axis=0)
  return payload, tf.reshape(tf.cast(new_residue, residue.dtype), residue.shape)


def _compress_per_bin(grad, residue, bin_size: int, cap: int):
  """scale="bin": as ``_compress``, with each bin's own bfloat16-rounded maximum as its
  scale."""
  n = grad.shape.num_elements()
  bits = index_bits(n) + 1
  bins = num_bins(n, bin_size)
  cd = checks.compute_dtype(grad.dtype, residue.dtype)
  dw = tf.cast(tf.reshape(grad, [-1]), cd)
  r = tf.cast(tf.reshape(residue, [-1]), cd)
  g = r + dw
  h = g + dw

  gmax = _bin_maxima(tf.where(tf.math.is_nan(g), tf.constant(float("inf"), cd), tf.abs(g)),
                     bin_size)
  # The scales on the wire: float32 first (float64 maxima round there, as the tensor
  # scale does), then bfloat16, round to nearest even both times; the receiver decodes
  # exactly the Q subtracted here.
  scales16 = tf.cast(tf.cast(gmax, tf.float32), tf.bfloat16)
  scales = tf.cast(scales16, cd)
  # A non-finite G, or a maximum that bfloat16 cannot hold: nothing is sent, R is kept.
  finite = tf.reduce_all(tf.math.is_finite(scales))

  element = tf.range(n, dtype=tf.int32)
  element_scale = tf.gather(scales, element // bin_size)
  # A bin whose scale rounds to 0 would send codes worth nothing: it sends none.
  selected = ((tf.abs(h) >= tf.gather(gmax, element // bin_size)) & tf.not_equal(g, 0)
              & (element_scale > 0) & finite)
  blocks = compaction.blocks_for(n)
  words = compaction.pack_mask(compaction.to_words(selected, blocks))
  # G's signs as a bitmap (streamed in the same pass): the encoder reads only the bits
  # of the sent positions, and its branches get n/32 words, not G.
  signs = compaction.pack_mask(compaction.to_words(g < 0, blocks))
  total = tf.reduce_sum(compaction.popcount(words))
  count = tf.minimum(total, cap)

  if cap < n:
    words = compaction.kept_words(words, cap)
  sent = tf.reshape(compaction.unpack_mask(words), [-1])[:n]
  q = tf.where(g < 0, -element_scale, element_scale)
  new_residue = tf.where(finite, tf.where(sent, g - q, g), r)

  nan = tf.constant(float("nan"), tf.float32)
  header = tf.stack([
      count,
      tf.bitcast(tf.where(finite, tf.zeros([], tf.float32), nan), tf.int32),
      tf.constant(bits | BIN_SCALE_FLAG, tf.int32),
      tf.constant(bins, tf.int32),
  ])
  scale_body = tf.bitcast(tf.reshape(tf.pad(scales16, [[0, 2 * scale_words(n, bin_size) - bins]]),
                                     [-1, 2]), tf.int32)
  payload = tf.concat([header, scale_body, _packed_codes(words, signs, cap, total, bits)],
                      axis=0)
  return payload, tf.reshape(tf.cast(new_residue, residue.dtype), residue.shape)


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


def _packed_codes(words, signs, cap: int, total, bits: int, index_of=None):
  """The bit-packed codes of the sent elements, as int32 words for ``cap`` codes.

  Compaction and packing cost grows with the number of slots, and AdaComp usually
  selects a few percent of a tensor: the smallest tier (1/128 or 1/16 of the elements,
  or the capacity) that holds the selection is the one encoded, and the rest of the
  buffer is zeros. The branches take only bitmaps (``words``, the selection, and
  ``signs``, G < 0), n/32 words each: XLA:CPU copies a conditional's operands into it.
  ``index_of`` maps the bitmap's positions to the index a code carries (a bucket sends
  positions within each tensor); by default they are the same.
  """
  full_words = bitpack.packed_words(cap, bits)

  def encode(slots):
    positions, _, _ = compaction.select_positions(words, slots)
    negative = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(tf.gather(signs, positions // compaction.WORD_BITS),
                               tf.cast(positions % compaction.WORD_BITS, tf.uint32)), 1)
    index = positions if index_of is None else index_of(positions)
    codes = tf.bitwise.bitwise_or(tf.bitwise.left_shift(tf.cast(index, tf.uint32), 1), negative)
    packed = tf.bitcast(bitpack.pack(codes, bits), tf.int32)
    return tf.pad(tf.reshape(packed, [-1]), [[0, full_words - int(packed.shape[0])]])

  if cap == 0:
    return tf.zeros([0], tf.int32)
  n = int(words.shape[0]) * compaction.WORD_BITS
  tiers = sorted({min(cap, -(-n // d)) for d in SLOT_TIERS} | {cap})

  def smallest_tier_from(i):
    if i == len(tiers) - 1:
      return encode(tiers[i])
    return tf.cond(total <= tiers[i], lambda: encode(tiers[i]),
                   lambda: smallest_tier_from(i + 1))

  return smallest_tier_from(0)


def _mean_as_float32(values):
  """Mean of non-negative values, in float64 and scaled by their maximum so that the sum
  cannot overflow, rounded to float32 (inf when the mean exceeds float32's range)."""
  values = tf.cast(values, tf.float64)
  top = tf.reduce_max(values)
  safe_top = tf.where(top > 0, top, tf.ones_like(top))
  return tf.cast(safe_top * tf.reduce_mean(values / safe_top), tf.float32)


def _add_codes(total, words, count, n: int, cap: int, bits: int, values_at, locate=None):
  """``total`` (``[n + 1]``, the last element a sink) plus one payload's codes:
  ``values_at(positions, negative)`` added at each of its first ``count`` positions.
  ``locate(slots, indices)`` maps the indices the codes carry (for ``slots``, the codes'
  ordinals) to positions in ``total``, n or more for none; by default they are the same.

  A while loop unpacks and adds ``DECODE_CHUNK`` codes per iteration, for as many
  iterations as ``count`` needs (the codes are packed in order): decoding costs the codes
  sent, not the capacity, plus the zero fill of ``total``. A loop rather than tiers of a
  conditional: with ``total`` passing through a switch, decoding 4M elements took 20.8 ms
  against 7.1 ms in the loop (docs/performance.md; the times suggest that XLA:CPU copied
  the sum into and out of the conditional). A row's positions are distinct, so adding them in
  chunks equals adding them at once, and adding a row's values to the running sum equals
  adding a dense copy of the row (``x + (0 + v) == x + v`` in floating point). A count
  above ``cap`` (a corrupt payload; the caller marks the result NaN) adds the ``cap``
  codes of the capacity and nothing after them: neither the spare bits of the last word
  nor the zero padding of the last chunk (which would decode as codes for position 0).
  """
  chunk = min(DECODE_CHUNK, -(-cap // 32) * 32)
  if chunk == 0:
    return total
  chunk_words = chunk * bits // 32
  iterations = -(-cap // chunk)
  # Zero words after the last chunk: a dynamic slice past the end would be clamped
  # (shifted back), not cut.
  padded = tf.pad(words, [[0, max(iterations * chunk_words - int(words.shape[0]), 0)]])
  steps = (tf.clip_by_value(count, 0, cap) + chunk - 1) // chunk

  def add(i, total):
    codes = bitpack.unpack(tf.slice(padded, [i * chunk_words], [chunk_words]), chunk, bits)
    positions = tf.cast(tf.bitwise.right_shift(codes, 1), tf.int32)
    ordinals = i * chunk + tf.range(chunk, dtype=tf.int32)
    if locate is not None:
      positions = locate(ordinals, positions)
    negative = tf.bitwise.bitwise_and(codes, 1) > 0
    # min(count, cap): a corrupt count above the capacity must not turn the padding
    # after it into codes (zero words decode as position 0, sign +).
    valid = (ordinals < tf.minimum(count, cap)) & (positions < n)
    values = values_at(tf.where(valid, positions, 0), negative)
    return i + 1, tf.tensor_scatter_nd_add(total, tf.where(valid, positions, n)[:, None],
                                           tf.where(valid, values, tf.zeros_like(values)))

  _, total = tf.while_loop(lambda i, _: i < steps, add, (tf.constant(0), total),
                           maximum_iterations=iterations)
  return total


def _decompress(payload, shape: tf.TensorShape, dtype: tf.DType, bin_size=None):
  if bin_size is not None:
    return _decompress_per_bin(payload, shape, dtype, bin_size)
  n = shape.num_elements()
  bits = index_bits(n) + 1
  rows = payload if payload.shape.rank == 2 else payload[None]
  width = int(rows.shape[1])
  cap = (width - HEADER_WORDS) * 32 // bits
  cd = checks.compute_dtype(dtype)
  total, bad = tf.zeros([n + 1], cd), tf.constant(False)
  # A fixed, sequential order over replicas: every replica adds the same floats in the
  # same order and gets a bit-identical sum.
  for row in range(int(rows.shape[0])):
    count, scale_bits, sent_bits = rows[row, 0], rows[row, 1], rows[row, 2]
    scale = tf.cast(tf.bitcast(scale_bits, tf.float32), cd)
    total = _add_codes(
        total, tf.bitcast(rows[row, HEADER_WORDS:], tf.uint32), count, n, cap, bits,
        lambda positions, negative, scale=scale: tf.where(negative, -scale, scale))
    # A payload that is not what this shape expects, or that carries the non-finite
    # marker, makes the whole sum NaN so that loss scaling and finiteness checks see it.
    bad |= ((sent_bits != bits) | (count < 0) | (count > cap)
            | tf.logical_not(tf.math.is_finite(scale)))
  total = tf.where(bad, tf.constant(float("nan"), cd), total[:n])
  return tf.reshape(tf.cast(total, dtype), shape)


def _decompress_per_bin(payload, shape: tf.TensorShape, dtype: tf.DType, bin_size: int):
  n = shape.num_elements()
  bits = index_bits(n) + 1
  bins = num_bins(n, bin_size)
  start = BIN_HEADER_WORDS + scale_words(n, bin_size)
  rows = payload if payload.shape.rank == 2 else payload[None]
  width = int(rows.shape[1])
  cap = max(width - start, 0) * 32 // bits
  cd = checks.compute_dtype(dtype)
  total, bad = tf.zeros([n + 1], cd), tf.constant(False)
  for row in range(int(rows.shape[0])):  # replica order, as in _decompress
    count, marker = rows[row, 0], tf.bitcast(rows[row, 1], tf.float32)
    scales = tf.cast(tf.reshape(tf.bitcast(rows[row, BIN_HEADER_WORDS:start], tf.bfloat16),
                                [-1])[:bins], cd)

    def values_at(positions, negative, scales=scales):
      magnitude = tf.gather(scales, positions // bin_size)
      return tf.where(negative, -magnitude, magnitude)

    total = _add_codes(total, tf.bitcast(rows[row, start:], tf.uint32), count, n, cap, bits,
                       values_at)
    # A non-finite bin scale is never sent (the encoder marks word 1 instead): a row
    # that carries one is corrupt, and would otherwise decode to NaN or inf only where
    # its codes land.
    bad |= ((rows[row, 2] != (bits | BIN_SCALE_FLAG)) | (rows[row, 3] != bins)
            | (count < 0) | (count > cap) | tf.logical_not(tf.math.is_finite(marker))
            | tf.logical_not(tf.reduce_all(tf.math.is_finite(scales))))
  total = tf.where(bad, tf.constant(float("nan"), cd), total[:n])
  return tf.reshape(tf.cast(total, dtype), shape)


def _nbytes(payload):
  rows = tf.cast(payload, tf.int64)
  count, bits = rows[..., 0], rows[..., 2]
  tensor_scale = 4 * (HEADER_WORDS + (count * bits + 31) // 32)
  if int(payload.shape[-1]) < BIN_HEADER_WORDS:
    return tensor_scale
  # scale="bin" payloads say so in their bits word, and carry their number of bins.
  bins = rows[..., 3]
  per_bin = 4 * (BIN_HEADER_WORDS + (bins + 1) // 2
                 + (count * (bits % BIN_SCALE_FLAG) + 31) // 32)
  return tf.where(tf.bitwise.bitwise_and(bits, BIN_SCALE_FLAG) > 0, per_bin, tensor_scale)


def adacomp_compress(grad, residue, bin_size: int, max_density: float = 1.0,
                     scale: str = "tensor"):
  """Compresses ``grad`` with AdaComp, carrying the error in ``residue``.

  Runs eagerly, in graph mode and inside ``strategy.run``; always XLA-compiled (one
  compilation per shape, dtype, bin size and density).

  Args:
    grad: float16/bfloat16/float32/float64 tensor with a static shape.
    residue: float tensor of the same shape (its dtype may differ, e.g. float32 for a
      bfloat16 gradient); zeros at the first step.
    bin_size: int >= 1, the bin length L_T (50 for convolutions, 500 for dense/LSTM).
    max_density: fraction in (0, 1] of the elements one payload can carry; the payload
      has a static size. Selected elements beyond it stay in the residue. 1.0 (the
      default) never drops anything from the payload.
    scale: "tensor" (default): one scale per tensor, the mean of the bin maxima;
      "bin": each bin's own maximum, rounded to bfloat16, sent in the payload
      (2 bytes per bin more; see docs/wire_format.md).

  Returns:
    ``(payload, new_residue)``: a 1-D int32 payload in the wire format of
    docs/wire_format.md (static length ``payload_words(n, max_density, scale,
    bin_size)``; only
    ``payload_nbytes(payload)`` bytes of it need to be sent), and the new residue with
    the dtype and shape of ``residue``. If ``grad + residue`` has a non-finite element,
    nothing is selected, the residue is returned unchanged and the payload is marked so
    that it decodes to NaN.

  Raises:
    TypeError: ``grad`` or ``residue`` is not a float tensor.
    ValueError: shapes differ or are not static, ``bin_size`` < 1, ``max_density``
      outside (0, 1], ``scale`` not one of ``SCALES``.
  """
  grad = checks.float_tensor(grad, "grad")
  residue = checks.float_tensor(residue, "residue")
  checks.same_shape(grad, residue, "grad", "residue")
  bin_size = checks.positive_int(bin_size, "bin_size")
  max_density = checks.fraction(max_density, "max_density")
  check_scale(scale, bin_size)
  cap = capacity(grad.shape.num_elements(), max_density)
  if scale == "bin":
    return compiled.kernel(_compress, bin_size=bin_size, cap=cap, per_bin=True)(grad, residue)
  return compiled.kernel(_compress, bin_size=bin_size, cap=cap)(grad, residue)


def adacomp_decompress(payload, shape, dtype=tf.float32, scale="tensor", bin_size=None):
  """Decodes AdaComp payloads into a dense tensor.

  Args:
    payload: int32 ``[words]`` (one replica's payload) or ``[replicas, words]`` (payloads
      gathered from several replicas, each zero-padded to a common length of at least
      its used words).
    shape: static shape of the gradient.
    dtype: float dtype of the result.
    scale: the ``scale`` the payloads were compressed with ("tensor" or "bin").
    bin_size: with ``scale="bin"``, the bin length they were compressed with.

  Returns:
    A dense tensor of ``shape`` and ``dtype``: the ternary gradient of the payload, or
    for a gathered payload the sum of every replica's contribution, added in replica
    order. NaN everywhere if a payload carries the non-finite marker (with
    ``scale="bin"``, also a non-finite bin scale) or does not match ``shape``.

  Raises:
    TypeError: ``payload`` is not int32 or ``dtype`` is not a float type.
    ValueError: ``payload`` is not rank 1 or 2 with a static shape, is shorter than a
      header, ``shape`` is not fully defined, ``scale`` is not one of ``SCALES`` or
      ``bin_size`` is missing for "bin".
  """
  payload = checks.payload_tensor(payload)
  shape = checks.static_shape(shape, "shape")
  dtype = checks.float_dtype(dtype, "dtype")
  check_scale(scale, bin_size)
  if scale == "bin":
    bin_size = checks.positive_int(bin_size, "bin_size")
    header = _header_words(shape.num_elements(), scale, bin_size)
  else:
    bin_size, header = None, HEADER_WORDS
  if payload.shape[-1] < header:
    raise ValueError(f"`payload` must hold at least the {header}-word header. "
                     f"Received: payload with shape {payload.shape}")
  if bin_size is None:
    return compiled.kernel(_decompress, shape=shape, dtype=dtype)(payload)
  return compiled.kernel(_decompress, shape=shape, dtype=dtype, bin_size=bin_size)(payload)


def payload_nbytes(payload):
  """Bytes that a payload occupies on the wire: header, scales and used packed words.

  Self-describing: a scale="bin" payload carries its flag and number of bins, so its
  ``4 * (4 + ceil(bins / 2))`` bytes of header and bfloat16 scales are counted too.

  Args:
    payload: int32 ``[words]`` or gathered ``[replicas, words]`` AdaComp payload.

  Returns:
    int64 tensor: a scalar for one payload, ``[replicas]`` for a gathered one. Zero
    padding beyond the used words is not counted here; an exchange that pads payloads
    to a common length counts that padding itself (``stats.exchange_nbytes``).

  Raises:
    TypeError, ValueError: as for ``adacomp_decompress``.
  """
  payload = checks.payload_tensor(payload)
  return compiled.kernel(_nbytes)(payload)

