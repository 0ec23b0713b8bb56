"""The FFT kernels (tf_adacomp.ops.fft) against an independent NumPy reference.

The reference uses numpy.fft (in float64) and reads payloads bit by bit from the
documented wire format (docs/fft.md); it shares no code with tf_adacomp. The float32 FFT
of the kernels differs from NumPy's by rounding, so coefficient selections are compared
away from ties and values with a tolerance; what the kernels must agree with themselves
on (residue = G - decoded, replica sums) is checked bit for bit.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from tf_adacomp.ops import fft_compress
from tf_adacomp.ops import fft_decompress
from tf_adacomp.ops import fft_payload_nbytes
from tf_adacomp.ops import fft_payload_words
import tiers

HEADER = 3
NONFINITE = -2**31


# ---------------------------------------------------------------------------- reference


def kept(n, theta):
  m = n // 2 + 1
  return max(1, min(m, math.ceil((1 - theta) * m)))


def index_bits(m):
  return (m - 1).bit_length() if m > 1 else 0


def read_codes(words, start_bit, count, bits):
  """``count`` codes of ``bits`` bits from a little-endian stream of int32 words."""
  stream = np.unpackbits(np.asarray(words, "<i4").view(np.uint8), bitorder="little")
  codes = np.zeros(count, np.int64)
  for b in range(bits):
    codes |= stream[start_bit + np.arange(count) * bits + b].astype(np.int64) << b
  return codes


def range_float_value(codes, t, e, m):
  sign = np.where((codes >> (e + m)) & 1, -1.0, 1.0)
  field_e = (codes >> m) & (2**e - 1)
  field_m = codes & (2**m - 1)
  value = sign * (1 + field_m / 2**m) * np.ldexp(1.0, t - (2**e - 1) + field_e)
  return np.where(field_e == 0, 0.0, value)


def parse(payload, n, e, m):
  """``(positions, coefficients, count, top)`` of one payload, read from its words."""
  words = np.asarray(payload)
  count, fmt, top = int(words[0]), int(words[1]), int(words[2])
  ib = index_bits(n // 2 + 1)
  assert fmt == ib | e << 8 | m << 16
  if top == NONFINITE:
    return None, None, count, top
  vb = 1 + e + m
  body = words[HEADER:]
  positions = read_codes(body, 0, count, ib) if ib else np.zeros(count, np.int64)
  start = 32 * ((count * ib + 31) // 32)
  values = range_float_value(read_codes(body, start, 2 * count, vb), top, e, m)
  return positions, values[0::2] + 1j * values[1::2], count, top


def numpy_decode(payload, n, e, m):
  positions, coefficients, _, _ = parse(payload, n, e, m)
  spectrum = np.zeros(n // 2 + 1, np.complex128)
  np.add.at(spectrum, positions, coefficients)
  return np.fft.irfft(spectrum, n)


def used_words(count, n, e, m):
  return HEADER + -(-count * index_bits(n // 2 + 1) // 32) + -(-2 * count * (1 + e + m) // 32)


def run(grad, residue, theta, e=4, m=3, **kwargs):
  payload, new_residue = fft_compress(tf.constant(grad), tf.constant(residue), theta, e, m,
                                      **kwargs)
  return payload.numpy(), new_residue.numpy()


# ---------------------------------------------------------------------------- tests


# The fast tier: rank 2, the float32-like format (8, 23) and one element; the other
# formats and shapes (the same kernel; theta 0 is test_theta_zero_loses_only_the_rounding's)
# with --full.
@pytest.mark.parametrize("shape,theta,e,m", tiers.fast_only([
    ([64, 33], 0.9, 4, 3), ([1001], 0.75, 3, 4), ([8, 8], 0.0, 5, 10), ([7], 0.5, 4, 3),
    ([2], 0.9, 8, 23), ([1], 0.3, 4, 3)], keep={0, 4, 5}))
def test_compress_matches_numpy(shape, theta, e, m):
  rng = np.random.default_rng(sum(shape))
  grad = rng.standard_normal(shape).astype(np.float32)
  residue = (0.5 * rng.standard_normal(shape)).astype(np.float32)
  payload, new_residue = run(grad, residue, theta, e, m)
  n = grad.size
  g = (residue + grad).reshape(-1)  # float32, as the kernel adds them
  spectrum = np.fft.rfft(g.astype(np.float64))
  k = kept(n, theta)
  positions, coefficients, count, top = parse(payload, n, e, m)
  assert count == k and len(set(positions.tolist())) == k
  assert payload.shape == (fft_payload_words(n, theta, e, m),)

  # The k coefficients of largest magnitude (up to ties within float32 rounding).
  magnitude = np.abs(spectrum)
  kth = np.sort(magnitude)[::-1][k - 1]
  expected = set(np.flatnonzero(magnitude > kth * (1 + 1e-5)).tolist())
  assert expected <= set(positions.tolist())
  assert np.all(magnitude[positions] >= kth * (1 - 1e-5))

  # Each sent part is the range float of the exact part: 2**-(m+1) relative, or 0 below
  # the format's smallest magnitude (float32 FFT rounding aside).
  scale = np.abs(spectrum).max()
  tol = 1e-5 * scale
  smallest = 2.0**max(top - 2**e + 2, -126)
  for sent, exact in ((coefficients.real, spectrum[positions].real),
                      (coefficients.imag, spectrum[positions].imag)):
    big = np.abs(exact) >= smallest + tol
    assert np.all(np.abs(sent - exact)[big] <= 2.0**-(m + 1) * np.abs(exact)[big] + tol)
    assert np.all(np.abs(sent)[np.abs(exact) < smallest - tol] == 0)

  decoded = fft_decompress(payload, shape, theta, tf.float32, e, m).numpy()
  np.testing.assert_allclose(decoded.reshape(-1), numpy_decode(payload, n, e, m),
                             atol=1e-5 * scale / math.sqrt(n) + 1e-6)
  # The residue is G minus the decoded payload, both computed by the kernels.
  np.testing.assert_array_equal(new_residue.reshape(-1), g - decoded.reshape(-1))
  # The unused tail of the static buffer is zero.
  np.testing.assert_array_equal(payload[used_words(k, n, e, m):], 0)


def test_theta_zero_loses_only_the_rounding():
  rng = np.random.default_rng(5)
  grad = rng.standard_normal([40, 25]).astype(np.float32)
  for m, tol in ((3, 0.07), (10, 6e-4), (23, 1e-6)):
    payload, _ = run(grad, np.zeros_like(grad), 0.0, 8, m)
    decoded = fft_decompress(payload, [40, 25], 0.0, tf.float32, 8, m).numpy()
    # Every coefficient is sent; each part within 2**-(m+1) of itself, so the whole
    # within the same relative error (Parseval), plus float32 FFT rounding.
    error = np.linalg.norm(decoded - grad) / np.linalg.norm(grad)
    assert error <= max(2.0**-(m + 1), 2e-6) and error <= tol


def test_decode_of_several_replicas_is_the_sum_in_replica_order():
  rng = np.random.default_rng(9)
  shape, theta = [30, 20], 0.8
  payloads = [run(rng.standard_normal(shape).astype(np.float32), np.zeros(shape, np.float32),
                  theta)[0] for _ in range(3)]
  total = fft_decompress(np.stack(payloads), shape, theta).numpy()
  expected = sum(numpy_decode(p, 600, 4, 3) for p in payloads).reshape(shape)
  np.testing.assert_allclose(total, expected, atol=1e-5)
  singles = sum(fft_decompress(p, shape, theta).numpy() for p in payloads)
  np.testing.assert_allclose(total, singles, atol=1e-5)
  # Rows trimmed to their used words and zero-padded, as the exchange sends them.
  nbytes = fft_payload_nbytes(np.stack(payloads), 600, theta).numpy()
  trimmed = np.stack([np.where(np.arange(p.size) < b // 4, p, 0) for p, b in zip(payloads, nbytes)])
  np.testing.assert_array_equal(fft_decompress(trimmed, shape, theta).numpy(), total)


# The fast tier: several words and one element; the others with --full.
@pytest.mark.parametrize("n,theta,e,m", tiers.fast_only(
    [(512 * 3, 0.9, 4, 3), (100, 0.5, 3, 4), (1, 0.9, 4, 3), (5000, 0.99, 8, 23)],
    keep={0, 2}))
def test_bytes_are_header_and_used_words_and_fewer_than_dense(n, theta, e, m):
  grad = np.random.default_rng(n).standard_normal(n).astype(np.float32)
  payload, _ = run(grad, np.zeros_like(grad), theta, e, m)
  k = kept(n, theta)
  assert int(fft_payload_nbytes(payload, n, theta, e, m)) == 4 * used_words(k, n, e, m)
  if n >= 100 and m < 23:
    assert 4 * used_words(k, n, e, m) < 4 * n


def test_schedule_sets_the_count_and_the_capacity():
  n, theta, final, steps = 1000, 0.9, 0.5, 4
  grad = np.random.default_rng(1).standard_normal(n).astype(np.float32)
  width = fft_payload_words(n, theta, final_theta=final)
  assert width == fft_payload_words(n, final)  # capacity: the smallest theta
  for step in range(7):
    payload, _ = run(grad, np.zeros_like(grad), theta, step=step, final_theta=final,
                     theta_decay_steps=steps)
    expected_theta = theta + (final - theta) * min(step, steps) / steps
    assert payload.shape == (width,)
    assert payload[0] == kept(n, expected_theta)
    decoded = fft_decompress(payload, [n], theta, final_theta=final).numpy()
    np.testing.assert_allclose(decoded, numpy_decode(payload, n, 4, 3), atol=1e-5)
  # Reversed (theta growing): the capacity is still the largest k.
  payload, _ = run(grad, np.zeros_like(grad), 0.5, step=0, final_theta=0.9, theta_decay_steps=4)
  assert payload[0] == kept(n, 0.5) and payload.shape == (fft_payload_words(n, 0.5),)


# float16 and float64 in the fast tier (bfloat16, the same cast to float32 as float16's,
# with --full).
@pytest.mark.parametrize("dtype,residue_dtype", [(tf.float16, tf.float32),
                                                 tiers.slow(tf.bfloat16, tf.float32),
                                                 (tf.float64, tf.float64)])
def test_other_dtypes_compute_in_float32(dtype, residue_dtype):
  grad = tf.cast(tf.random.stateless_normal([300], [1, 2]), dtype)
  residue = tf.zeros([300], residue_dtype)
  payload, new_residue = fft_compress(grad, residue, 0.5)
  assert new_residue.dtype == residue_dtype
  decoded = fft_decompress(payload, [300], 0.5, dtype)
  assert decoded.dtype == dtype
  np.testing.assert_allclose(
      tf.cast(decoded, tf.float64).numpy(),
      numpy_decode(payload.numpy(), 300, 4, 3), atol=2e-2 if dtype != tf.float64 else 1e-5)
  np.testing.assert_allclose(
      new_residue.numpy(),
      tf.cast(grad, residue_dtype).numpy() - numpy_decode(payload.numpy(), 300, 4, 3),
      atol=1e-5)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_keeps_the_residue_and_decodes_to_nan(bad):
  residue = np.ones(64, np.float32)
  grad = np.zeros(64, np.float32)
  grad[3] = bad
  payload, new_residue = run(grad, residue, 0.9)
  np.testing.assert_array_equal(new_residue, residue)
  assert payload[2] == NONFINITE
  assert np.isnan(fft_decompress(payload, [64], 0.9).numpy()).all()
  assert int(fft_payload_nbytes(payload, 64, 0.9)) == 4 * HEADER
  good, _ = run(np.ones(64, np.float32), residue, 0.9)
  assert np.isnan(fft_decompress(np.stack([good, payload]), [64], 0.9).numpy()).all()


def test_a_payload_of_another_format_decodes_to_nan():
  payload, _ = run(np.ones(64, np.float32), np.zeros(64, np.float32), 0.9, 4, 3)
  assert np.isnan(fft_decompress(payload, [64], 0.9, tf.float32, 3, 4).numpy()).all()


@pytest.mark.parametrize("kwargs,error,match", [
    ({"theta": 1.0}, ValueError, "theta=1.0"),
    ({"theta": -0.1}, ValueError, "theta=-0.1"),
    ({"theta": "0.9"}, ValueError, "theta='0.9'"),
    ({"final_theta": 1.5}, ValueError, "final_theta=1.5"),
    ({"theta_decay_steps": -1}, ValueError, "theta_decay_steps=-1"),
    ({"exponent_bits": 9}, ValueError, "exponent_bits=9"),
    ({"mantissa_bits": 24}, ValueError, "mantissa_bits=24"),
    ({"residue": np.zeros(9, np.float32)}, ValueError, "residue"),
    ({"grad": np.zeros(8, np.int32)}, TypeError, "grad"),
])
def test_bad_arguments_are_named(kwargs, error, match):
  arguments = {"grad": np.ones(8, np.float32), "residue": np.zeros(8, np.float32),
               "theta": 0.5, **kwargs}
  with pytest.raises(error, match=match):
    fft_compress(**arguments)


def test_decompress_rejects_a_payload_of_another_shape():
  payload, _ = run(np.ones(100, np.float32), np.zeros(100, np.float32), 0.9)
  with pytest.raises(ValueError, match="payload"):
    fft_decompress(payload, [200], 0.9)
  with pytest.raises(TypeError, match="payload"):
    fft_decompress(payload.astype(np.float32), [100], 0.9)


def test_empty_tensors():
  payload, residue = fft_compress(tf.zeros([0, 3]), tf.zeros([0, 3]), 0.9)
  assert residue.shape == [0, 3]
  assert fft_decompress(payload, [0, 3], 0.9).shape == [0, 3]
