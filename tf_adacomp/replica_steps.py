"""Steps that every replica takes together: helpers shared by the Keras 3 and the
tf_keras optimizer wrappers (``optimizer.py``, ``tf_keras.py``)."""

import tensorflow as tf


def on_every_replica_if(flag, fn, values):
  """Calls ``fn(values)`` in every replica if ``flag`` (the same on every replica).

  ``fn`` may call an inner optimizer, whose updates need a merge_call under
  MirroredStrategy: a cond around a merge_call must be taken in cross-replica context
  (as Keras' own LossScaleOptimizer does).

  Args:
    flag: a boolean scalar tensor, equal on every replica.
    fn: a function of ``values``, called in a replica context.
    values: what ``fn`` is given (per replica).
  """
  if tf.__internal__.distribute.strategy_supports_no_merge_call():
    tf.cond(flag, lambda: fn(values), lambda: tf.constant(False))
    return

  def in_cross_replica(distribution, values, flag):
    flag = distribution.experimental_local_results(flag)[0]

    def everywhere():
      distribution.extended.call_for_each_replica(fn, args=(values,))
      return tf.constant(True)

    tf.cond(flag, everywhere, lambda: tf.constant(False))

  tf.distribute.get_replica_context().merge_call(in_cross_replica, args=(values, flag))


def clip_by_global_norm(tensors, clipnorm):
  """``tensors`` scaled by ``min(1, clipnorm / global_norm)`` (None entries kept).

  A non-finite norm leaves them as they are: the step is then skipped anyway.
  """
  if all(t is None for t in tensors):
    return list(tensors)
  scale = clip_scale(tensors, clipnorm)
  return [None if t is None else t * tf.cast(scale, t.dtype) for t in tensors]


def clip_scale(tensors, clipnorm):
  """``min(1, clipnorm / global_norm)`` of ``tensors`` (1 if none, or if the norm is not
  finite: the step is then skipped anyway)."""
  present = [t for t in tensors if t is not None]
  if not present:
    return tf.constant(1.0)
  norm = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(tf.cast(t, tf.float32))) for t in present]))
  return tf.where(tf.math.is_finite(norm), tf.minimum(1.0, clipnorm / norm), 1.0)
