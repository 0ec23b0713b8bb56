"""Adam's step with a second moment that every replica shares: the update exchange made exact.

The update exchange (``CompressedOptimizer(exchange="updates")``) applies the mean of the
replicas' own optimizer steps. For SGD with momentum that mean is the step on the mean
gradient (the step is linear in the gradient). Adam's is not: each replica divides its
own first moment by its own second moment, and the mean of those quotients is not Adam's
step. When every replica divides by the same second moment, the step is linear in the
first moment again, and the mean of the replicas' steps is the step of the mean first
moment, which is the first moment of the mean gradient (1-bit Adam, arXiv 2102.02888,
and 0/1 Adam, arXiv 2202.06009, rest on the same observation).

Per replica ``r`` and step ``t`` (1-based), with ``g_r`` its own mean gradient:

    m_r <- m_r + (1 - beta_1) (g_r - m_r)           # its own first moment
    v_r <- v_r + (1 - beta_2) (g_r^2 - v_r)         # its own second moment
    w_r <- w_r + (1 - beta_2) (m_r^2 / (1 - beta_1^t)^2 - w_r)   # "global" only
    at an average: v <- f(mean of v_r, mean of w_r); v_r, w_r <- their means; s <- t
    u_r = -lr sqrt(1 - beta_2^s) / (1 - beta_1^t) * m_r / (sqrt(v) + epsilon)
          (clipped to step_bound when s < t)

``s`` is the step of the last average: Keras' bias correction, with the shared moment's
age. ``f`` is the mean itself (``second_moment="shared"``), or the estimate of the mean
gradient's second moment (``"global"``, ``global_moment``): a replica's gradient, on a
batch R times smaller, carries R times the noise variance of the mean gradient, which
the mean of the replicas' ``v_r`` keeps and Adam on the global batch would not see. An
Embedding's ``IndexedSlices`` gradient adds its slices' squares, as Keras' Adam does
(``sparse_square``); those add up across replicas, so ``f`` is their mean over R exactly.
A gradient clipped by ``local_clipnorm`` is dense, as Keras' ``global_clipnorm`` makes
it: its square is that of its summed rows, as in Keras.
The replicas' steps ``u_r`` are compressed with error feedback and exchanged; every
replica applies their mean (and AdamW's decoupled weight decay, the same on every
replica).

Averages (one dense all-reduce of ``v_r``, and of ``w_r`` for "global", in bfloat16)
happen at steps 1, 2, 4, 8, ... (the interval doubles, as 0/1 Adam's variance updates;
with ``max_interval=k``, those below ``k`` and then every ``k`` steps). At a step that
averaged (``s = t``; every step with one replica) each replica's step is Adam's with the
fresh shared ``v``, unclipped: with one replica that is Keras' Adam exactly, an
Embedding's repeated tokens included (their summed gradient in ``m`` against the sum of
their squares in ``v`` can exceed the bound below). Between averages the shared ``v`` is
older than the replicas' own, and an element first seen after the last average (an
Embedding row of a rare token) has none: each replica's ``u_r`` is then clipped to
Adam's own bound on a step, ``step_bound``. With ``precondition="after"`` the same
quotient is bounded before it is sent (``-alpha m_r`` to ``step_bound * (sqrt(v) +
epsilon)``), and the decoded mean is divided on arrival, so the two preconditions agree
without compression (up to float rounding). Without compression the result is, on every
replica, Adam's step on the mean gradient with the shared ``v``, where the bound does not
bind.

This module holds the mathematics and the one place where Adam's slots are read.
"""

import keras
import tensorflow as tf

from tf_adacomp.compat import internals

SECOND_MOMENTS = ("local", "shared", "global")


def supports(optimizer) -> bool:
  """Whether ``optimizer`` is an Adam (or AdamW) whose step this module computes."""
  return isinstance(optimizer, keras.optimizers.Adam) and not optimizer.amsgrad


def check_inner(optimizer, second_moment="shared") -> None:
  """Raises ValueError unless ``optimizer`` can take the shared-moment step.

  The step is computed here, not by ``optimizer.apply``, so the settings that ``apply``
  would carry out (clipping, EMA, gradient accumulation, loss scale factor) are refused
  rather than silently dropped.
  """
  if not supports(optimizer):
    amsgrad = " with amsgrad=True" if getattr(optimizer, "amsgrad", False) else ""
    raise ValueError(f"`second_moment={second_moment!r}` computes Adam's step and needs a "
                     "keras.optimizers.Adam or AdamW without amsgrad. Received: "
                     f"inner_optimizer={optimizer!r}{amsgrad}")
  unsupported = {"clipnorm": None, "clipvalue": None, "global_clipnorm": None,
                 "use_ema": False, "gradient_accumulation_steps": None,
                 "loss_scale_factor": None}
  for name, default in unsupported.items():
    value = getattr(optimizer, name, default)
    if value != default:
      hint = (" (use CompressedOptimizer(local_clipnorm=...) to clip each replica's "
              "gradient)" if "clip" in name else "")
      raise ValueError(f"`second_moment={second_moment!r}` does not apply the inner "
                       f"optimizer's `{name}`{hint}. Received: {name}={value!r}")


def moment_slots(optimizer):
  """``(first moments, second moments)`` of a built Adam, in its variable order.

  Keras 3 keeps them in the private ``_momentums`` and ``_velocities``
  (keras/src/optimizers/adam.py); tests/compat/test_internals.py fails if they move.
  """
  momentums = getattr(optimizer, "_momentums", None)
  velocities = getattr(optimizer, "_velocities", None)
  if not momentums or not velocities:
    raise RuntimeError(f"{type(optimizer).__name__} has no `_momentums`/`_velocities` in "
                       f"Keras {keras.__version__}: the shared second moment needs updating.")
  return momentums, velocities


def is_sync_step(step, max_interval=None):
  """Whether the second moments are averaged at ``step`` (an int64 tensor, 1-based)."""
  step = tf.cast(step, tf.int64)
  power_of_two = tf.logical_and(step > 0, tf.equal(tf.bitwise.bitwise_and(step, step - 1), 0))
  if max_interval is None:
    return power_of_two
  return tf.logical_or(tf.logical_and(power_of_two, step < max_interval),
                       tf.equal(step % max_interval, 0))


def step_bound(alpha, beta_1, beta_2):
  """The largest step Keras' Adam can take on an element, over every gradient history:
  ``alpha * (1 - beta_1) / sqrt((1 - beta_2) (1 - beta_1^2 / beta_2))`` (Cauchy-Schwarz
  on ``m = sum (1 - beta_1) beta_1^k g_k`` against ``v = sum (1 - beta_2) beta_2^k
  g_k^2``); infinite when ``beta_1^2 >= beta_2``. With its own second moment Adam never
  reaches it, so the clip changes only steps divided by a shared moment that is older
  than, or below, the element's own.
  """
  beta_1, beta_2 = float(beta_1), float(beta_2)
  if beta_1 ** 2 >= beta_2:
    return alpha * float("inf")
  return alpha * (1 - beta_1) / ((1 - beta_2) * (1 - beta_1 ** 2 / beta_2)) ** 0.5


def clip(update, bound):
  """``update`` clipped elementwise to ``[-bound, bound]``."""
  bound = tf.cast(bound, update.dtype)
  return tf.clip_by_value(update, -bound, bound)


def local_moments(m, v, grad, beta_1, beta_2, square=None):
  """One replica's new ``(m, v)`` from its own gradient (Keras' Adam update, unapplied);
  ``square`` replaces ``grad ** 2`` (``sparse_square``). An ``IndexedSlices`` ``grad``
  enters ``m`` dense, its duplicate rows summed, as in Keras' Adam."""
  grad = tf.cast(tf.convert_to_tensor(grad), m.dtype)
  square = tf.square(grad) if square is None else tf.cast(square, m.dtype)
  return m + (grad - m) * (1 - beta_1), v + (square - v) * (1 - beta_2)


def sparse_square(grad: tf.IndexedSlices, scale=1.0):
  """What Keras' Adam adds to its second moment for an ``IndexedSlices`` gradient (an
  Embedding's): each slice squared, then summed per row, not the summed row squared.

  Keras squares the slices before it densifies them (``ops.square`` of the
  ``IndexedSlices``), so a token seen n times adds the sum of n squared gradients. That
  sum is linear across replicas: the mean of the replicas' own, divided by their number,
  is Keras' on the global batch (``shared_moment``), with nothing to estimate.
  """
  values = tf.square(tf.cast(grad.values, tf.float32) * scale)
  rows = tf.cast(grad.dense_shape[0], tf.int32)
  return tf.math.unsorted_segment_sum(values, tf.cast(grad.indices, tf.int32), rows)


def local_momentum_square(w, m, t, beta_1, beta_2):
  """One replica's new ``w``: the moving average (``beta_2``) of its bias-corrected first
  moment squared, ``(m / (1 - beta_1^t))^2``."""
  m_hat = m / (1 - tf.pow(tf.cast(beta_1, m.dtype), tf.cast(t, m.dtype)))
  return w + (tf.square(m_hat) - w) * (1 - beta_2)


def global_moment(v, w, replicas, beta_1):
  """The second moment of the mean gradient of ``replicas`` replicas, estimated from the
  means over replicas of their own ``v`` (moving average of g^2) and ``w`` (of m^2).

  A replica's gradient is the true gradient ``G`` plus noise of variance ``S`` per
  element, and the mean of ``R`` replicas' has ``S / R``. With ``c = (1 - beta_1) /
  (1 + beta_1)``, the variance of a moving average of white noise, ``v`` estimates ``G^2
  + S`` and ``w`` estimates ``G^2 + c S``, hence ``G^2 = (w - c v) / (1 - c)``,
  ``S = (v - w) / (1 - c)``, and the mean gradient's second moment is ``G^2 + S / R``
  (the estimator of the gradient noise scale, McCandlish et al. 2018, per element).
  Clipped to ``[v / R, v]``, the values of pure noise and of no noise.
  """
  c = (1 - beta_1) / (1 + beta_1)
  estimate = ((w - c * v) + (v - w) / replicas) / (1 - c)
  return tf.minimum(tf.maximum(estimate, v / replicas), v)


def step_size(learning_rate, t, synced_at, beta_1, beta_2):
  """Adam's ``alpha`` with the shared moment's bias correction: ``lr sqrt(1 -
  beta_2^synced_at) / (1 - beta_1^t)``, a float32 scalar.

  Args:
    learning_rate: the current learning rate (a scalar).
    t: this step, 1-based (int64 scalar).
    synced_at: the step the shared moment was last computed at.
    beta_1, beta_2: Adam's.
  """
  t, synced_at = tf.cast(t, tf.float32), tf.cast(synced_at, tf.float32)
  return (tf.cast(learning_rate, tf.float32) * tf.sqrt(1 - tf.pow(tf.cast(beta_2, tf.float32),
                                                                 synced_at))
          / (1 - tf.pow(tf.cast(beta_1, tf.float32), t)))


def divisor(shared_v, epsilon):
  """Adam's denominator from the shared second moment: ``sqrt(shared_v) + epsilon``."""
  return tf.sqrt(shared_v) + tf.cast(epsilon, shared_v.dtype)


def step(m, shared_v, learning_rate, t, synced_at, beta_1, beta_2, epsilon):
  """Adam's update (to add to the weights): ``-step_size(...) * m / divisor(...)``,
  clipped to ``step_bound`` where the shared moment is older than the step
  (``synced_at < t``)."""
  alpha = step_size(learning_rate, t, synced_at, beta_1, beta_2)
  update = -tf.cast(alpha, m.dtype) * m / divisor(shared_v, epsilon)
  stale = tf.not_equal(tf.cast(t, tf.int64), tf.cast(synced_at, tf.int64))
  return tf.where(stale, clip(update, step_bound(alpha, beta_1, beta_2)), update)


def decayed(optimizer, variable, value, learning_rate):
  """``value`` after the inner optimizer's decoupled weight decay (AdamW) for ``variable``
  at ``learning_rate`` (unchanged without weight decay or for an excluded variable)."""
  if not optimizer.weight_decay or not internals.uses_weight_decay(optimizer, variable):
    return value
  lr = tf.cast(learning_rate, value.dtype)
  return value - value * tf.cast(optimizer.weight_decay, value.dtype) * lr
