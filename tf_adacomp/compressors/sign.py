"""Signs of a rotating share of the elements, with error feedback.

AdaComp keeps in each bin the few elements near the bin's largest. That suits SGD's
gradients, a few of whose elements are much larger than the rest; an adaptive
optimizer's updates (Adam's ``m / sqrt(v)``) are of about one size everywhere, and
AdaComp then sends few of them, each with a position that costs more bits than its
value (docs/convergence.md, "Adam and AdamW inside local steps"). This compressor sends
the other way round: many elements, one bit each, and no positions at all.

At its ``c``-th call a tensor sends the elements whose flat index ``i`` has
``i % stride == c % stride`` (every element once in ``stride`` calls, the same ones on
every replica, so the positions are known to all): for each, the sign of ``residue +
grad``, and for each block of ``block`` of them the mean magnitude as the scale. Each
replica decodes ``sign * scale`` and keeps what it did not send in its residue
(EF-signSGD, Karimireddy et al. 2019, on a rotating share: the share sets the ratio,
32 * ``stride`` over float32 before the scales).

Measured on Adam's pseudo-updates in rounds of local steps it lost more than twice as
much accuracy as AdaComp at the same ratio: an element whose residue is small still
moves by its block's scale (docs/convergence.md, "Bins of 150, and the signs of a
rotating share"). It is a baseline, as TopK is.
"""

import math

import keras
import numpy as np
import tensorflow as tf

from tf_adacomp import _keywords
from tf_adacomp.compressors import base
from tf_adacomp.compressors import registry
from tf_adacomp.ops import checks


@registry.register("sign")
@keras.saving.register_keras_serializable(package="tf_adacomp")
class RotatingSign(base.Compressor):
  """Sends the sign of every ``stride``-th element of ``residue + grad``, rotating.

  Args:
    stride: int >= 1; a tensor sends one element in ``stride`` at each call, the next
      ones at the next call (1: every element, every call).
    block: int >= 1; the sent elements share one float32 scale per ``block`` of them.
    min_size: tensors with fewer elements are sent dense.

  Raises:
    ValueError: ``stride`` or ``block`` below 1, or ``min_size`` < 0.
  """

  @_keywords.suggest_keywords
  def __init__(self, stride: int = 4, block: int = 1024, min_size: int = 0):
    super().__init__(min_size=min_size)
    self.stride = checks.positive_int(stride, "stride")
    self.block = checks.positive_int(block, "block")

  def _always_dense(self, shape):
    return shape.num_elements() == 0

  def init(self, plan):
    if plan.dense:
      return ()
    # The residue, and the calls so far (the share a call sends: equal on every replica,
    # which all compress at every exchange).
    return (tf.zeros(plan.shape, base.residue_dtype(plan.dtype)), tf.zeros([], tf.int32))

  def _layout(self, plan):
    """``(rows, sent_words, blocks)``: the flat tensor as ``[rows, stride]``, one column
    sent a call; its ``rows`` signs in ``sent_words`` words, ``blocks`` scales."""
    rows = math.ceil(plan.num_elements / self.stride)
    return rows, math.ceil(rows / 32), math.ceil(rows / self.block)

  def _compress(self, grads, states, plans):
    (grad,), ((residue, calls),), (plan,) = grads, states, plans
    rows, words, blocks = self._layout(plan)
    n = plan.num_elements
    total = tf.reshape(residue + tf.cast(grad, residue.dtype), [-1])  # error feedback
    table = tf.reshape(tf.pad(total, [[0, rows * self.stride - n]]), [rows, self.stride])
    column = tf.math.floormod(calls, self.stride)
    chosen = tf.gather(table, column, axis=1)  # [rows]
    # Rows past the tensor's end in this column (its last row may be short).
    valid = tf.cast(tf.range(rows) * self.stride + column < n, chosen.dtype)
    # float32 on the wire: the residue keeps what the decoded float32 scales leave.
    scales = tf.cast(_block_means(tf.abs(chosen) * valid, valid, self.block, blocks),
                     tf.float32)
    positive = chosen >= 0
    sent = (tf.where(positive, valid, -valid)
            * tf.cast(tf.repeat(scales, self.block)[:rows], chosen.dtype))
    own = tf.reshape(tf.reshape(sent, [rows, 1]) * tf.one_hot(column, self.stride,
                                                             dtype=sent.dtype), [-1])[:n]
    payload = tf.concat([tf.reshape(column, [1]), _pack(positive, words),
                         tf.bitcast(scales, tf.int32)], 0)
    return payload, [(tf.reshape(total - own, plan.shape), calls + 1)]

  def _decompress(self, payload, plans):
    (plan,) = plans
    rows, words, blocks = self._layout(plan)
    payload = tf.reshape(payload, [-1, 1 + words + blocks])
    column = payload[0, 0]  # the same on every replica
    signs = tf.where(_unpack(payload[:, 1:1 + words], rows), 1.0, -1.0)
    scales = tf.bitcast(payload[:, 1 + words:], tf.float32)
    scaled = signs * tf.repeat(scales, self.block, axis=1)[:, :rows]
    # Replica contributions added in replica order, as the contract says.
    summed = scaled[0]
    for k in range(1, int(scaled.shape[0])):  # the replicas are a static dimension
      summed = summed + scaled[k]
    valid = tf.cast(tf.range(rows) * self.stride + column < plan.num_elements, tf.float32)
    dense = tf.reshape(tf.reshape(summed * valid, [rows, 1])
                       * tf.one_hot(column, self.stride), [-1])[:plan.num_elements]
    return [tf.cast(tf.reshape(dense, plan.shape), plan.dtype)]

  def _width(self, plans):
    (plan,) = plans
    _, words, blocks = self._layout(plan)
    return 1 + words + blocks

  def _nbytes(self, payload, plans):
    return tf.constant([4 * self._width(plans)], tf.int64)

  def get_config(self):
    return {**super().get_config(), "stride": self.stride, "block": self.block}


def _block_means(magnitudes, valid, block, blocks):
  """The mean of ``magnitudes`` over each block's valid entries (0 for none)."""
  pad = blocks * block - int(magnitudes.shape[0])
  sums = tf.reduce_sum(tf.reshape(tf.pad(magnitudes, [[0, pad]]), [blocks, block]), 1)
  counts = tf.reduce_sum(tf.reshape(tf.pad(valid, [[0, pad]]), [blocks, block]), 1)
  return sums / tf.maximum(counts, 1.0)


# Each bit of a word as an int32 (bit 31 negative). A NumPy array: a tensor made on
# import would initialise TensorFlow's devices before a user could split them.
_BITS = np.left_shift(np.int64(1), np.arange(32)).astype(np.uint32).view(np.int32)


def _pack(bits, words):
  """Booleans into int32 words, 32 a word, the first in the lowest bit."""
  padded = tf.pad(tf.cast(bits, tf.int32), [[0, words * 32 - int(bits.shape[0])]])
  return tf.reduce_sum(tf.reshape(padded, [words, 32]) * _BITS, 1)


def _unpack(words, count):
  """``[..., words]`` int32 into ``[..., count]`` booleans (``_pack``'s inverse)."""
  bits = tf.not_equal(tf.bitwise.bitwise_and(words[..., None], _BITS), 0)
  return tf.reshape(bits, tf.concat([tf.shape(words)[:-1], [-1]], 0))[..., :count]
