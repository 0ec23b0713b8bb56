"""The building blocks of the kernels against plain NumPy, under XLA as in the kernels."""

import numpy as np
import pytest
import tensorflow as tf

from tf_adacomp.ops import bitpack
from tf_adacomp.ops import compaction
import tiers


def _xla(fn, *args):
  return tf.function(fn, jit_compile=True)(*args)


def _numpy_pack(codes, bits):
  stream = np.zeros(len(codes) * bits, np.uint8)
  for j, code in enumerate(codes):
    for t in range(bits):
      stream[j * bits + t] = (int(code) >> t) & 1
  words = np.zeros(bitpack.packed_words(len(codes), bits), np.uint64)
  for p, bit in enumerate(stream):
    words[p // 32] |= np.uint64(int(bit) << (p % 32))
  return words.astype(np.uint32)


PACK_BITS = [1, 2, 3, 5, 8, 13, 17, 21, 31, 32]
PACK_COUNTS = [1, 31, 32, 33, 100]


# Every count with every width with --full; the fast tier each width once, the counts in
# turn (each count twice: within a word, a word's end, across words, several words).
@pytest.mark.parametrize("count,bits", [
    pytest.param(count, bits, id=f"{count}-{bits}",
                 marks=() if j % len(PACK_COUNTS) == i else pytest.mark.slow)
    for i, count in enumerate(PACK_COUNTS) for j, bits in enumerate(PACK_BITS)])
def test_pack_matches_numpy_and_unpacks(bits, count):
  rng = np.random.default_rng(bits * 1000 + count)
  codes = rng.integers(0, 2**bits, size=count, dtype=np.uint64).astype(np.uint32)
  words = _xla(lambda c: bitpack.pack(c, bits), tf.constant(codes))
  np.testing.assert_array_equal(words.numpy(), _numpy_pack(codes, bits))
  back = _xla(lambda w: bitpack.unpack(w, count, bits), words)
  np.testing.assert_array_equal(back.numpy(), codes)


@pytest.mark.parametrize("count", [1, 33, 100])
def test_a_width_read_when_the_program_runs_packs_and_unpacks_as_numpy(count):
  # One compiled program for every width (bitpack.pack_at, scatter_words, unpack_at):
  # a payload's own width (docs/wire_format.md#positions-elias-fano).
  rng = np.random.default_rng(count)
  nwords = bitpack.packed_words(count, 32) + 2

  def pack(codes, bits, live):
    return bitpack.scatter_words(*bitpack.pack_at(codes, bits, live, nwords), nwords)

  def unpack(words, first, bits):
    return bitpack.unpack_at(words, first, count, bits)

  pack_xla, unpack_xla = tf.function(pack, jit_compile=True), tf.function(unpack, jit_compile=True)
  for bits in PACK_BITS:
    codes = rng.integers(0, 2**bits, size=count, dtype=np.uint64)
    live = np.arange(count) < count - 1  # the last code is not written
    words = pack_xla(tf.constant(codes.astype(np.int64)), tf.constant(bits, tf.int64),
                     tf.constant(live)).numpy()
    want = np.zeros(nwords, np.uint32)
    packed = _numpy_pack(codes[:-1], bits)
    want[:packed.size] = packed
    np.testing.assert_array_equal(words, want, err_msg=f"bits={bits}")
    # Read from the second code on: the unwritten last code and the one past the end
    # read as zeros.
    got = unpack_xla(tf.constant(words), tf.constant(1), tf.constant(bits)).numpy()
    np.testing.assert_array_equal(got, np.append(codes[1:-1], [0, 0])[:count].astype(np.uint32),
                                  err_msg=f"bits={bits}")


def test_pack_of_nothing_is_empty():
  assert bitpack.pack(tf.zeros([0], tf.uint32), 7).shape == [0]
  assert bitpack.unpack(tf.zeros([0], tf.uint32), 0, 7).shape == [0]


@pytest.mark.parametrize("n", [1, 65, 1000, 5000])
def test_cumsum_matches_numpy(n):
  x = np.random.default_rng(n).integers(0, 33, size=n).astype(np.int32)
  np.testing.assert_array_equal(_xla(compaction.cumsum, tf.constant(x)), np.cumsum(x))
  np.testing.assert_array_equal(
      _xla(lambda t: compaction.cumsum(t, exclusive=True), tf.constant(x)),
      np.cumsum(x) - x)


def test_nth_set_bit_and_keep_lowest():
  words = np.array([0b1011, 0x80000001, 0xFFFFFFFF, 0b100], np.uint32)
  n = np.array([2, 1, 31, 0], np.int32)
  np.testing.assert_array_equal(
      compaction.nth_set_bit(tf.constant(words), tf.constant(n)), [3, 31, 31, 2])
  kept = compaction.keep_lowest_set_bits(tf.constant(words), tf.constant([2, 0, 32, 5]))
  np.testing.assert_array_equal(kept, [0b11, 0, 0xFFFFFFFF, 0b100])


# The fast tier: one element, a capacity that binds, and nothing selected; the others
# with --full.
@pytest.mark.parametrize("n,density,capacity", tiers.fast_only([
    (1, 1.0, 1), (100, 0.3, 100), (1000, 0.05, 20), (4096, 0.5, 4096), (777, 0.0, 5),
    (3000, 1.0, 500)], keep={0, 2, 4}))
def test_select_positions_follows_the_flat_order(n, density, capacity):
  rng = np.random.default_rng(n)
  mask = rng.random(n) < density
  blocks = compaction.blocks_for(n)

  def run(m):
    words = compaction.pack_mask(compaction.to_words(m, blocks))
    positions, count, total = compaction.select_positions(words, capacity)
    kept = compaction.unpack_mask(compaction.kept_words(words, capacity))
    return positions, count, total, tf.reshape(kept, [-1])[:n]

  positions, count, total, kept = _xla(run, tf.constant(mask))
  selected = np.flatnonzero(mask)
  expected = selected[:capacity]
  assert int(total) == len(selected) and int(count) == len(expected)
  np.testing.assert_array_equal(positions.numpy()[:len(expected)], expected)
  np.testing.assert_array_equal(positions.numpy()[len(expected):], 0)
  np.testing.assert_array_equal(np.flatnonzero(kept.numpy()), np.sort(expected))
