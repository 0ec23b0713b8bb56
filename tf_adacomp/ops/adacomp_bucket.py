"""AdaComp over a bucket of tensors: one XLA call and one payload for several tensors.

A model has tens of gradient tensors; compressing each in its own XLA program costs a
program (and a compilation) per shape and per device, and a fixed cost per tensor per
step. Horovod's tensor fusion and PyTorch DDP's buckets join small all-reduces for the
same reason. This is the path the exchange takes by default (``AdaComp(fuse=True)``).

The selection, encoder and decoder are ``ops.adacomp_core``'s, the same as for one tensor
(``ops.adacomp``), over a ``Layout`` of the bucket's tensors, so the result is
bit-identical to compressing each tensor on its own: each tensor keeps its own bins, its
own scale (or, with ``scale="bin"``, its bins' own scales), its own capacity
(``ceil(max_density * n)``, its lowest positions when more is selected) and its own
non-finite marker (one tensor with a NaN sends nothing and keeps its residue, the others
are sent as usual). This module is the bucket's wire format around that kernel.

Wire format (docs/wire_format.md#buckets), int32 words::

    [count, bits | BUCKET_FLAG (| BIN_SCALE_FLAG), tensors T, scale words S,
     count_0 .. count_{T-1},           (-1: tensor t was not finite and decodes to NaN)
     S scale words,                    (T float32 scales, or the real bins' bfloat16 scales)
     packed codes...]                  (position in its tensor << 1 | (G < 0), bits each:
                                        the largest tensor's index bits + 1; tensor by
                                        tensor, count_t codes each, positions increasing)

With ``positions="bin"`` (``| BIN_POSITIONS_FLAG``) a code carries its offset in its bin
(``index_bits(L_T) + 1`` bits) and the bins' counts follow the codes in unary, from the
word after the last code: for every bin of every tensor in order, one 1 per code sent
from it and a closing 0 (docs/wire_format.md#positions-in-bins). With
``positions="elias_fano"`` (``| ELIAS_FANO_FLAG``) the bits word holds the payload's own
code width: a code carries the low ``bits - 1`` bits of its place among all the bucket's
elements, and the unary counts after the codes count the codes of each run of
``2**(bits - 1)`` places (docs/wire_format.md#positions-elias-fano).
"""

import math

import tensorflow as tf

from tf_adacomp.ops import adacomp
from tf_adacomp.ops import adacomp_core
from tf_adacomp.ops import checks
from tf_adacomp.ops import compiled

BUCKET_FLAG = 1 << 9  # or-ed into the bits word of a bucket payload
BIN_POSITIONS_FLAG = 1 << 10  # and for positions="bin": offsets in bins, unary counts
ELIAS_FANO_FLAG = 1 << 11  # and for positions="elias_fano"
BITS_MASK = 0xFF  # the code width in the bits word; the flags above it
HEADER_WORDS = 4


class Layout(adacomp_core.Layout):
  """Static layout of one bucket (``adacomp_core.Layout``) and of its payload's words."""

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
    return self.header_words + self.body_words

  @property
  def flags(self) -> int:
    """The bits word: the code width (with ``positions="elias_fano"``, the widest of the
    static buffer; each payload writes its own) and the flags."""
    return (self.bits | BUCKET_FLAG | (adacomp.BIN_SCALE_FLAG if self.scale == "bin" else 0)
            | (BIN_POSITIONS_FLAG if self.positions == "bin" else 0)
            | (ELIAS_FANO_FLAG if self.positions == "elias_fano" else 0))


def layout(sizes, bin_size, max_density=1.0, scale="tensor", positions="tensor") -> Layout:
  """A checked bucket ``Layout``.

  Args:
    sizes: elements of each tensor of the bucket.
    bin_size: int >= 1, the bucket's L_T.
    max_density: fraction in (0, 1]: each tensor's capacity, as a fraction of its
      elements.
    scale: "tensor" or "bin".
    positions: "tensor" (a code carries its position in its tensor), "bin" (its offset
      in its bin, the bins' counts in unary after the codes) or "elias_fano" (the low
      bits of its place among the bucket's elements, the rest in unary after the codes).

  Returns:
    The ``Layout``.

  Raises:
    ValueError: ``sizes`` is not a non-empty list of element counts, the padded bucket
      has more positions than a code can carry, or an argument is out of range (each
      error names the argument and the value received).
  """
  if not isinstance(sizes, (list, tuple)) or not sizes or not all(
      checks.is_int(n) and n >= 0 for n in sizes):
    raise ValueError(f"`sizes` must be a non-empty list of element counts. "
                     f"Received: sizes={sizes!r}")
  bin_size = checks.positive_int(bin_size, "bin_size")
  max_density = checks.fraction(max_density, "max_density")
  sizes = tuple(int(n) for n in sizes)
  result = Layout(sizes, bin_size, tuple(adacomp_core.capacity(n, max_density) for n in sizes),
                  adacomp_core.check_scale(scale, bin_size),
                  adacomp_core.check_positions(positions))
  if result.total > checks.MAX_ELEMENTS:
    raise ValueError(f"A bucket holds at most {checks.MAX_ELEMENTS} positions with its "
                     f"padding. Received: sizes={sizes!r} ({result.total} padded)")
  return result


def _compress(grads, residues, lay: Layout):
  out = adacomp_core.compress(grads, residues, lay)
  if lay.scale == "bin":
    scale_body = adacomp_core.bfloat16_words(tf.concat(out.scales, 0))
  else:
    scale_body = tf.bitcast(tf.stack(out.scales), tf.int32)
  header = tf.stack([out.count, (lay.flags & ~BITS_MASK) | out.bits,
                     tf.constant(len(lay.sizes), tf.int32),
                     tf.constant(lay.scale_words, tf.int32)])
  # -1: this tensor was not finite (it sent nothing and kept its residue).
  marked = tf.stack([tf.where(f, c, -1) for f, c in zip(out.finite, out.counts)])
  return tf.concat([header, marked, scale_body, out.codes], 0), out.residues


def _decompress(payload, lay: Layout, shapes, dtype):
  tensors = len(lay.sizes)
  scale_start = HEADER_WORDS + tensors

  def read_row(row, cd):
    count = row[0]
    counts = row[HEADER_WORDS:scale_start]
    body = row[scale_start:lay.header_words]
    if lay.scale == "bin":
      scales = adacomp_core.bfloat16_scales(body, sum(lay.bins), cd)
      # A non-finite bin scale is never sent (the encoder marks the tensor's count -1
      # instead): the tensor that owns it is corrupt and decodes to NaN.
      bad_scale = [tf.logical_not(tf.reduce_all(tf.math.is_finite(scales[o:o + bins])))
                   for o, bins in zip(lay.bin_offsets, lay.bins)]
    else:
      scales = tf.cast(tf.bitcast(body, tf.float32), cd)
      bad_scale = [tf.logical_not(tf.math.is_finite(scales[t])) for t in range(tensors)]
    # A payload that is not what this layout expects makes the whole bucket NaN.
    expected, row_bits = lay.flags, None
    if lay.positions == "elias_fano":  # the row's own width, checked by unary_mismatch
      row_bits = tf.bitwise.bitwise_and(row[1], BITS_MASK)
      expected = (lay.flags & ~BITS_MASK) | row_bits
    bad = ((row[1] != expected) | (row[2] != tensors)
           | (row[3] != lay.scale_words)
           | (count < 0) | (count > lay.cap)
           | tf.reduce_any(counts > tf.constant(lay.caps, tf.int32))
           | (tf.reduce_sum(tf.maximum(counts, 0)) != count))
    codes = tf.bitcast(row[lay.header_words:], tf.uint32)
    bad |= adacomp_core.unary_mismatch(codes, count, lay, row_bits)
    return adacomp_core.Row(count, counts, scales, codes,
                            bad, [x | (counts[t] < 0) for t, x in enumerate(bad_scale)],
                            row_bits)

  return adacomp_core.decode(payload, lay, shapes, dtype, read_row)


def _tensor_nbytes(payload, lay: Layout):
  rows = tf.cast(payload if payload.shape.rank == 2 else payload[None], tf.int64)
  count = rows[:, 0]
  nbytes = 4 * (lay.header_words + adacomp_core.body_used_words(count, lay))
  # Each tensor's share: its count word, its scales and its codes (and its bins' unary
  # counts); what is left (the fixed header, rounding) goes to the first tensor, so that
  # the shares add up.
  counts = tf.maximum(rows[:, HEADER_WORDS:HEADER_WORDS + len(lay.sizes)], 0)
  own_scales = ([4] * len(lay.sizes) if lay.scale == "tensor"
                else [2 * bins for bins in lay.bins])
  if lay.positions == "elias_fano":
    # Its codes and a unary one each, and the buckets of its own places.
    low_bits = adacomp_core.elias_fano_low_bits(count, lay)[:, None]
    shares = 4 + tf.constant(own_scales, tf.int64) + (
        counts * (low_bits + 2) + tf.bitwise.right_shift(
            tf.constant(lay.sizes, tf.int64)[None], low_bits)) // 8
  else:
    shares = 4 + tf.constant(own_scales, tf.int64) + counts * lay.bits // 8
  if lay.positions == "bin":
    shares += (tf.constant(lay.bins, tf.int64) + counts) // 8
  shares += tf.one_hot(0, len(lay.sizes), dtype=tf.int64) * (
      nbytes - tf.reduce_sum(shares, axis=1))[:, None]
  return shares if payload.shape.rank == 2 else shares[0]


def compress(grads, residues, bin_size: int, max_density: float = 1.0,
             scale: str = "tensor", positions: str = "tensor"):
  """Compresses a bucket of gradients with AdaComp, in one XLA call and one payload.

  Bit-identical, tensor by tensor, to ``ops.adacomp_compress`` of each gradient with its
  residue: the same new residues, and a payload that decodes to the same tensors.

  Args:
    grads: list of float tensors with static shapes, all of one dtype.
    residues: list of float tensors, one per gradient and of its shape, all of one dtype.
    bin_size: int >= 1, the bin length L_T of every tensor of the bucket.
    max_density: fraction in (0, 1]: each tensor's payload capacity.
    scale: "tensor" (one scale per tensor) or "bin" (one bfloat16 scale per bin).
    positions: "tensor" (a code carries its position in its tensor), "bin" (its offset
      in its bin, the bins' counts in unary: fewer bytes, the same values;
      docs/wire_format.md#positions-in-bins) or "elias_fano" (the low bits of its place
      among the bucket's elements, the rest in unary, the split chosen per payload: no
      more bytes than "bin"; docs/wire_format.md#positions-elias-fano).

  Returns:
    ``(payload, new_residues)``: a 1-D int32 payload of static length
    ``layout(sizes, ...).width`` (see the module doc; only the sum of ``tensor_nbytes``
    bytes of it need to be sent), and the list of new residues. A tensor whose ``grad + residue``
    is not finite sends nothing, keeps its residue, and decodes to NaN.

  Raises:
    TypeError: a gradient or residue is not a float tensor.
    ValueError: empty or mismatched lists, shapes that differ or are not static, mixed
      dtypes, ``bin_size`` < 1, ``max_density`` outside (0, 1], an unknown ``scale`` or
      ``positions``.
  """
  grads, residues = _checked_lists(grads, residues)
  lay = layout([g.shape.num_elements() for g in grads], bin_size, max_density, scale,
               positions)
  return compiled.kernel(_compress, lay=lay)(grads, residues)


def decompress(payload, shapes, dtype=tf.float32, bin_size: int = 1,
               max_density: float = 1.0, scale: str = "tensor", positions: str = "tensor"):
  """Decodes bucket payloads into one dense tensor per gradient.

  Args:
    payload: int32 ``[words]`` or gathered ``[replicas, words]`` (each row zero-padded
      to ``layout(...).width``).
    shapes: the static shape of every gradient of the bucket, in order.
    dtype: float dtype of the results.
    bin_size, max_density, scale, positions: as given to ``compress``.

  Returns:
    A list of dense tensors: the sum over rows of each gradient's ternary values, added
    in row order. A tensor is NaN if a row marks it non-finite (its count -1) or carries
    a non-finite scale for it; all are NaN if a row does not match the layout (its
    flags, counts or capacity, or with ``positions="bin"`` or ``"elias_fano"`` unary
    counts that do not hold its codes, or with ``"elias_fano"`` a width out of range).

  Raises:
    TypeError: ``payload`` is not int32 or ``dtype`` not a float type.
    ValueError: bad shapes, arguments, or a payload width other than the layout's.
  """
  payload = checks.payload_tensor(payload)
  if not isinstance(shapes, (list, tuple)) or not shapes:
    raise ValueError(f"`shapes` must be a non-empty list of shapes. Received: shapes={shapes!r}")
  shapes = tuple(tuple(checks.static_shape(s, "shapes").as_list()) for s in shapes)
  dtype = checks.float_dtype(dtype, "dtype")
  lay = layout([math.prod(s) for s in shapes], bin_size, max_density, scale, positions)
  if int(payload.shape[-1]) != lay.width:
    raise ValueError(f"`payload` must have {lay.width} words for this bucket. "
                     f"Received: payload with shape {payload.shape}")
  return compiled.kernel(_decompress, lay=lay, shapes=shapes, dtype=dtype)(payload)


def tensor_nbytes(payload, sizes, bin_size: int, max_density: float = 1.0,
                  scale: str = "tensor", positions: str = "tensor"):
  """Bytes each tensor of a bucket payload occupies on the wire; they sum to the
  payload's used bytes (``4 * (header words + ceil(count * bits / 32))``, with
  ``positions="bin"`` plus ``4 * ceil((bins + count) / 32)``, with ``"elias_fano"`` the
  payload's own ``bits`` plus ``4 * ceil((buckets + count) / 32)``).

  Args:
    payload: int32 ``[words]`` or ``[replicas, words]`` bucket payload.
    sizes: elements of each tensor of the bucket.
    bin_size, max_density, scale, positions: as given to ``compress``.

  Returns:
    int64 ``[tensors]`` (``[replicas, tensors]`` for gathered rows).
  """
  payload = checks.payload_tensor(payload)
  return compiled.kernel(_tensor_nbytes, lay=layout(list(sizes), bin_size, max_density,
                                                     scale, positions))(payload)


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
