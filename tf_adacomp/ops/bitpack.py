"""Fixed-width bit packing of unsigned codes into 32-bit words, for XLA.

A stream of ``count`` codes of ``bits`` bits each is laid out little-endian: code ``j``
occupies stream bits ``[j * bits, (j + 1) * bits)``, and stream bit ``p`` is bit
``p % 32`` of word ``p // 32``. In ``pack`` and ``unpack`` every shape and shift is
static, so both directions compile to a handful of fused element-wise XLA loops with no
scatter: each output word is assembled from the few codes that overlap it (packing) and
each code is read from the two words that may hold it (unpacking). ``pack_at`` with
``scatter_words``, and ``unpack_at``, take a width known only when the program runs (a
payload's own, docs/wire_format.md#positions-elias-fano): a scatter of each code's two
pieces, and gathers.
"""

import math
from typing import Tuple

import numpy as np
import tensorflow as tf


def packed_words(count: int, bits: int) -> int:
  """Number of 32-bit words that hold ``count`` codes of ``bits`` bits."""
  return (count * bits + 31) // 32


def _pack_tables(bits: int):
  """Static tables for one group of 32 codes, which fills exactly ``bits`` words.

  For word ``w`` of a group and each of the ``m`` codes that may overlap it, returns the
  code's index within the group, the left shift (32 + s, where s is the code's first
  bit relative to the word's first bit) and whether that code overlaps the word at all.
  """
  overlap = math.ceil(32 / bits) + 1
  code = np.zeros([bits, overlap], np.int32)
  shift = np.zeros([bits, overlap], np.uint64)
  valid = np.zeros([bits, overlap], bool)
  for w in range(bits):
    first = (32 * w) // bits
    for m in range(overlap):
      j = first + m
      s = j * bits - 32 * w
      if j < 32 and s < 32 and s + bits > 0:
        code[w, m], shift[w, m], valid[w, m] = j, 32 + s, True
  return code, shift, valid


def pack(codes: tf.Tensor, bits: int) -> tf.Tensor:
  """Packs a 1-D uint32 tensor of codes (each < 2**bits) into uint32 words.

  Args:
    codes: 1-D ``uint32`` tensor with a static length.
    bits: Python int in [1, 32], the width of every code.

  Returns:
    A 1-D ``uint32`` tensor of ``packed_words(len(codes), bits)`` words.
  """
  count = int(codes.shape[0])
  if count == 0:
    return tf.zeros([0], tf.uint32)
  groups = -(-count // 32)
  padded = tf.pad(codes, [[0, groups * 32 - count]])
  grouped = tf.cast(tf.reshape(padded, [groups, 32]), tf.uint64)
  code_idx, shift, valid = _pack_tables(bits)
  # [groups, bits, overlap]: each code shifted so that >> 32 leaves exactly the bits
  # that fall inside the word; the parts are disjoint, so a sum is a bitwise or.
  parts = tf.gather(grouped, code_idx, axis=1)
  parts = tf.bitwise.right_shift(tf.bitwise.left_shift(parts, shift), tf.constant(32, tf.uint64))
  parts = tf.where(valid, parts, tf.zeros_like(parts))
  words = tf.cast(tf.reduce_sum(parts, axis=2), tf.uint32)
  return tf.reshape(words, [-1])[:packed_words(count, bits)]


def unpack(words: tf.Tensor, count: int, bits: int) -> tf.Tensor:
  """Reads ``count`` codes of ``bits`` bits back from 1-D uint32 ``words``.

  Args:
    words: 1-D ``uint32`` tensor with at least ``packed_words(count, bits)`` words.
    count: Python int, how many codes to read.
    bits: Python int in [1, 32].

  Returns:
    A 1-D ``uint32`` tensor of ``count`` codes.
  """
  if count == 0:
    return tf.zeros([0], tf.uint32)
  # Computed in the graph, not as NumPy constants: a constant per code would be
  # embedded in the compiled program (gigabytes for tensors of tens of millions).
  start = tf.range(count, dtype=tf.int64) * bits
  first = start // 32
  # One guard word so that the "next word" of the last code always exists.
  wide = tf.cast(tf.concat([words, tf.zeros([1], words.dtype)], 0), tf.uint64)
  lo = tf.gather(wide, first)
  hi = tf.gather(wide, first + 1)
  both = tf.bitwise.bitwise_or(lo, tf.bitwise.left_shift(hi, tf.constant(32, tf.uint64)))
  mask = tf.constant((1 << bits) - 1, tf.uint64)
  codes = tf.bitwise.bitwise_and(
      tf.bitwise.right_shift(both, tf.cast(start % 32, tf.uint64)), mask)
  return tf.cast(codes, tf.uint32)


def pack_at(codes: tf.Tensor, bits, live, nwords: int) -> Tuple[tf.Tensor, tf.Tensor]:
  """The pieces of codes of a width ``bits`` that is a tensor, for ``scatter_words``.

  Code ``j`` occupies stream bits ``[j * bits, (j + 1) * bits)``, as ``pack`` lays them
  out; it touches at most two words. Only the codes where ``live`` is true are written.

  Args:
    codes: 1-D ``int64`` codes, each below ``2**bits``.
    bits: int64 scalar tensor in [1, 32].
    live: 1-D bool, which codes to write.
    nwords: Python int, the words of the stream (a dead code goes to word ``nwords``,
      the sink).

  Returns:
    ``(word ids, int64 values)``: each piece's word and its bits there.
  """
  start = tf.range(tf.shape(codes, out_type=tf.int64)[0]) * bits
  word = tf.where(live, tf.bitwise.right_shift(start, 5), nwords)
  shifted = tf.bitwise.left_shift(tf.where(live, codes, 0), tf.bitwise.bitwise_and(start, 31))
  low = tf.bitwise.bitwise_and(shifted, 0xFFFFFFFF)
  high = tf.bitwise.right_shift(shifted, 32)
  return (tf.concat([word, tf.minimum(word + 1, nwords)], 0), tf.concat([low, high], 0))


def scatter_words(ids, values, nwords: int) -> tf.Tensor:
  """``nwords`` uint32 words from the disjoint bits ``values`` (int64, each below 2**32)
  added at word ``ids`` (``nwords``: dropped). Disjoint bits add as a bitwise or."""
  summed = tf.math.unsorted_segment_sum(values, tf.cast(ids, tf.int32), nwords + 1)
  return tf.cast(tf.bitwise.bitwise_and(summed[:nwords], 0xFFFFFFFF), tf.uint32)


def unpack_at(words: tf.Tensor, first: tf.Tensor, count: int, bits) -> tf.Tensor:
  """Reads codes ``first .. first + count - 1`` of width ``bits`` (a tensor: the width is
  read from the payload) from 1-D uint32 ``words``; words past the end read as zeros.

  Args:
    words: 1-D ``uint32`` tensor.
    first: int scalar tensor, the ordinal of the first code to read.
    count: Python int, how many codes to read.
    bits: int scalar tensor in [1, 32].

  Returns:
    A 1-D ``uint32`` tensor of ``count`` codes.
  """
  n = int(words.shape[0])
  bits = tf.cast(bits, tf.int64)
  start = (tf.cast(first, tf.int64) + tf.range(count, dtype=tf.int64)) * bits
  first_word = tf.cast(tf.minimum(tf.bitwise.right_shift(start, 5), n), tf.int32)
  # A guard word of zeros: the index past the end, and the "next word" of the last code.
  guarded = tf.concat([words, tf.zeros([1], words.dtype)], 0)
  shift = tf.cast(tf.bitwise.bitwise_and(start, 31), tf.uint32)
  lo = tf.bitwise.right_shift(tf.gather(guarded, first_word), shift)
  # The next word's bits above the first word's: none when the code starts at bit 0
  # (a shift by 32 is not defined).
  hi = tf.where(shift > 0, tf.bitwise.left_shift(
      tf.gather(guarded, tf.minimum(first_word + 1, n)), (32 - shift) % 32), 0)
  mask = tf.where(bits >= 32, tf.constant(0xFFFFFFFF, tf.uint32), tf.bitwise.left_shift(
      tf.constant(1, tf.uint32), tf.cast(tf.minimum(bits, 31), tf.uint32)) - 1)
  return tf.bitwise.bitwise_and(tf.bitwise.bitwise_or(lo, hi), mask)
