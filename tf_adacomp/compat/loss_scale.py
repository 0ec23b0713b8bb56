"""Keras' ``LossScaleOptimizer`` around a compressing optimizer: one decision for all replicas.

The upstream behaviour
----------------------
Keras 3's ``LossScaleOptimizer`` (``keras/src/optimizers/loss_scale_optimizer.py``)
decides whether a step is finite with ``check_finite(grads)`` on each replica's own
gradients, which in Keras 3 are not all-reduced before ``apply``:

- in the merge-call path (``MirroredStrategy`` and ``MultiWorkerMirroredStrategy``
  unless XLA-compiled on GPUs only; ``_tf_apply``) it calls ``check_finite`` in every
  replica and keeps replica 0's answer (a choice made for Keras 2, where gradients
  arrived all-reduced). An overflow on another replica is not seen: the loss scale is
  not lowered and the step is counted as good;
- in the no-merge-call path (``_common_apply``) each replica takes its own branch of a
  ``cond``: replicas diverge, and the one that applies waits in the compressed exchange
  for replicas that never come.

``CompressedOptimizer`` itself skips a step that is not finite on any replica, so the
weights were safe in the merge-call path, but the loss scale stayed too high and kept
overflowing.

The fix
-------
One patch (``compat.patches``), ``CHECK_FINITE``: ``LossScaleOptimizer.check_finite``
becomes a wrapper that, when the optimizer's ``inner_optimizer`` asks for it (it has a
true ``AGREE_ON_FINITE`` attribute, as ``CompressedOptimizer`` does) and it runs in a
replica context with more than one replica in sync, all-reduces the number of replicas
whose gradients are not finite (one float32 scalar) and answers "finite" only when that
number is 0. Every replica then gets the same answer, so in either path every replica
lowers the scale and skips the step, or every replica applies it. Any other inner
optimizer, a single replica, and a call in cross-replica context get Keras' own
``check_finite`` unchanged. ``CompressedOptimizer.__init__`` applies it, so
``LossScaleOptimizer(CompressedOptimizer(...))`` and ``model.compile`` under
``mixed_float16`` need no call from the user.

The inner optimizer is recognised by that attribute rather than by its class, so that
this module needs nothing from ``optimizer.py`` (which installs the patch): the
dependency goes one way.

Guards
------
The fix relies on three things of Keras' ``LossScaleOptimizer``: it has
``check_finite(self, grads)``; ``_tf_apply`` and ``_common_apply`` decide through
``self.check_finite``; the merge-call path calls it in each replica, where a collective
can run. ``tests/compat/test_loss_scale.py`` checks all three on the installed Keras by
running them. When ``check_finite`` is missing, installing logs one warning and patches
nothing.
"""

import functools

import keras
import tensorflow as tf

from tf_adacomp import replica_steps
from tf_adacomp.compat import patches

__all__ = ["AGREE_ON_FINITE", "CHECK_FINITE", "apply_loss_scale_fix", "loss_scale_fix_applied",
           "original_check_finite"]

CHECK_FINITE = "LossScaleOptimizer.check_finite"

# The attribute by which an inner optimizer asks for one finite decision over all
# replicas: true on ``CompressedOptimizer``, whose apply runs a collective.
AGREE_ON_FINITE = "agree_on_finite_across_replicas"


def _loss_scale_optimizer_class():
  return keras.optimizers.LossScaleOptimizer


def _wrap_check_finite(original):
  @functools.wraps(original)
  def check_finite(self, grads):
    finite = original(self, grads)
    if not getattr(getattr(self, "inner_optimizer", None), AGREE_ON_FINITE, False):
      return finite
    if tf.distribute.in_cross_replica_context():
      return finite
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync <= 1:
      return finite
    # Keras' gradients are per replica here: one replica's overflow must lower the
    # scale and skip the step on all of them (and every replica must take the same
    # branch, since the compressed exchange in the step branch is a collective).
    return replica_steps.all_replicas_finite(finite)

  return check_finite


patches.register(patches.Patch(
    name=CHECK_FINITE, owner=_loss_scale_optimizer_class, attribute="check_finite",
    wrap=_wrap_check_finite,
    missing=("Keras' LossScaleOptimizer has no check_finite here: under a strategy, an "
             "overflow on a replica other than the first may not lower the loss scale of "
             "LossScaleOptimizer(CompressedOptimizer(...)).")))


def original_check_finite():
  """Keras' own ``LossScaleOptimizer.check_finite`` (None where there is none)."""
  return patches.original(CHECK_FINITE)


def loss_scale_fix_applied() -> bool:
  """Whether ``LossScaleOptimizer.check_finite`` is this module's wrapper."""
  return patches.applied(CHECK_FINITE)


def apply_loss_scale_fix() -> bool:
  """Makes ``LossScaleOptimizer`` around a ``CompressedOptimizer`` agree across replicas.

  Replaces ``keras.optimizers.LossScaleOptimizer.check_finite`` (see the module
  docstring). Safe to call any number of times, from any thread: the wrapper is
  installed once. Loss scale optimizers around any other optimizer behave as Keras
  has them.

  Returns:
    Whether the wrapper is installed (False only for a Keras whose
    ``LossScaleOptimizer`` has no ``check_finite``, with one warning logged).
  """
  patches.install(CHECK_FINITE)
  return patches.applied(CHECK_FINITE)
