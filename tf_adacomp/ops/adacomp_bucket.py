"""AdaComp over a bucket of tensors: one XLA call and one payload for several tensors.

A model has tens of gradient tensors; compressing each in its own XLA program costs a
program (and a compilation) per shape and per device, and a fixed cost per tensor per
step. Horovod's tensor fusion and PyTorch DDP's buckets join small all-reduces for the
same reason. Here every tensor of a bucket (same bin size, same dtypes) is laid out in
one flat buffer and compressed by one program, and the result is bit-identical to
compressing each tensor on its own (``ops.adacomp``):

- each tensor starts at a multiple of ``lcm(bin_size, 32)`` and is zero-padded to the
  next one, so that no bin and no bitmap word spans two tensors (a zero changes no bin
  maximum and is never selected: AdaComp does not send G_i == 0);
- each tensor keeps its own scale (the mean of its own bins' maxima, computed on its
  own slice of them) or, with ``scale="bin"``, its bins' own scales;
- each tensor keeps its own capacity (``ceil(max_density * n)``, its lowest positions
  when more is selected) and its own non-finite marker: one tensor with a NaN sends
  nothing and keeps its residue, the others are sent as usual.

Wire format (docs/wire_format.md#buckets), int32 words::

    [count, bits | BUCKET_FLAG (| BIN_SCALE_FLAG), tensors T, scale words S,
     count_0 .. count_{T-1},           (-1: tensor t was not finite and decodes to NaN)
     S scale words,                    (T float32 scales, or the real bins' bfloat16 scales)
     packed codes...]                  (position in its tensor << 1 | (G < 0), bits each:
                                        the largest tensor's index bits + 1; tensor by
                                        tensor, count_t codes each, positions increasing)
"""

import dataclasses
import functools
import math
from typing import Tuple

import tensorflow as tf

from tf_adacomp.ops import adacomp
from tf_adacomp.ops import bitpack
from tf_adacomp.ops import checks
from tf_adacomp.ops import compaction
from tf_adacomp.ops import compiled

BUCKET_FLAG = 1 << 9  # or-ed into the bits word of a bucket payload
HEADER_WORDS = 4


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static layout of one bucket: where each tensor's positions start.

  Attributes:
    sizes: elements of each tensor.
    bin_size: the bucket's L_T.
    max_density: each tensor's payload capacity, as a fraction of its elements.
    scale: "tensor" or "bin".
  """
  sizes: Tuple[int, ...]
  bin_size: int
  max_density: float
  scale: str = "tensor"

  @functools.cached_property
  def blocks(self) -> Tuple[int, ...]:
    """Bitmap words of each tensor (its elements rounded up to whole words)."""
    return tuple(compaction.blocks_for(n) for n in self.sizes)

  @functools.cached_property
  def offsets(self) -> Tuple[int, ...]:
    """First position of each tensor in the bucket (a multiple of 32)."""
    return tuple(compaction.WORD_BITS * sum(self.blocks[:i]) for i in range(len(self.sizes)))

  @property
  def total(self) -> int:
    """Positions of the bucket, padding included."""
    return compaction.WORD_BITS * sum(self.blocks)

  @property
  def bits(self) -> int:
    """Code width: a position within its tensor (of the largest tensor) and a sign."""
    return adacomp.index_bits(max(self.sizes)) + 1

  @functools.cached_property
  def caps(self) -> Tuple[int, ...]:
    return tuple(adacomp.capacity(n, self.max_density) for n in self.sizes)

  @property
  def cap(self) -> int:
    return sum(self.caps)

  @functools.cached_property
  def bins(self) -> Tuple[int, ...]:
    """Each tensor's bins (its last may be short)."""
    return tuple(adacomp.num_bins(n, self.bin_size) for n in self.sizes)

  @property
  def bin_offsets(self) -> Tuple[int, ...]:
    return tuple(sum(self.bins[:i]) for i in range(len(self.sizes)))

  @property
  def scale_words(self) -> int:
    if self.scale == "bin":
      return -(-sum(self.bins) // 2)
    return len(self.sizes)

  @property
  def header_words(self) -> int:
    return HEADER_WORDS + len(self.sizes) + self.scale_words

  @property
  def width(self) -> int:
    """Static length of one payload, in int32 words."""
    return self.header_words + bitpack.packed_words(self.cap, self.bits)

  @property
  def flags(self) -> int:
    return self.bits | BUCKET_FLAG | (adacomp.BIN_SCALE_FLAG if self.scale == "bin" else 0)


def layout(sizes, bin_size, max_density=1.0, scale="tensor") -> Layout:
  """A checked ``Layout`` (errors name the argument and the value received)."""
  if not isinstance(sizes, (list, tuple)) or not sizes or not all(
      checks.is_int(n) and n >= 0 for n in sizes):
    raise ValueError(f"`sizes` must be a non-empty list of element counts. "
                     f"Received: sizes={sizes!r}")
  result = Layout(tuple(int(n) for n in sizes), checks.positive_int(bin_size, "bin_size"),
                  checks.fraction(max_density, "max_density"),
                  adacomp.check_scale(scale, bin_size))
  if result.total > checks.MAX_ELEMENTS:
    raise ValueError(f"A bucket holds at most {checks.MAX_ELEMENTS} positions with its "
                     f"padding. Received: sizes={sizes!r} ({result.total} padded)")
  return result


def _select(grad, residue, lay: Layout, n: int):
  """One tensor's selection, as ``ops.adacomp`` computes it (the same operations on the
  tensor's own elements, so the results are bit-identical): its selection bitmap before
  its capacity is applied, G's sign bitmap, whether it is finite, what goes on the wire
  for its scale, and a function of its sent bitmap that gives its new residue."""
  b = lay.bin_size
  cd = checks.compute_dtype(grad.dtype, residue.dtype)
  dw = tf.cast(tf.reshape(grad, [-1]), cd)
  r = tf.cast(tf.reshape(residue, [-1]), cd)
  g = r + dw
  h = g + dw
  gmax = adacomp._bin_maxima(  # pylint: disable=protected-access
      tf.where(tf.math.is_nan(g), tf.constant(float("inf"), cd), tf.abs(g)), b)
  element_bin = tf.range(n, dtype=tf.int32) // b
  if lay.scale == "bin":
    scales16 = tf.cast(tf.cast(gmax, tf.float32), tf.bfloat16)
    scales = tf.cast(scales16, cd)
    finite = tf.reduce_all(tf.math.is_finite(scales))
    element_scale = tf.gather(scales, element_bin)
    selected = ((tf.abs(h) >= tf.gather(gmax, element_bin)) & tf.not_equal(g, 0)
                & (element_scale > 0) & finite)
    wire_scale = scales16
  else:
    scale32 = (adacomp._mean_as_float32(gmax) if n  # pylint: disable=protected-access
               else tf.zeros([], tf.float32))
    element_scale = tf.cast(scale32, cd)
    finite = tf.math.is_finite(scale32) & tf.reduce_all(tf.math.is_finite(gmax))
    selected = (tf.abs(h) >= tf.gather(gmax, element_bin)) & tf.not_equal(g, 0) & finite
    wire_scale = tf.where(finite, scale32, tf.constant(float("nan"), tf.float32))
  blocks = compaction.blocks_for(n)
  words = compaction.pack_mask(compaction.to_words(selected, blocks))
  signs = compaction.pack_mask(compaction.to_words(g < 0, blocks))

  def new_residue(kept):
    sent = tf.reshape(compaction.unpack_mask(kept), [-1])[:n]
    q = tf.where(g < 0, -element_scale, element_scale)
    new = tf.where(finite, tf.where(sent, g - q, g), r)
    return tf.reshape(tf.cast(new, residue.dtype), residue.shape)

  return words, signs, finite, wire_scale, new_residue


def _per_word(values, lay: Layout, dtype=tf.int32):
  """One value per tensor, repeated over each of its bitmap words."""
  return tf.concat([tf.fill([blocks], tf.cast(v, dtype)) for v, blocks in
                    zip(values, lay.blocks)], 0)


def _kept_words(words, lay: Layout):
  """Each tensor's bitmap with its own capacity applied (its lowest positions), as
  ``compaction.kept_words`` does per tensor, with one cumulative sum for the bucket."""
  if all(cap >= n for cap, n in zip(lay.caps, lay.sizes)):
    return words
  offsets = compaction.cumsum(compaction.popcount(words), exclusive=True)
  starts = [offsets[o // compaction.WORD_BITS] if blocks else 0
            for o, blocks in zip(lay.offsets, lay.blocks)]
  own_offsets = offsets - _per_word(starts, lay)
  return compaction.keep_lowest_set_bits(
      words, tf.maximum(_per_word(lay.caps, lay) - own_offsets, 0))


def _compress(grads, residues, lay: Layout):
  parts = [_select(g, r, lay, n) for g, r, n in zip(grads, residues, lay.sizes)]
  words = _kept_words(tf.concat([p[0] for p in parts], 0), lay)
  signs = tf.concat([p[1] for p in parts], 0)
  popcounts = compaction.popcount(words)
  kept = [words[o // compaction.WORD_BITS:o // compaction.WORD_BITS + blocks]
          for o, blocks in zip(lay.offsets, lay.blocks)]
  counts = [tf.reduce_sum(popcounts[o // compaction.WORD_BITS:o // compaction.WORD_BITS + blocks])
            for o, blocks in zip(lay.offsets, lay.blocks)]
  count = tf.add_n(counts)
  if lay.scale == "bin":
    real = tf.concat([p[3] for p in parts], 0)
    real = tf.pad(real, [[0, 2 * lay.scale_words - sum(lay.bins)]])
    scale_body = tf.bitcast(tf.reshape(real, [-1, 2]), tf.int32)
  else:
    scale_body = tf.bitcast(tf.stack([p[3] for p in parts]), tf.int32)
  header = tf.stack([count, tf.constant(lay.flags, tf.int32),
                     tf.constant(len(lay.sizes), tf.int32),
                     tf.constant(lay.scale_words, tf.int32)])
  # -1: this tensor was not finite (it sent nothing and kept its residue).
  marked = tf.stack([tf.where(p[2], c, -1) for p, c in zip(parts, counts)])
  offsets = tf.constant(lay.offsets, tf.int32)

  def index_of(positions):  # a code carries the position within its own tensor
    return positions - tf.gather(offsets, _tensor_of(positions, lay))

  codes = adacomp._packed_codes(words, signs, lay.cap, count, lay.bits, index_of)  # pylint: disable=protected-access
  payload = tf.concat([header, marked, scale_body, codes], 0)
  return payload, [p[4](k) for p, k in zip(parts, kept)]


def _tensor_of(positions, lay: Layout):
  """Which tensor each bucket position lies in: T comparisons per code."""
  return tf.reduce_sum(tf.cast(positions[:, None] >= tf.constant(lay.offsets[1:], tf.int32),
                               tf.int32), 1)


def _locate(ordinals, local, counts, lay: Layout):
  """Bucket positions of the codes ``ordinals`` of a row whose tensors sent ``counts``
  codes each (-1: none) and whose codes carry the positions ``local`` within their
  tensor; ``lay.total`` (the decoder's sink) for a code that belongs to no tensor.

  Codes come tensor by tensor, each tensor's count of them. A tensor takes only its own
  codes, at most its capacity of them, and only positions inside it: with corrupt counts
  (above a tensor's capacity, or adding up to less than the row's count, which the
  caller marks NaN) no code is read into a tensor from beyond its own codes.
  """
  tensors = len(lay.sizes)
  counts = tf.maximum(counts, 0)
  ends = tf.cumsum(counts)
  tensor = tf.minimum(tf.reduce_sum(tf.cast(ordinals[:, None] >= ends, tf.int32), 1),
                      tensors - 1)
  own = ordinals - tf.gather(ends - counts, tensor)  # the code's ordinal in its tensor
  inside = ((ordinals < ends[-1]) & (own < tf.gather(tf.constant(lay.caps, tf.int32), tensor))
            & (local < tf.gather(tf.constant(lay.sizes, tf.int32), tensor)))
  return tf.where(inside, tf.gather(tf.constant(lay.offsets, tf.int32), tensor) + local,
                  lay.total)


def _decompress(payload, lay: Layout, shapes, dtype):
  b, tensors = lay.bin_size, len(lay.sizes)
  rows = payload if payload.shape.rank == 2 else payload[None]
  cd = checks.compute_dtype(dtype)
  caps = tf.constant(lay.caps, tf.int32)
  offsets = tf.constant(lay.offsets, tf.int32)
  bin_offsets = tf.constant(lay.bin_offsets, tf.int32)
  total, bad = tf.zeros([lay.total + 1], cd), tf.constant(False)
  bad_tensor = [tf.constant(False)] * tensors
  scale_start = HEADER_WORDS + tensors
  for row in range(int(rows.shape[0])):  # replica order: bit-identical everywhere
    count = rows[row, 0]
    counts = rows[row, HEADER_WORDS:scale_start]
    body = rows[row, scale_start:lay.header_words]
    if lay.scale == "bin":
      scales = tf.cast(tf.reshape(tf.bitcast(body, tf.bfloat16), [-1]), cd)
      # A non-finite bin scale is never sent (the encoder marks the tensor's count -1
      # instead): the tensor that owns it is corrupt and decodes to NaN.
      bad_tensor = [x | tf.logical_not(tf.reduce_all(tf.math.is_finite(scales[o:o + bins])))
                    for x, o, bins in zip(bad_tensor, lay.bin_offsets, lay.bins)]
    else:
      scales = tf.cast(tf.bitcast(body, tf.float32), cd)
      bad_tensor = [x | tf.logical_not(tf.math.is_finite(scales[t]))
                    for t, x in enumerate(bad_tensor)]

    locate = functools.partial(_locate, counts=counts, lay=lay)

    def values_at(positions, negative, scales=scales):
      tensor = _tensor_of(positions, lay)
      if lay.scale == "bin":
        local = positions - tf.gather(offsets, tensor)
        magnitude = tf.gather(scales, tf.gather(bin_offsets, tensor) + local // b)
      else:
        magnitude = tf.gather(scales, tensor)
      return tf.where(negative, -magnitude, magnitude)

    total = adacomp._add_codes(  # pylint: disable=protected-access
        total, tf.bitcast(rows[row, lay.header_words:], tf.uint32), count, lay.total, lay.cap,
        lay.bits, values_at, locate)
    # A payload that is not what this layout expects makes the whole bucket NaN.
    bad |= ((rows[row, 1] != lay.flags) | (rows[row, 2] != tensors)
            | (rows[row, 3] != lay.scale_words) | (count < 0) | (count > lay.cap)
            | tf.reduce_any(counts > caps)
            | (tf.reduce_sum(tf.maximum(counts, 0)) != count))
    bad_tensor = [x | (counts[t] < 0) for t, x in enumerate(bad_tensor)]
  nan = tf.constant(float("nan"), cd)
  return [tf.reshape(tf.cast(tf.where(bad | bad_t, nan, total[o:o + n]), dtype), shape)
          for shape, n, o, bad_t in zip(shapes, lay.sizes, lay.offsets, bad_tensor)]


def _tensor_nbytes(payload, lay: Layout):
  rows = tf.cast(payload if payload.shape.rank == 2 else payload[None], tf.int64)
  count = rows[:, 0]
  nbytes = 4 * (lay.header_words + (count * lay.bits + 31) // 32)
  # Each tensor's share: its count word, its scales and its codes; what is left (the
  # fixed header, rounding) goes to the first tensor, so that the shares add up.
  counts = tf.maximum(rows[:, HEADER_WORDS:HEADER_WORDS + len(lay.sizes)], 0)
  own_scales = ([4] * len(lay.sizes) if lay.scale == "tensor"
                else [2 * bins for bins in lay.bins])
  shares = 4 + tf.constant(own_scales, tf.int64) + counts * lay.bits // 8
  shares += tf.one_hot(0, len(lay.sizes), dtype=tf.int64) * (
      nbytes - tf.reduce_sum(shares, axis=1))[:, None]
  return shares if payload.shape.rank == 2 else shares[0]


def compress(grads, residues, bin_size: int, max_density: float = 1.0,
             scale: str = "tensor"):
  """Compresses a bucket of gradients with AdaComp, in one XLA call and one payload.

  Bit-identical, tensor by tensor, to ``ops.adacomp_compress`` of each gradient with its
  residue: the same new residues, and a payload that decodes to the same tensors.

  Args:
    grads: list of float tensors with static shapes, all of one dtype.
    residues: list of float tensors, one per gradient and of its shape, all of one dtype.
    bin_size: int >= 1, the bin length L_T of every tensor of the bucket.
    max_density: fraction in (0, 1]: each tensor's payload capacity.
    scale: "tensor" (one scale per tensor) or "bin" (one bfloat16 scale per bin).

  Returns:
    ``(payload, new_residues)``: a 1-D int32 payload of static length
    ``layout(sizes, ...).width`` (see the module doc; only the sum of ``tensor_nbytes``
    bytes of it need to be sent), and the list of new residues. A tensor whose ``grad + residue``
    is not finite sends nothing, keeps its residue, and decodes to NaN.

  Raises:
    TypeError: a gradient or residue is not a float tensor.
    ValueError: empty or mismatched lists, shapes that differ or are not static, mixed
      dtypes, ``bin_size`` < 1, ``max_density`` outside (0, 1], an unknown ``scale``.
  """
  grads, residues = _checked_lists(grads, residues)
  lay = layout([g.shape.num_elements() for g in grads], bin_size, max_density, scale)
  return compiled.kernel(_compress, lay=lay)(grads, residues)


def decompress(payload, shapes, dtype=tf.float32, bin_size: int = 1,
               max_density: float = 1.0, scale: str = "tensor"):
  """Decodes bucket payloads into one dense tensor per gradient.

  Args:
    payload: int32 ``[words]`` or gathered ``[replicas, words]`` (each row zero-padded
      to ``layout(...).width``).
    shapes: the static shape of every gradient of the bucket, in order.
    dtype: float dtype of the results.
    bin_size, max_density, scale: as given to ``compress``.

  Returns:
    A list of dense tensors: the sum over rows of each gradient's ternary values, added
    in row order. A tensor is NaN if a row marks it non-finite (its count -1) or carries
    a non-finite scale for it; all are NaN if a row does not match the layout (its
    flags, counts or capacity).

  Raises:
    TypeError: ``payload`` is not int32 or ``dtype`` not a float type.
    ValueError: bad shapes, arguments, or a payload width other than the layout's.
  """
  payload = checks.payload_tensor(payload)
  if not isinstance(shapes, (list, tuple)) or not shapes:
    raise ValueError(f"`shapes` must be a non-empty list of shapes. Received: shapes={shapes!r}")
  shapes = tuple(tuple(checks.static_shape(s, "shapes").as_list()) for s in shapes)
  dtype = checks.float_dtype(dtype, "dtype")
  lay = layout([math.prod(s) for s in shapes], bin_size, max_density, scale)
  if int(payload.shape[-1]) != lay.width:
    raise ValueError(f"`payload` must have {lay.width} words for this bucket. "
                     f"Received: payload with shape {payload.shape}")
  return compiled.kernel(_decompress, lay=lay, shapes=shapes, dtype=dtype)(payload)


def tensor_nbytes(payload, sizes, bin_size: int, max_density: float = 1.0,
                  scale: str = "tensor"):
  """Bytes each tensor of a bucket payload occupies on the wire; they sum to the
  payload's used bytes (``4 * (header words + ceil(count * bits / 32))``).

  Args:
    payload: int32 ``[words]`` or ``[replicas, words]`` bucket payload.
    sizes: elements of each tensor of the bucket.
    bin_size, max_density, scale: as given to ``compress``.

  Returns:
    int64 ``[tensors]`` (``[replicas, tensors]`` for gathered rows).
  """
  payload = checks.payload_tensor(payload)
  return compiled.kernel(_tensor_nbytes, lay=layout(list(sizes), bin_size, max_density,
                                                     scale))(payload)


def _checked_lists(grads, residues):
  if not isinstance(grads, (list, tuple)) or not grads:
    raise ValueError(f"`grads` must be a non-empty list of tensors. Received: grads={grads!r}")
  if not isinstance(residues, (list, tuple)) or len(residues) != len(grads):
    raise ValueError(f"`residues` must be a list of {len(grads)} tensors, one per gradient. "
                     f"Received: {type(residues).__name__} of "
                     f"{len(residues) if isinstance(residues, (list, tuple)) else '?'}")
  grads = [checks.float_tensor(g, f"grads[{i}]") for i, g in enumerate(grads)]
  residues = [checks.float_tensor(r, f"residues[{i}]") for i, r in enumerate(residues)]
  for i, (g, r) in enumerate(zip(grads, residues)):
    checks.same_shape(g, r, f"grads[{i}]", f"residues[{i}]")
  for name, tensors in (("grads", grads), ("residues", residues)):
    dtypes = sorted({t.dtype.name for t in tensors})
    if len(dtypes) > 1:
      raise ValueError(f"All `{name}` of a bucket must share one dtype. Received: {dtypes}")
  return grads, residues
