"""The range-based float (tf_adacomp.ops.rangefloat) against an independent NumPy reference.

The reference rounds arithmetically in float64 (frexp, a power-of-two step, np.round:
ties to even), where the implementation works on float32 bit patterns.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_adacomp.ops import compiled
from tf_adacomp.ops import rangefloat

FORMATS = [(4, 3), (3, 4), (5, 2), (1, 0), (2, 7), (8, 23), (8, 0), (6, 25 - 6)]


def round_mantissa(x, m):
  """Non-negative float64 ``x`` rounded to ``m`` mantissa bits, nearest, ties to even."""
  _, exponent = np.frexp(x)  # x = f * 2**exponent, f in [0.5, 1)
  step = np.ldexp(1.0, exponent - 1 - m)
  return np.where(x > 0, np.round(x / np.where(x > 0, step, 1.0)) * step, 0.0)


def reference(values, e, m):
  """``(decoded float32, top exponent t, codes)`` of the docs/fft.md definition."""
  v = np.asarray(values, np.float32).astype(np.float64)
  a = np.abs(v)
  top = round_mantissa(a.max(initial=0.0), m)
  t = int(np.frexp(top)[1]) - 1 if top >= 2.0**-126 else -126
  low = max(t - (2**e - 1) + 1, -126)
  keep = a >= 2.0**low
  q = np.where(keep, round_mantissa(a, m), 0.0)
  binade = np.where(keep, np.frexp(np.where(keep, q, 1.0))[1] - 1, 0)
  field_e = np.where(keep, binade - t + 2**e - 1, 0)
  field_m = np.where(keep, (q / np.ldexp(1.0, binade) - 1.0) * 2**m, 0).astype(np.int64)
  codes = np.where(keep, ((v < 0).astype(np.int64) << (e + m)) | (field_e << m) | field_m, 0)
  return (np.sign(v) * q).astype(np.float32), t, codes.astype(np.uint64)


def spread(rng, size, decades=8):
  """Values of both signs spread over many binades, with some exact zeros."""
  x = rng.standard_normal(size) * 10.0**rng.uniform(-decades / 2, decades / 2, size)
  x[rng.random(size) < 0.05] = 0.0
  return x.astype(np.float32)


@pytest.mark.parametrize("e,m", FORMATS)
def test_encode_matches_the_numpy_reference(e, m):
  values = spread(np.random.default_rng(e * 31 + m), 2000)
  codes, top, decoded, finite = rangefloat.encode(values, e, m)
  expected, t, expected_codes = reference(values, e, m)
  assert bool(finite) and int(top) == t
  np.testing.assert_array_equal(decoded.numpy(), expected)
  np.testing.assert_array_equal(codes.numpy().astype(np.uint64), expected_codes)
  assert codes.numpy().max() < 2**(1 + e + m)
  # The decoder gives back exactly what the encoder reported.
  np.testing.assert_array_equal(rangefloat.decode(codes, top, e, m).numpy(), expected)


@pytest.mark.parametrize("e,m", FORMATS)
def test_error_bound_in_range_and_flush_to_zero_below(e, m):
  values = spread(np.random.default_rng(7 + e + m), 3000, decades=12)
  _, top, decoded, _ = rangefloat.encode(values, e, m)
  decoded = decoded.numpy().astype(np.float64)
  x = values.astype(np.float64)
  smallest = 2.0**max(int(top) - 2**e + 2, -126)
  in_range = np.abs(x) >= smallest
  relative = np.abs(decoded - x)[in_range] / np.abs(x)[in_range]
  assert relative.max(initial=0.0) <= 2.0**-(m + 1)
  np.testing.assert_array_equal(decoded[~in_range], 0.0)
  assert np.all(np.abs(decoded) <= 2.0**(int(top) + 1))  # nothing leaves the top binade
  assert np.all(np.sign(decoded[in_range]) == np.sign(x[in_range]))


@pytest.mark.parametrize("e,m", [(4, 3), (3, 4), (8, 23)])
def test_representable_values_are_exact(e, m):
  rng = np.random.default_rng(3)
  t = 5
  field_e = rng.integers(1, 2**e, 500)
  field_m = rng.integers(0, 2**m, 500)
  values = (np.where(rng.random(500) < 0.5, -1, 1) * (1 + field_m / 2**m)
            * np.ldexp(1.0, t - (2**e - 1 - field_e))).astype(np.float32)
  values[0] = (2 - 2.0**-m) * 2.0**t  # the largest: sets t
  values = values[np.abs(values) >= 2.0**-126]  # 1+8+m formats reach below float32 normals
  codes, top, decoded, _ = rangefloat.encode(values, e, m)
  assert int(top) == t
  np.testing.assert_array_equal(decoded.numpy(), values)
  np.testing.assert_array_equal(rangefloat.decode(codes, top, e, m).numpy(), values)


def test_rounding_never_carries_out_of_the_top_binade():
  # 1.99 rounds to 2.0 with 3 mantissa bits: t must be 1, not 0.
  values = np.array([1.99, -0.3, 1e-3], np.float32)
  _, top, decoded, _ = rangefloat.encode(values, 4, 3)
  assert int(top) == 1
  np.testing.assert_array_equal(decoded.numpy(), reference(values, 4, 3)[0])
  assert decoded.numpy()[0] == 2.0


def test_ties_round_to_even():
  # 1 + 1/16 is half way between 1 and 1 + 1/8 (3 mantissa bits): to 1 (even).
  # 1 + 3/16 is half way between 1 + 1/8 and 1 + 2/8: to 1 + 2/8.
  values = np.array([4.0, 1.0625, 1.1875], np.float32)
  _, _, decoded, _ = rangefloat.encode(values, 4, 3)
  np.testing.assert_array_equal(decoded.numpy(), [4.0, 1.0, 1.25])


def test_zeros_tiny_values_and_non_finite_input():
  codes, top, decoded, finite = rangefloat.encode(np.zeros(4, np.float32), 4, 3)
  assert bool(finite) and int(top) == -126
  np.testing.assert_array_equal(codes.numpy(), 0)
  np.testing.assert_array_equal(decoded.numpy(), 0)
  # float32 subnormals are below every format's range.
  _, _, decoded, finite = rangefloat.encode(np.array([1e-40, -3e-41], np.float32), 8, 23)
  assert bool(finite)
  np.testing.assert_array_equal(decoded.numpy(), 0)
  for bad in (np.inf, -np.inf, np.nan):
    assert not bool(rangefloat.encode(np.array([1.0, bad], np.float32), 4, 3)[3])
  # Finite, but the maximum rounds beyond float32's range.
  assert not bool(rangefloat.encode(np.array([np.finfo(np.float32).max], np.float32), 4, 3)[3])


def test_compiles_with_xla():
  def round_trip(values, e, m):
    codes, top, decoded, finite = rangefloat.encode(values, e, m)
    return rangefloat.decode(codes, top, e, m), decoded, finite

  values = spread(np.random.default_rng(11), 1000)
  again, decoded, finite = compiled.kernel(round_trip, e=4, m=3)(tf.constant(values))
  assert bool(finite)
  np.testing.assert_array_equal(again.numpy(), reference(values, 4, 3)[0])
  np.testing.assert_array_equal(decoded.numpy(), again.numpy())


@pytest.mark.parametrize("kwargs,match", [
    ({"exponent_bits": 0, "mantissa_bits": 3}, "exponent_bits=0"),
    ({"exponent_bits": 9, "mantissa_bits": 3}, "exponent_bits=9"),
    ({"exponent_bits": 4.0, "mantissa_bits": 3}, "exponent_bits=4.0"),
    ({"exponent_bits": 4, "mantissa_bits": -1}, "mantissa_bits=-1"),
    ({"exponent_bits": 4, "mantissa_bits": 24}, "mantissa_bits=24"),
    ({"exponent_bits": True, "mantissa_bits": 3}, "exponent_bits=True"),
])
def test_bad_formats_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    rangefloat.check_format(**kwargs)
  with pytest.raises(ValueError, match=match):
    rangefloat.encode(np.ones(3, np.float32), **kwargs)


def test_encode_takes_float32_only():
  with pytest.raises(TypeError, match="float32"):
    rangefloat.encode(np.ones(3, np.float64), 4, 3)
