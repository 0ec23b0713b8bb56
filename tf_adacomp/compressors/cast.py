"""Dense compressors: exact (no compression) and half-precision casts."""

import keras
import tensorflow as tf

from tf_adacomp.compressors import base
from tf_adacomp.compressors import registry


class _Dense(base.Compressor):
  """Sends every element as ``wire_dtype``; payloads are summable by an all-reduce."""

  wire_dtype: tf.DType = None

  def _plan(self, name, shape, dtype, kind):
    return base.TensorPlan(name, shape, dtype, kind, summable=True)

  def _compress(self, grads, states, plans):
    (grad,), (state,) = grads, states
    return tf.cast(grad, self.wire_dtype or grad.dtype), [state]

  def _decompress(self, payload, plans):
    (plan,) = plans
    return [tf.cast(payload, plan.dtype)]

  def _nbytes(self, payload, plans):
    return base.dense_nbytes(payload)


def sends_every_element(compressor) -> bool:
  """Whether ``compressor`` sends every element as it is or cast to half precision: the
  mean that arrives is then what the replicas stepped, to the cast's rounding."""
  return isinstance(compressor, _Dense)


@registry.register("none")
@keras.saving.register_keras_serializable(package="tf_adacomp")
class NoCompression(_Dense):
  """The gradient as it is: exact, the baseline every ratio is measured against."""


@registry.register("fp16")
@keras.saving.register_keras_serializable(package="tf_adacomp")
class FP16(_Dense):
  """Casts to float16 for the exchange (as Horovod's ``Compression.fp16``).

  Values above 65504 in magnitude become inf, which loss-scaling optimizers detect.
  """
  wire_dtype = tf.float16


@registry.register("bf16")
@keras.saving.register_keras_serializable(package="tf_adacomp")
class BF16(_Dense):
  """Casts to bfloat16 for the exchange: float32's range, 8 bits of mantissa."""
  wire_dtype = tf.bfloat16
