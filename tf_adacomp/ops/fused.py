"""Element-wise steps of the optimizer's exchanges, each one XLA pass.

Outside XLA, TensorFlow runs every element-wise op as its own pass over memory, with a
materialised intermediate (``is_finite`` writes a bool tensor that ``reduce_all`` then
reads; ``before + update`` writes a sum that ``where`` reads again). On a large model
these passes are a visible part of the update exchange's step (docs/performance.md,
"Where the time goes"); compiled, each is one read of its inputs.
"""

import tensorflow as tf

from tf_adacomp.ops import compiled


def _all_finite(tensors):
  return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in tensors]))


def all_finite(tensors):
  """Scalar bool: every tensor of ``tensors`` (None entries skipped) is finite.

  Args:
    tensors: a sequence of float tensors, or None.

  Returns:
    A scalar bool tensor (True for no tensors).
  """
  present = [tf.convert_to_tensor(t) for t in tensors if t is not None]
  if not present:
    return tf.constant(True)
  return compiled.kernel(_all_finite)(present)


def _add_if(flag, before, update):
  return tf.where(flag, before + tf.cast(update, before.dtype), before)


def add_if(flag, before, update):
  """``before + update`` (``update`` cast to ``before``'s dtype) if ``flag``, else
  ``before``; the same floats as the unfused ops.

  Args:
    flag: scalar bool tensor.
    before: a float tensor.
    update: a float tensor of the same shape.

  Returns:
    A tensor of ``before``'s shape and dtype.
  """
  return compiled.kernel(_add_if)(flag, before, update)
