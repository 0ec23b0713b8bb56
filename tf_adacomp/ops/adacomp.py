"""AdaComp (Chen et al., AAAI 2018) for one tensor: one payload per tensor.

The algorithm, and the kernel that selects, encodes and decodes, are those of
``ops.adacomp_core`` (shared with the buckets of ``ops.adacomp_bucket``, which the
exchange uses by default): this module is the per-tensor wire format around it, a tensor
being a ``Layout`` of one. Always XLA-compiled.

Wire format (docs/wire_format.md): int32 words
``[count, scale (float32 bits), bits, packed codes...]`` where each code is
``position << 1 | (G < 0)`` in ``bits = index_bits(n) + 1`` bits.

``scale="bin"`` (an option; "tensor" above is the default): every bin has its own scale,
its maximum rounded to bfloat16. The payload is then ``[count, 0 (NaN: not finite),
bits | BIN_SCALE_FLAG, bins, ceil(bins / 2) words of bfloat16 scales, packed codes...]``.
"""

import tensorflow as tf

from tf_adacomp.ops import adacomp_core
from tf_adacomp.ops import bitpack
from tf_adacomp.ops import checks
from tf_adacomp.ops import compiled
# Sizes and checks of the algorithm, public here too: the other kernels, the compressors
# and users take them from this module.
from tf_adacomp.ops.adacomp_core import SCALES  # pylint: disable=unused-import
from tf_adacomp.ops.adacomp_core import capacity
from tf_adacomp.ops.adacomp_core import check_positions  # pylint: disable=unused-import
from tf_adacomp.ops.adacomp_core import check_scale
from tf_adacomp.ops.adacomp_core import index_bits
from tf_adacomp.ops.adacomp_core import num_bins

HEADER_WORDS = 3
# scale="bin": one more header word (the number of bins), then the bins' bfloat16 scales.
BIN_HEADER_WORDS = 4
BIN_SCALE_FLAG = 1 << 8  # or-ed into the bits word of a scale="bin" payload


def scale_words(num_elements: int, bin_size: int) -> int:
  """int32 words of a scale="bin" payload's bfloat16 scales (two per word)."""
  return -(-num_bins(num_elements, bin_size) // 2)


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


def _compress(grad, residue, lay: adacomp_core.Layout):
  out = adacomp_core.compress([grad], [residue], lay)
  if lay.scale == "bin":
    nan = tf.constant(float("nan"), tf.float32)
    header = tf.stack([
        out.count,
        tf.bitcast(tf.where(out.finite[0], tf.zeros([], tf.float32), nan), tf.int32),
        tf.constant(lay.bits | BIN_SCALE_FLAG, tf.int32),
        tf.constant(lay.bins[0], tf.int32),
    ])
    header = tf.concat([header, adacomp_core.bfloat16_words(out.scales[0])], 0)
  else:
    # The scale word is NaN when the tensor was not finite.
    header = tf.stack([out.count, tf.bitcast(out.scales[0], tf.int32),
                       tf.constant(lay.bits, tf.int32)])
  return tf.concat([header, out.codes], 0), out.residues[0]


def _decompress(payload, shape: tf.TensorShape, dtype: tf.DType, bin_size=None):
  n = shape.num_elements()
  bits = index_bits(n) + 1
  scale = "tensor" if bin_size is None else "bin"
  start = _header_words(n, scale, bin_size)
  # The decoder does not know the sender's max_density: the codes a row can hold are
  # what its width holds.
  cap = max(int(payload.shape[-1]) - start, 0) * 32 // bits
  lay = adacomp_core.Layout((n,), bin_size or 1, (cap,), scale)

  def read_row(row, cd):
    count = row[0]
    codes = tf.bitcast(row[start:], tf.uint32)
    # A payload that is not what this shape (and bin size) expects, or that carries the
    # non-finite marker, decodes to NaN.
    bad = (count < 0) | (count > cap)
    if scale == "bin":
      marker = tf.bitcast(row[1], tf.float32)
      scales = adacomp_core.bfloat16_scales(row[BIN_HEADER_WORDS:start], lay.bins[0], cd)
      # A non-finite bin scale is never sent (the encoder marks word 1 instead): a row
      # that carries one is corrupt, and would otherwise decode to NaN or inf only where
      # its codes land.
      bad |= ((row[2] != (bits | BIN_SCALE_FLAG)) | (row[3] != lay.bins[0])
              | tf.logical_not(tf.math.is_finite(marker))
              | tf.logical_not(tf.reduce_all(tf.math.is_finite(scales))))
    else:
      scales = tf.cast(tf.bitcast(row[1:2], tf.float32), cd)
      bad |= (row[2] != bits) | tf.logical_not(tf.math.is_finite(scales[0]))
    return adacomp_core.Row(count, count[None], scales, codes, bad, [tf.constant(False)])

  return adacomp_core.decode(payload, lay, [shape], dtype, read_row)[0]


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
  n = grad.shape.num_elements()
  lay = adacomp_core.Layout((n,), bin_size, (capacity(n, max_density),), scale)
  return compiled.kernel(_compress, lay=lay)(grad, residue)


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

