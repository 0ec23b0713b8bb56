"""Top-k sparsification with error feedback (a baseline for AdaComp)."""

import keras
import tensorflow as tf

from tf_adacomp import _keywords
from tf_adacomp.compressors import base
from tf_adacomp.compressors import registry
from tf_adacomp.ops import checks
from tf_adacomp.ops import topk as topk_ops


@registry.register("topk")
@keras.saving.register_keras_serializable(package="tf_adacomp")
class TopK(base.Compressor):
  """Sends the largest ``density`` fraction of ``residue + grad`` exactly.

  Args:
    density: fraction in (0, 1] of each tensor's elements sent per step.
    min_size: tensors with fewer elements are sent dense.

  Raises:
    ValueError: ``density`` outside (0, 1] or ``min_size`` < 0.
  """

  @_keywords.suggest_keywords
  def __init__(self, density: float = 0.01, min_size: int = 0):
    super().__init__(min_size=min_size)
    self.density = checks.fraction(density, "density")

  def _always_dense(self, shape):
    return shape.num_elements() == 0

  def init(self, plan):
    return () if plan.dense else (tf.zeros(plan.shape, base.residue_dtype(plan.dtype)),)

  def _compress(self, grads, states, plans):
    (grad,), ((residue,),) = grads, states
    payload, residue = topk_ops.topk_compress(grad, residue, self.density)
    return payload, [(residue,)]

  def _decompress(self, payload, plans):
    (plan,) = plans
    return [topk_ops.topk_decompress(payload, plan.shape, self.density, plan.dtype)]

  def _width(self, plans):
    (plan,) = plans
    return topk_ops.topk_payload_words(plan.num_elements, self.density)

  def _nbytes(self, payload, plans):
    payload = tf.convert_to_tensor(payload)
    return tf.constant([4 * int(payload.shape[-1])], tf.int64)

  def get_config(self):
    return {**super().get_config(), "density": self.density}
