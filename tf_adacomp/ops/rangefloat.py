"""Range-based small floats (Wang et al., HPDC 2020): float32 values as 1+e+m bit codes.

A code has a sign bit, ``e`` exponent bits and ``m`` mantissa bits (sign in the top bit,
then the exponent field ``E``, then the mantissa field ``M``). Unlike IEEE formats the
exponent bias is not fixed: it comes from the data. With ``t``, the *top exponent*, the
binade of the largest magnitude after rounding (``2**t <= round(max |v|) < 2**(t + 1)``)
and ``E_max = 2**e - 1``:

    E == 0        ->  0 (any M; the encoder writes the all-zero code)
    1 <= E        ->  (-1)**sign * (1 + M / 2**m) * 2**(t - (E_max - E))

so the ``E_max`` binades ``t - E_max + 1 .. t`` are representable. Encoding:

- values with ``|v| < 2**max(t - E_max + 1, -126)`` (below the smallest representable
  magnitude, or below float32's smallest normal) are flushed to 0;
- the others are rounded to nearest (ties to even) on the mantissa, so that
  ``|q - v| <= 2**-(m + 1) * |v|``; values already representable are exact.

``t`` is chosen from the *rounded* maximum, so rounding never carries out of the top
binade. Every nonzero decoded value is a normal float32, built bit by bit: the encoder's
``decoded`` output equals ``decode(codes, t)`` exactly. A non-finite input, or a maximum
that rounds beyond float32's range, is reported by ``encode`` as not finite.

Everything here is pure TensorFlow on int32/uint32 bit patterns with static shifts, so it
compiles with XLA (the FFT kernels call it inside their compiled programs) and runs
eagerly too.
"""

from typing import Tuple

import tensorflow as tf

from tf_adacomp.ops import checks

MIN_EXPONENT_BITS, MAX_EXPONENT_BITS = 1, 8
MIN_MANTISSA_BITS, MAX_MANTISSA_BITS = 0, 23
# Range of the top exponent t: float32's normal binades.
MIN_TOP_EXPONENT, MAX_TOP_EXPONENT = -126, 127

_INF_BITS = 0x7F800000


def check_format(exponent_bits, mantissa_bits) -> Tuple[int, int]:
  """Validates a format: ``exponent_bits`` in [1, 8], ``mantissa_bits`` in [0, 23].

  Returns:
    ``(exponent_bits, mantissa_bits)`` as Python ints.

  Raises:
    ValueError: either is not an integer in its range (the error names it and its value).
  """
  return (checks.int_in_range(exponent_bits, "exponent_bits", MIN_EXPONENT_BITS,
                              MAX_EXPONENT_BITS),
          checks.int_in_range(mantissa_bits, "mantissa_bits", MIN_MANTISSA_BITS,
                              MAX_MANTISSA_BITS))


def value_bits(exponent_bits: int, mantissa_bits: int) -> int:
  """Width of one code: sign, exponent and mantissa bits (at most 32)."""
  exponent_bits, mantissa_bits = check_format(exponent_bits, mantissa_bits)
  return 1 + exponent_bits + mantissa_bits


def _round_magnitude(a, mantissa_bits: int):
  """Float32 magnitude bit patterns (int32, finite) rounded to ``mantissa_bits`` bits.

  Adding half an ulp of the target precision (minus one, plus the lowest kept bit: ties
  to even) and truncating rounds to nearest; a carry moves into the exponent field, as
  it should.
  """
  shift = 23 - mantissa_bits
  if shift == 0:
    return a
  lowest_kept = tf.bitwise.bitwise_and(tf.bitwise.right_shift(a, shift), 1)
  rounded = a + ((1 << (shift - 1)) - 1) + lowest_kept
  return tf.bitwise.bitwise_and(rounded, tf.constant(~((1 << shift) - 1), tf.int32))


def encode(values, exponent_bits: int, mantissa_bits: int):
  """Quantizes float32 values to range-based float codes.

  Args:
    values: float32 tensor (any shape, static or not).
    exponent_bits: int in [1, 8].
    mantissa_bits: int in [0, 23].

  Returns:
    ``(codes, top_exponent, decoded, finite)``: uint32 codes of the shape of ``values``
    (each < 2**(1 + exponent_bits + mantissa_bits)), the int32 scalar top exponent t
    (in [-126, 127]), the float32 values the codes decode to, and a bool scalar, False
    when a value is not finite or the largest rounds beyond float32's range (codes are
    then meaningless).

  Raises:
    TypeError: ``values`` is not float32.
    ValueError: bad ``exponent_bits`` or ``mantissa_bits``.
  """
  e, m = check_format(exponent_bits, mantissa_bits)
  values = tf.convert_to_tensor(values)
  if values.dtype != tf.float32:
    raise TypeError(f"`values` must be float32. Received: values with dtype {values.dtype.name}")
  e_max = (1 << e) - 1
  bits = tf.bitcast(values, tf.int32)
  negative = bits < 0
  a = tf.bitwise.bitwise_and(bits, 0x7FFFFFFF)
  finite = tf.reduce_all(a < _INF_BITS)
  a = tf.where(a < _INF_BITS, a, 0)  # keeps the arithmetic below in range
  rounded = _round_magnitude(a, m)
  # Magnitude bit patterns order like the magnitudes: the largest pattern is the maximum.
  top_biased = tf.bitwise.right_shift(tf.reduce_max(tf.concat([tf.reshape(rounded, [-1]),
                                                               [0]], 0)), 23)
  finite &= top_biased < 255
  top_biased = tf.clip_by_value(top_biased, 1, 254)
  low_biased = tf.maximum(top_biased - (e_max - 1), 1)
  keep = a >= tf.bitwise.left_shift(low_biased, 23)
  field_e = tf.bitwise.right_shift(rounded, 23) - top_biased + e_max
  field_m = tf.bitwise.bitwise_and(tf.bitwise.right_shift(rounded, 23 - m), (1 << m) - 1)
  code = tf.bitwise.bitwise_or(tf.bitwise.left_shift(tf.cast(negative, tf.int32), e + m),
                               tf.bitwise.bitwise_or(tf.bitwise.left_shift(field_e, m), field_m))
  # int32 -> uint32 keeps the bits (a 32-bit code has its sign in bit 31).
  codes = tf.bitcast(tf.where(keep, code, 0), tf.uint32)
  decoded = tf.where(keep, tf.bitcast(tf.bitwise.bitwise_or(
      tf.bitwise.left_shift(tf.cast(negative, tf.int32), 31), rounded), tf.float32),
                     tf.zeros_like(values))
  return codes, top_biased - 127, decoded, finite


def decode(codes, top_exponent, exponent_bits: int, mantissa_bits: int):
  """Float32 values of range-based float codes.

  Args:
    codes: uint32 tensor of codes.
    top_exponent: int32 scalar tensor t, in [-126, 127] for codes from ``encode``.
    exponent_bits: int in [1, 8].
    mantissa_bits: int in [0, 23].

  Returns:
    A float32 tensor of the shape of ``codes``. Codes whose exponent would fall outside
    float32's normal range (only from a malformed t) decode to 0 below it, inf above.

  Raises:
    ValueError: bad ``exponent_bits`` or ``mantissa_bits``.
  """
  e, m = check_format(exponent_bits, mantissa_bits)
  codes = tf.bitcast(tf.convert_to_tensor(codes, tf.uint32), tf.int32)
  e_max = (1 << e) - 1
  # Shifts on int32 are arithmetic: every field is masked after its shift.
  sign = tf.bitwise.bitwise_and(tf.bitwise.right_shift(codes, e + m), 1)
  field_e = tf.bitwise.bitwise_and(tf.bitwise.right_shift(codes, m), e_max)
  field_m = tf.bitwise.bitwise_and(codes, (1 << m) - 1)
  biased = field_e - e_max + tf.cast(top_exponent, tf.int32) + 127
  magnitude = tf.bitwise.bitwise_or(tf.bitwise.left_shift(tf.clip_by_value(biased, 0, 255), 23),
                                    tf.bitwise.left_shift(field_m, 23 - m))
  magnitude = tf.where(biased >= 255, _INF_BITS, magnitude)
  value = tf.bitcast(tf.bitwise.bitwise_or(tf.bitwise.left_shift(sign, 31), magnitude),
                     tf.float32)
  return tf.where((field_e == 0) | (biased <= 0), tf.zeros_like(value), value)
