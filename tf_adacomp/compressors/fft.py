"""FFT-based gradient sparsification with range-based floats (Wang et al., HPDC 2020)."""

from typing import Optional

import keras
import tensorflow as tf

from tf_adacomp import _keywords
from tf_adacomp.compressors import base
from tf_adacomp.compressors import registry
from tf_adacomp.ops import fft as fft_ops
from tf_adacomp.ops import rangefloat


@registry.register("fft")
@keras.saving.register_keras_serializable(package="tf_adacomp")
class FFTCompressor(base.Compressor):
  """Sends the largest real-FFT coefficients of ``residue + grad`` as small floats.

  Per tensor: G = residue + grad, flattened; its real FFT has m = n // 2 + 1
  coefficients, of which the ``1 - theta`` fraction of largest magnitude is kept; their
  real and imaginary parts are sent as 1 + ``exponent_bits`` + ``mantissa_bits`` bit
  range-based floats (the exponent range set from the data), with their positions. The
  receivers sum the coefficients of every replica and invert the FFT. The residue keeps
  what was not sent: the dropped coefficients and the rounding of the kept ones. See
  docs/fft.md for the wire format and measured figures.

  The state of a tensor is ``(residue, step)``: ``step`` (int64 scalar) counts the
  steps compressed so far and drives the theta schedule; a non-finite step changes
  neither.

  Defaults: ``theta=0.9``, a moderate sparsification that error feedback carries well,
  and an 8-bit 1+4+3 float (15 binades: spectra span a wide range, and 1+3+4 flushed too
  much of a smooth gradient's). What is not sent goes into the residue and is sent
  later; a higher theta sends fewer bytes. docs/fft.md has the ratios and errors.

  Args:
    theta: fraction in [0, 1) of the coefficients dropped (at step 0).
    final_theta: None (default) for a constant theta; else the theta reached, linearly,
      after ``theta_decay_steps`` (then >= 1) steps and kept afterwards. A diminishing theta
      (``final_theta < theta``) sends more as training goes on, as the paper advises
      for convergence.
    theta_decay_steps: int >= 0, the length of the schedule (0: constant ``theta``).
    exponent_bits: range-float exponent bits, in [1, 8]; ``2**exponent_bits - 1``
      binades below the largest value are representable, smaller values go as 0.
    mantissa_bits: range-float mantissa bits, in [0, 23]; the relative rounding error
      is at most ``2**-(mantissa_bits + 1)``.
    min_size: tensors with fewer elements are sent dense.

  Raises:
    ValueError: an argument out of range (the error names it and the value received).
  """

  @_keywords.suggest_keywords
  def __init__(self, theta: float = 0.9, final_theta: Optional[float] = None,
               theta_decay_steps: int = 0, exponent_bits: int = 4, mantissa_bits: int = 3,
               min_size: int = 0):
    super().__init__(min_size=min_size)
    self.theta, final, self.theta_decay_steps = fft_ops.check_schedule(
        theta, final_theta, theta_decay_steps)
    self.final_theta = None if final_theta is None else final
    self.exponent_bits, self.mantissa_bits = rangefloat.check_format(exponent_bits,
                                                                     mantissa_bits)

  def theta_at(self, step: int) -> float:
    """theta of the schedule at ``step`` (a Python int).

    Args:
      step: the number of steps compressed before this one.

    Returns:
      ``theta + (final_theta - theta) * min(step, theta_decay_steps) / theta_decay_steps``,
      or ``theta`` for a constant schedule.
    """
    return fft_ops.theta_at(step, self.theta, self.final_theta, self.theta_decay_steps)

  def _always_dense(self, shape):
    return shape.num_elements() == 0

  def init(self, plan):
    """``(zero residue, step 0)``, or ``()`` for a tensor sent dense."""
    if plan.dense:
      return ()
    return (tf.zeros(plan.shape, base.residue_dtype(plan.dtype)), tf.zeros([], tf.int64))

  def _compress(self, grads, states, plans):
    (grad,), ((residue, step),) = grads, states
    payload, residue = fft_ops.fft_compress(
        grad, residue, self.theta, self.exponent_bits, self.mantissa_bits, step=step,
        final_theta=self.final_theta, theta_decay_steps=self.theta_decay_steps)
    # A non-finite step (marked in the payload's third word) keeps the whole state.
    step = tf.where(payload[2] == fft_ops.NONFINITE, step, step + 1)
    return payload, [(residue, step)]

  def _decompress(self, payload, plans):
    (plan,) = plans
    return [fft_ops.fft_decompress(payload, plan.shape, self.theta, plan.dtype,
                                   self.exponent_bits, self.mantissa_bits, self.final_theta)]

  def _width(self, plans):
    (plan,) = plans
    return fft_ops.fft_payload_words(plan.num_elements, self.theta, self.exponent_bits,
                                     self.mantissa_bits, self.final_theta)

  def _nbytes(self, payload, plans):
    (plan,) = plans
    return tf.reshape(fft_ops.fft_payload_nbytes(payload, plan.num_elements, self.theta,
                                                 self.exponent_bits, self.mantissa_bits,
                                                 self.final_theta), [1])

  def get_config(self):
    return {**super().get_config(), "theta": self.theta, "final_theta": self.final_theta,
            "theta_decay_steps": self.theta_decay_steps, "exponent_bits": self.exponent_bits,
            "mantissa_bits": self.mantissa_bits}
