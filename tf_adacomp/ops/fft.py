"""FFT-based gradient sparsification (Wang et al., HPDC 2020), compiled with XLA.

Per tensor of n elements, with residue R (docs/algorithms.md#fft, docs/fft.md):

    G = R + grad;  C = rfft(flat G)                      (m = n // 2 + 1 coefficients)
    keep the k = max(1, ceil((1 - theta) * m)) coefficients of largest |C|, zero the rest
    quantize their real and imaginary parts with a range-based float (``rangefloat``)
    D = irfft(quantized coefficients, n);  R <- G - D

so both the discarded coefficients and the quantization error stay in R. theta may
follow a linear schedule over a step counter (``theta_at``); the payload has a static
capacity, the k of the smallest theta, and carries the k of its step.

Wire format (docs/fft.md), int32 words::

    [count, format, top_exponent, count index codes, 2 * count value codes]

- ``format = index_bits | exponent_bits << 8 | mantissa_bits << 16`` (checked on decode);
- ``top_exponent``: the range float's t, or ``NONFINITE`` when G (or its transform) was
  not finite: the payload then decodes to NaN and the residue is left unchanged;
- index codes: coefficient positions in ``index_bits(m)`` bits, bit-packed (``bitpack``);
- value codes: ``re_0, im_0, re_1, im_1, ...`` in ``1 + exponent_bits + mantissa_bits``
  bits, bit-packed from the word after the last index word.

Only the first ``fft_payload_nbytes`` bytes are used; the rest of the static buffer is 0.
Code order is not part of the format (the encoder writes them by decreasing |C|).

XLA: both kernels, the FFTs included, are compiled whole with ``jit_compile=True``: XLA
lowers ``tf.signal.rfft``/``irfft`` to its ``fft`` instruction (fft_type RFFT/IRFFT) for
float32 input of any length, even or odd, so nothing is padded and nothing runs outside
the compiled program (checked on CPU with TF 2.21; not run on a GPU here). ``top_k``
needs a static k, so the kernel takes the capacity's worth, sorted, and keeps the first
k of the step (a dynamic count). Computation is in float32 (rfft needs float32 or
float64): float16/bfloat16/float64 gradients are cast, the residue keeps its own dtype
and decoded sums come back in the gradient's dtype.
"""

import math
from typing import Optional

import tensorflow as tf

from tf_adacomp.ops import bitpack
from tf_adacomp.ops import checks
from tf_adacomp.ops import compiled
from tf_adacomp.ops import rangefloat
from tf_adacomp.ops.adacomp import index_bits

HEADER_WORDS = 3
# The top-exponent word of a payload whose gradient was not finite.
NONFINITE = -2**31


# --- Static sizes and the theta schedule (plain Python) ------------------------------


def coefficient_count(num_elements: int) -> int:
  """m, the number of real-FFT coefficients of a tensor: ``n // 2 + 1`` (0 if empty)."""
  return num_elements // 2 + 1 if num_elements else 0


def kept_count(num_elements: int, theta: float) -> int:
  """k for a tensor: ``ceil((1 - theta) * m)``, at least 1 (0 for an empty tensor)."""
  m = coefficient_count(num_elements)
  return 0 if m == 0 else max(1, min(m, math.ceil((1.0 - theta) * m)))


def check_theta(value, name: str = "theta") -> float:
  """Returns ``value`` as a float in [0, 1), or raises ValueError naming it."""
  return checks.number_in_range(value, name, 0, 1, high_open=True)


def _check_thetas(theta, final_theta):
  """``(theta, final_theta)`` checked; a None ``final_theta`` (constant) becomes ``theta``."""
  theta = check_theta(theta, "theta")
  return theta, theta if final_theta is None else check_theta(final_theta, "final_theta")


def check_schedule(theta, final_theta, theta_decay_steps):
  """Validates a schedule; returns ``(theta, final_theta, theta_decay_steps)``.

  ``final_theta=None`` means a constant theta (returned as ``theta``).

  Raises:
    ValueError: a theta outside [0, 1), ``theta_decay_steps`` not an integer >= 0, or a
      ``final_theta`` other than ``theta`` with no steps to reach it.
  """
  theta, final = _check_thetas(theta, final_theta)
  theta_decay_steps = checks.non_negative_int(theta_decay_steps, "theta_decay_steps")
  if final != theta and theta_decay_steps == 0:
    # Otherwise the payload would be sized for a theta that is never used.
    raise ValueError(f"`theta_decay_steps` must be >= 1 when `final_theta` differs from "
                     f"`theta`. Received: theta_decay_steps=0, theta={theta!r}, "
                     f"final_theta={final_theta!r}")
  return theta, final, theta_decay_steps


def theta_at(step: int, theta: float, final_theta: Optional[float] = None,
             theta_decay_steps: int = 0) -> float:
  """theta at ``step``: linear from ``theta`` (step 0) to ``final_theta`` (step
  ``theta_decay_steps`` and after); constant when ``final_theta`` is None or no steps.

  The compiled kernel evaluates the same float64 expression, in the same order.
  """
  theta, final_theta, steps = check_schedule(theta, final_theta, theta_decay_steps)
  if steps == 0 or final_theta == theta:
    return theta
  return theta + (final_theta - theta) * (min(max(step, 0), steps) / steps)


def capacity(num_elements: int, theta: float, final_theta: Optional[float] = None) -> int:
  """Static number of coefficients a payload holds: k of the smallest theta."""
  return kept_count(num_elements, min(theta, theta if final_theta is None else final_theta))


def _format_word(num_elements: int, exponent_bits: int, mantissa_bits: int) -> int:
  return (index_bits(coefficient_count(num_elements)) | exponent_bits << 8
          | mantissa_bits << 16)


def _words_for(count, num_elements: int, exponent_bits: int, mantissa_bits: int):
  """Used words of a payload of ``count`` coefficients (Python ints or int tensors)."""
  ib = index_bits(coefficient_count(num_elements))
  vb = 1 + exponent_bits + mantissa_bits
  return HEADER_WORDS + (count * ib + 31) // 32 + (2 * count * vb + 31) // 32


def fft_payload_words(num_elements: int, theta: float, exponent_bits: int = 4,
                      mantissa_bits: int = 3, final_theta: Optional[float] = None) -> int:
  """Static length in int32 words of the payload (its capacity's worth of codes).

  Args:
    num_elements: n, the gradient's number of elements.
    theta: fraction in [0, 1) of the coefficients dropped (at step 0).
    exponent_bits: range-float exponent bits, in [1, 8].
    mantissa_bits: range-float mantissa bits, in [0, 23].
    final_theta: the schedule's last theta, or None for a constant theta.

  Returns:
    ``3 + ceil(cap * index_bits(m) / 32) + ceil(2 * cap * (1 + e + m) / 32)``, ``cap``
    the k of the smaller theta.
  """
  theta, final_theta = _check_thetas(theta, final_theta)
  e, m = rangefloat.check_format(exponent_bits, mantissa_bits)
  return _words_for(capacity(num_elements, theta, final_theta), num_elements, e, m)


# --- Kernels -------------------------------------------------------------------------


def _step_count(step, m: int, cap: int, theta: float, final_theta: float, decay_steps: int):
  """k at ``step`` (int32), the float64 expression of ``theta_at``, bounded by ``cap``."""
  if decay_steps == 0 or final_theta == theta:
    return tf.constant(cap, tf.int32)
  done = tf.cast(tf.clip_by_value(tf.cast(step, tf.int64), 0, decay_steps), tf.float64)
  t = theta + (final_theta - theta) * (done / decay_steps)
  k = tf.cast(tf.math.ceil((1.0 - t) * m), tf.int32)
  return tf.clip_by_value(k, 1, cap)


def _compress(grad, residue, step, cap: int, theta: float, final_theta: float,
              decay_steps: int, exponent_bits: int, mantissa_bits: int):
  n = grad.shape.num_elements()
  m = coefficient_count(n)
  ib = index_bits(m)
  vb = 1 + exponent_bits + mantissa_bits
  cd = checks.compute_dtype(grad.dtype, residue.dtype)
  r = tf.cast(tf.reshape(residue, [-1]), cd)
  g = r + tf.cast(tf.reshape(grad, [-1]), cd)
  x = tf.cast(g, tf.float32)
  finite = tf.reduce_all(tf.math.is_finite(x))
  # Zeros in place of a non-finite G keep every later step well defined; nothing of
  # what follows is used then.
  x = tf.where(finite, x, tf.zeros_like(x))
  coefficients = tf.signal.rfft(x, fft_length=[n])
  magnitude = tf.abs(coefficients)
  finite &= tf.reduce_all(tf.math.is_finite(magnitude))

  k = _step_count(step, m, cap, theta, final_theta, decay_steps)
  # top_k needs a static k: take the capacity, sorted, and keep the first k of them.
  _, positions = tf.math.top_k(magnitude, k=cap, sorted=True)
  slot = tf.range(cap, dtype=tf.int32)
  used = slot < k
  chosen = tf.gather(coefficients, positions)
  parts = tf.reshape(tf.stack([tf.math.real(chosen), tf.math.imag(chosen)], axis=1), [-1])
  parts = tf.where(tf.repeat(used, 2), parts, tf.zeros_like(parts))
  codes, top, decoded, representable = rangefloat.encode(parts, exponent_bits, mantissa_bits)
  finite &= representable

  sent = _scatter(positions, decoded, used, m)
  new_residue = tf.where(finite, g - tf.cast(tf.signal.irfft(sent, fft_length=[n]), cd), r)

  idx_cap = bitpack.packed_words(cap, ib)
  val_cap = bitpack.packed_words(2 * cap, vb)
  if ib:
    # Codes beyond k are zero, so the first packed_words(k) words hold exactly k codes.
    index_words = tf.bitcast(bitpack.pack(
        tf.cast(tf.where(used, positions, 0), tf.uint32), ib), tf.int32)
  else:
    index_words = tf.zeros([0], tf.int32)
  value_words = tf.bitcast(bitpack.pack(codes, vb), tf.int32)
  # The value words start right after the k-th index code's word: a dynamic offset.
  index_used = (k * ib + 31) // 32
  p = tf.range(idx_cap + val_cap, dtype=tf.int32)
  from_values = tf.gather(tf.concat([value_words, tf.zeros([idx_cap], tf.int32)], 0),
                          tf.maximum(p - index_used, 0))
  if idx_cap:
    from_index = tf.gather(index_words, tf.minimum(p, idx_cap - 1))
    body = tf.where(p < index_used, from_index, from_values)
  else:
    body = from_values
  fmt = _format_word(n, exponent_bits, mantissa_bits)
  payload = tf.concat([tf.stack([k, tf.constant(fmt, tf.int32), top]), body], 0)
  nonfinite = tf.concat([tf.constant([0, fmt, NONFINITE], tf.int32),
                         tf.zeros([idx_cap + val_cap], tf.int32)], 0)
  payload = tf.where(finite, payload, nonfinite)
  return payload, tf.reshape(tf.cast(new_residue, residue.dtype), residue.shape)


def _scatter(positions, values, used, m: int):
  """The m complex coefficients with ``values`` (re, im interleaved) at ``positions``.

  Unused slots go to a spare coefficient m, cut off after the scatter.
  """
  pairs = tf.reshape(values, [-1, 2])
  re = tf.where(used, pairs[:, 0], tf.zeros_like(pairs[:, 0]))
  im = tf.where(used, pairs[:, 1], tf.zeros_like(pairs[:, 1]))
  target = tf.where(used, positions, m)[:, None]
  return tf.complex(tf.scatter_nd(target, re, [m + 1])[:m],
                    tf.scatter_nd(target, im, [m + 1])[:m])


def _decompress(payload, shape: tf.TensorShape, dtype: tf.DType, cap: int,
                exponent_bits: int, mantissa_bits: int):
  n = shape.num_elements()
  m = coefficient_count(n)
  ib = index_bits(m)
  vb = 1 + exponent_bits + mantissa_bits
  rows = payload if payload.shape.rank == 2 else payload[None]
  width = int(rows.shape[1])
  idx_cap = bitpack.packed_words(cap, ib)
  val_cap = bitpack.packed_words(2 * cap, vb)
  slot = tf.range(cap, dtype=tf.int32)
  total = tf.zeros([m], tf.complex64)
  bad = tf.constant(False)
  # The coefficients are added in replica order 0, 1, ... (one inverse FFT of the sum,
  # by linearity): every replica computes a bit-identical result.
  for row in range(int(rows.shape[0])):
    count, fmt, top = rows[row, 0], rows[row, 1], rows[row, 2]
    bad |= ((fmt != _format_word(n, exponent_bits, mantissa_bits)) | (count < 1)
            | (count > cap) | (top < rangefloat.MIN_TOP_EXPONENT)
            | (top > rangefloat.MAX_TOP_EXPONENT))
    k = tf.clip_by_value(count, 0, cap)
    if ib:
      positions = tf.cast(bitpack.unpack(
          tf.bitcast(rows[row, HEADER_WORDS:HEADER_WORDS + idx_cap], tf.uint32), cap, ib),
                          tf.int32)
    else:
      positions = tf.zeros([cap], tf.int32)
    start = HEADER_WORDS + (k * ib + 31) // 32
    words = tf.gather(rows[row], tf.minimum(start + tf.range(val_cap, dtype=tf.int32),
                                            width - 1))
    codes = bitpack.unpack(tf.bitcast(words, tf.uint32), 2 * cap, vb)
    values = rangefloat.decode(codes, top, exponent_bits, mantissa_bits)
    used = (slot < k) & (positions < m)
    total += _scatter(tf.where(used, positions, 0), values, used, m)
  dense = tf.cast(tf.signal.irfft(total, fft_length=[n]), checks.compute_dtype(dtype))
  dense = tf.where(bad, tf.constant(float("nan"), dense.dtype), dense)
  return tf.reshape(tf.cast(dense, dtype), shape)


def _nbytes(payload, num_elements: int, cap: int, exponent_bits: int, mantissa_bits: int):
  count = tf.clip_by_value(tf.cast(payload[..., 0], tf.int64), 0, cap)
  return 4 * _words_for(count, num_elements, exponent_bits, mantissa_bits)


# --- Public entry points -------------------------------------------------------------


def fft_compress(grad, residue, theta: float, exponent_bits: int = 4, mantissa_bits: int = 3,
                 step=0, final_theta: Optional[float] = None, theta_decay_steps: int = 0):
  """Compresses ``grad + residue`` in the frequency domain, keeping the error in a residue.

  Runs eagerly, in graph mode and inside ``strategy.run``; always XLA-compiled (one
  compilation per shape, dtypes and setting).

  Args:
    grad: float16/bfloat16/float32/float64 tensor with a static shape.
    residue: float tensor of the same shape (zeros at the first step).
    theta: fraction in [0, 1) of the m = n // 2 + 1 coefficients dropped (at step 0).
    exponent_bits: range-float exponent bits, in [1, 8].
    mantissa_bits: range-float mantissa bits, in [0, 23].
    step: int scalar (tensor or Python), the step of the theta schedule.
    final_theta: the theta reached after ``theta_decay_steps`` steps (linearly), or
      None for a constant theta.
    theta_decay_steps: int >= 0, the length of the schedule (0: constant theta).

  Returns:
    ``(payload, new_residue)``: a 1-D int32 payload of static length
    ``fft_payload_words(n, theta, exponent_bits, mantissa_bits, final_theta)`` (only
    ``fft_payload_nbytes`` bytes of it are used), and ``G - decoded`` in the dtype and
    shape of ``residue``. If ``grad + residue`` (or its transform) is not finite, the
    residue is returned unchanged and the payload decodes to NaN.

  Raises:
    TypeError: ``grad`` or ``residue`` is not a float tensor.
    ValueError: shapes differ or are not static; a bad theta, schedule or format.
  """
  grad = checks.float_tensor(grad, "grad")
  residue = checks.float_tensor(residue, "residue")
  checks.same_shape(grad, residue, "grad", "residue")
  theta, final_theta, decay_steps = check_schedule(theta, final_theta, theta_decay_steps)
  e, mb = rangefloat.check_format(exponent_bits, mantissa_bits)
  n = grad.shape.num_elements()
  if n == 0:
    return tf.constant([0, _format_word(0, e, mb), 0], tf.int32), residue
  step = tf.cast(step, tf.int64)
  return compiled.kernel(
      _compress, cap=capacity(n, theta, final_theta), theta=theta, final_theta=final_theta,
      decay_steps=decay_steps, exponent_bits=e, mantissa_bits=mb)(grad, residue, step)


def fft_decompress(payload, shape, theta: float, dtype=tf.float32, exponent_bits: int = 4,
                   mantissa_bits: int = 3, final_theta: Optional[float] = None):
  """Decodes FFT payloads into a dense tensor.

  Args:
    payload: int32 ``[words]`` (one replica's payload) or ``[replicas, words]`` (gathered
      payloads, each zero-padded beyond its used words).
    shape: static shape of the gradient.
    theta, exponent_bits, mantissa_bits, final_theta: as given to ``fft_compress``
      (they set the payload's capacity and format).
    dtype: float dtype of the result.

  Returns:
    A dense tensor of ``shape`` and ``dtype``: the sum of the replicas' decoded
    gradients (their coefficients added in replica order, then one inverse FFT). NaN
    everywhere if a payload carries the non-finite marker or does not match the format.

  Raises:
    TypeError: ``payload`` is not int32 or ``dtype`` is not a float type.
    ValueError: ``payload`` is not rank 1 or 2, or its length does not match ``shape``
      and the settings; a bad theta or format.
  """
  payload = checks.payload_tensor(payload)
  shape = checks.static_shape(shape, "shape")
  dtype = checks.float_dtype(dtype, "dtype")
  theta, final_theta = _check_thetas(theta, final_theta)
  e, mb = rangefloat.check_format(exponent_bits, mantissa_bits)
  n = shape.num_elements()
  expected = fft_payload_words(n, theta, e, mb, final_theta) if n else HEADER_WORDS
  if payload.shape[-1] != expected:
    raise ValueError(f"`payload` for shape {shape}, theta {theta} and final_theta "
                     f"{final_theta} must have {expected} words. "
                     f"Received: payload with shape {payload.shape}")
  if n == 0:
    return tf.zeros(shape, dtype)
  return compiled.kernel(_decompress, shape=shape, dtype=dtype,
                         cap=capacity(n, theta, final_theta), exponent_bits=e,
                         mantissa_bits=mb)(payload)


def fft_payload_nbytes(payload, num_elements: int, theta: float, exponent_bits: int = 4,
                       mantissa_bits: int = 3, final_theta: Optional[float] = None):
  """Bytes a payload occupies on the wire: header, used index words, used value words.

  Args:
    payload: int32 ``[words]`` or gathered ``[replicas, words]`` FFT payload.
    num_elements: n, the gradient's number of elements.
    theta, exponent_bits, mantissa_bits, final_theta: as given to ``fft_compress``.

  Returns:
    int64 tensor, a scalar or ``[replicas]``:
    ``4 * (3 + ceil(count * index_bits(m) / 32) + ceil(2 * count * (1 + e + m) / 32))``.
  """
  payload = checks.payload_tensor(payload)
  theta, final_theta = _check_thetas(theta, final_theta)
  e, mb = rangefloat.check_format(exponent_bits, mantissa_bits)
  return compiled.kernel(_nbytes, num_elements=int(num_elements),
                         cap=capacity(int(num_elements), theta, final_theta),
                         exponent_bits=e, mantissa_bits=mb)(payload)
