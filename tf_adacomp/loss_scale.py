"""Keras' ``LossScaleOptimizer`` around ``CompressedOptimizer``: one decision for all replicas.

The upstream behaviour
----------------------
Keras 3's ``LossScaleOptimizer`` (``keras/src/optimizers/loss_scale_optimizer.py``,
checked against 3.15.1) decides whether a step is finite with ``check_finite(grads)``
on each replica's own gradients, which in Keras 3 are not all-reduced before ``apply``:

- in the merge-call path (``MirroredStrategy`` and ``MultiWorkerMirroredStrategy``
  unless XLA-compiled on GPUs only; ``_tf_apply``) it calls ``check_finite`` in every
  replica and keeps replica 0's answer ("Arbitrarily take `finite` from the first
  replica", written for Keras 2, where gradients arrived all-reduced). An overflow on
  another replica is not seen: the loss scale is not lowered and the step is counted
  as good;
- in the no-merge-call path (``_common_apply``) each replica takes its own branch of a
  ``cond``: replicas diverge, and the one that applies waits in the compressed exchange
  for replicas that never come.

``CompressedOptimizer`` itself skips a step that is not finite on any replica, so the
weights were safe in the merge-call path, but the loss scale stayed too high and kept
overflowing.

The fix
-------
``apply_loss_scale_fix()`` replaces ``LossScaleOptimizer.check_finite`` (the class
attribute, once, idempotently) by a wrapper that, when the optimizer's
``inner_optimizer`` is a ``CompressedOptimizer`` and it runs in a replica context with
more than one replica in sync, all-reduces the number of replicas whose gradients are
not finite (one float32 scalar) and answers "finite" only when that number is 0. Every
replica then gets the same answer, so in either path every replica lowers the scale and
skips the step, or every replica applies it. Any other inner optimizer, a single
replica, and a call in cross-replica context get Keras' own ``check_finite`` unchanged.
``CompressedOptimizer.__init__`` applies it, so ``LossScaleOptimizer(CompressedOptimizer(
...))`` and ``model.compile`` under ``mixed_float16`` need no call from the user.

Version guard
-------------
The fix relies on three things of Keras' ``LossScaleOptimizer``: it has
``check_finite(self, grads)``; ``_tf_apply`` and ``_common_apply`` decide through
``self.check_finite``; the merge-call path calls it in each replica
(``call_for_each_replica(self.check_finite, ...)``), where a collective can run.
``tests/test_optimizer_mixed_precision.py`` checks all three against the installed
Keras. When ``check_finite`` is missing, ``apply_loss_scale_fix`` logs a warning and
patches nothing.
"""

import functools
import logging
import threading

__all__ = ["apply_loss_scale_fix", "loss_scale_fix_applied", "original_check_finite"]

MARK = "_tf_adacomp_loss_scale_fix"  # attribute set on our wrapper

_LOCK = threading.Lock()
_WARNED = []


def _loss_scale_optimizer_class():
  import keras  # pylint: disable=g-import-not-at-top
  return keras.optimizers.LossScaleOptimizer


def original_check_finite():
  """Keras' own ``LossScaleOptimizer.check_finite`` (None where there is none)."""
  current = getattr(_loss_scale_optimizer_class(), "check_finite", None)
  if getattr(current, MARK, False):
    return current.__wrapped__
  return current


def loss_scale_fix_applied() -> bool:
  """Whether ``LossScaleOptimizer.check_finite`` is the wrapper of this module."""
  return bool(getattr(getattr(_loss_scale_optimizer_class(), "check_finite", None), MARK, False))


def _make_check_finite(original):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_adacomp.optimizer import CompressedOptimizer  # pylint: disable=g-import-not-at-top

  @functools.wraps(original)
  def check_finite(self, grads):
    finite = original(self, grads)
    if not isinstance(getattr(self, "inner_optimizer", None), CompressedOptimizer):
      return finite
    if tf.distribute.in_cross_replica_context():
      return finite
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync <= 1:
      return finite
    # Keras' gradients are per replica here: one replica's overflow must lower the
    # scale and skip the step on all of them (and every replica must take the same
    # branch, since the compressed exchange in the step branch is a collective).
    not_finite = tf.cast(tf.logical_not(tf.convert_to_tensor(finite)), tf.float32)
    return tf.equal(context.all_reduce(tf.distribute.ReduceOp.SUM, not_finite), 0.0)

  setattr(check_finite, MARK, True)
  return check_finite


def apply_loss_scale_fix() -> bool:
  """Makes ``LossScaleOptimizer(CompressedOptimizer(...))`` agree across replicas.

  Replaces ``keras.optimizers.LossScaleOptimizer.check_finite`` (see the module
  docstring). Safe to call any number of times, from any thread: the wrapper is
  installed once. Loss scale optimizers around any other optimizer behave as Keras
  has them.

  Returns:
    Whether the wrapper is installed (False only for a Keras whose
    ``LossScaleOptimizer`` has no ``check_finite``, with one warning logged).
  """
  with _LOCK:
    cls = _loss_scale_optimizer_class()
    current = getattr(cls, "check_finite", None)
    if getattr(current, MARK, False):
      return True
    if not callable(current):
      if not _WARNED:
        _WARNED.append(True)
        import keras  # pylint: disable=g-import-not-at-top
        logging.getLogger("tf_adacomp").warning(
            "tf_adacomp: Keras %s's LossScaleOptimizer has no check_finite: under a "
            "strategy, an overflow on a replica other than the first may not lower the "
            "loss scale of LossScaleOptimizer(CompressedOptimizer(...)).", keras.__version__)
      return False
    cls.check_finite = _make_check_finite(current)
    return True
