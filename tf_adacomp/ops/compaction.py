"""Stream compaction for XLA: the positions of the set bits of a bitmap.

XLA needs static shapes, so the output has a fixed ``capacity`` and a count. On CPU a
per-element scatter, or XLA's cumulative sum over every element, costs several times a
pass over the data, so this works on 32-bit bitmap words instead:

- ``pack_mask`` lays the flat mask out as ``[blocks, 32]`` (element ``i`` is bit
  ``i % 32`` of word ``i // 32``): each word reads 32 consecutive elements, so the pass
  that computes the mask and packs it streams through the data once;
- block offsets come from a cumulative sum over words (32x fewer than elements), and
  each output slot finds its word with one scatter of one mark per non-empty word and
  a scan over slots, then its bit with population counts.

Positions come out in increasing order; when more bits are set than ``capacity``, the
first ``capacity`` (the lowest positions) are kept.
"""

import numpy as np
import tensorflow as tf

WORD_BITS = 32


def blocks_for(num_elements: int) -> int:
  """Number of bitmap words for ``num_elements`` mask bits."""
  return -(-num_elements // WORD_BITS)


def to_words(flat: tf.Tensor, blocks: int) -> tf.Tensor:
  """Pads a 1-D tensor to ``32 * blocks`` and views it as ``[blocks, 32]``."""
  n = int(flat.shape[0])
  return tf.reshape(tf.pad(flat, [[0, WORD_BITS * blocks - n]]), [blocks, WORD_BITS])


def pack_mask(rows: tf.Tensor) -> tf.Tensor:
  """Packs a bool ``[blocks, 32]`` mask into ``blocks`` uint32 words (column k -> bit k)."""
  weights = tf.constant([1 << k for k in range(WORD_BITS)], tf.uint32)
  # Disjoint bits: the sum is their bitwise or. A row reduction over 32 consecutive
  # elements fuses with the mask's computation into one streaming pass on XLA:CPU; the
  # other layout ([32, blocks], a reduction over the leading axis) reads 32 strided
  # streams and was much slower (docs/history.md).
  return tf.reduce_sum(tf.where(rows, weights, tf.zeros_like(weights)), axis=1)


def unpack_mask(words: tf.Tensor) -> tf.Tensor:
  """The bool ``[blocks, 32]`` mask of ``words`` (inverse of ``pack_mask``)."""
  shifts = tf.constant([k for k in range(WORD_BITS)], tf.uint32)
  return tf.bitwise.bitwise_and(tf.bitwise.right_shift(words[:, None], shifts), 1) > 0


def popcount(words: tf.Tensor) -> tf.Tensor:
  """Number of set bits of each uint32 word, as int32."""
  return tf.cast(tf.raw_ops.PopulationCount(x=words), tf.int32)


def cumsum(x: tf.Tensor, exclusive: bool = False) -> tf.Tensor:
  """Cumulative sum of a 1-D int32 tensor of small counts, for XLA:CPU.

  XLA's own cumulative sum costs several passes over the data on CPU. Here rows of 32
  are scanned by one float32 matmul with a triangular matrix of ones (vectorised, and
  exact while a row sums to less than 2**24: every input here is a bit count <= 32 or a
  0/1 mark), and the row totals recursively in int32.
  """
  n = int(x.shape[0])
  if n <= 2 * WORD_BITS:
    return tf.cumsum(x, exclusive=exclusive)
  rows = -(-n // WORD_BITS)
  table = tf.reshape(tf.pad(x, [[0, rows * WORD_BITS - n]]), [rows, WORD_BITS])
  upper = tf.constant(np.triu(np.ones([WORD_BITS, WORD_BITS], np.float32)))
  table = tf.cast(tf.matmul(tf.cast(table, tf.float32), upper), tf.int32)
  table += cumsum(table[:, -1], exclusive=True)[:, None]
  inclusive = tf.reshape(table, [-1])[:n]
  if exclusive:
    return inclusive - x
  return inclusive


def nth_set_bit(words: tf.Tensor, n: tf.Tensor) -> tf.Tensor:
  """Position (0-31) of the ``n``-th (0-based) set bit of each uint32 word.

  A binary search with population counts; ``n`` must be below the word's popcount.
  """
  pos = tf.zeros_like(n)
  for width in (16, 8, 4, 2, 1):
    low = popcount(tf.bitwise.bitwise_and(words, (1 << width) - 1))
    go = n >= low
    n = tf.where(go, n - low, n)
    pos = tf.where(go, pos + width, pos)
    words = tf.where(go, tf.bitwise.right_shift(words, width), words)
  return pos


def keep_lowest_set_bits(words: tf.Tensor, keep: tf.Tensor) -> tf.Tensor:
  """Clears all but the ``keep`` (int32, >= 0) lowest set bits of each word."""
  has_more = keep < popcount(words)
  cut = tf.cast(nth_set_bit(words, tf.where(has_more, keep, 0)), tf.uint32)
  # Bits below position `cut`; `cut` < 32 wherever it is used, so the shift is defined.
  below = tf.bitwise.left_shift(tf.ones_like(words), cut) - 1
  return tf.where(has_more, tf.bitwise.bitwise_and(words, below), words)


def select_positions(words: tf.Tensor, capacity: int):
  """Positions of the first ``capacity`` set bits of a ``pack_mask`` bitmap.

  Args:
    words: 1-D ``uint32`` bitmap of ``blocks`` words with a static length.
    capacity: Python int, the static number of output slots.

  Returns:
    ``(positions, count, total)``: int32 ``[capacity]`` flat positions
    (``32 * word + bit``, increasing), valid in the first ``count = min(total, capacity)``
    slots and 0 after; ``total`` is the number of set bits of ``words``.
  """
  blocks = int(words.shape[0])
  counts = popcount(words)
  offsets = cumsum(counts, exclusive=True)
  total = tf.reduce_sum(counts)
  count = tf.minimum(total, capacity)
  if capacity == 0 or blocks == 0:
    return tf.zeros([capacity], tf.int32), count, total

  nonempty = (counts > 0) & (offsets < capacity)
  ordinal = cumsum(tf.cast(nonempty, tf.int32), exclusive=True)
  # The non-empty words in order; every other word goes to a discarded slot of its own
  # past them. One shared discarded slot made every empty word an atomic add on the same
  # address: on an H100 that serialised scatter was half of a 16M-element compress.
  word_ids = tf.range(blocks, dtype=tf.int32)
  word_list = tf.scatter_nd(tf.where(nonempty, ordinal, blocks + word_ids)[:, None],
                            word_ids, [2 * blocks])
  # A 1 at the first slot of every non-empty word: the running count of these marks
  # turns a slot into the ordinal of the word that fills it.
  marks = tf.scatter_nd(tf.where(nonempty, offsets, capacity)[:, None],
                        tf.ones([blocks], tf.int32), [capacity + 1])
  slot_word = tf.gather(word_list, tf.maximum(cumsum(marks[:capacity]) - 1, 0))
  slots = tf.range(capacity, dtype=tf.int32)
  bit = nth_set_bit(tf.gather(words, slot_word), slots - tf.gather(offsets, slot_word))
  positions = tf.where(slots < count, slot_word * WORD_BITS + bit, 0)
  return positions, count, total


def kept_words(words: tf.Tensor, capacity: int) -> tf.Tensor:
  """The bitmap of the bits ``select_positions`` keeps: the first ``capacity`` set bits."""
  offsets = cumsum(popcount(words), exclusive=True)
  return keep_lowest_set_bits(words, tf.maximum(capacity - offsets, 0))
