"""Canaries of what ``compat.loss_scale`` relies on in Keras' ``LossScaleOptimizer``.

The patch replaces ``LossScaleOptimizer.check_finite``. That fixes the replicas'
disagreement only while Keras' own ``check_finite(self, grads)`` answers per replica,
and both of Keras' apply paths decide the step through ``self.check_finite`` (the
merge-call path calling it in every replica, where the wrapper can all-reduce). Each
canary runs the installed Keras and observes one of these. What the wrapper then does
under a strategy is tested in tests/test_optimizer_mixed_precision.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import canaries
import tf_adacomp
from tf_adacomp.compat import loss_scale
from tf_adacomp.compat import patches

CPUS = ["/cpu:0", "/cpu:1"]
INITIAL_SCALE = 2.0**10


def test_keras_check_finite_answers_for_the_gradients_it_is_given():
  name, user = "`LossScaleOptimizer.check_finite(self, grads)`", "compat.loss_scale"
  optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
  with canaries.watching(name, user):
    original = loss_scale.original_check_finite()
    answers = [bool(original(optimizer, [tf.ones([2]), tf.constant([1.0, bad])]))
               for bad in (2.0, np.inf, np.nan)]
  canaries.require(answers == [True, False, False], name, user,
                   f"finite, inf and nan gradients gave {answers}")


@pytest.mark.parametrize("merge_call", [True, False], ids=["_tf_apply", "_common_apply"])
def test_keras_decides_each_step_through_check_finite(merge_call):
  """A ``check_finite`` that says "not finite" (on the instance) must make Keras skip
  the step and halve the scale on every replica, in either of its apply paths; in the
  merge-call path it must be called once in every replica (replica context), where the
  patch's all-reduce can run. MirroredStrategy on CPUs takes the merge-call path; the
  other is forced on this instance (TensorFlow takes it for XLA on GPUs)."""
  method = "_tf_apply" if merge_call else "_common_apply"
  name, user = f"`LossScaleOptimizer.{method}` deciding through check_finite", \
      "compat.loss_scale"
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=CPUS)
  if not merge_call:
    strategy.extended._use_merge_call = lambda: False  # pylint: disable=protected-access
  with strategy.scope():
    variable = keras.Variable(np.ones([2], np.float32))
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                    initial_scale=INITIAL_SCALE)
    optimizer.build([variable])
  calls = []

  def never_finite(grads):
    del grads
    calls.append(tf.distribute.in_cross_replica_context())
    return tf.constant(False)

  optimizer.check_finite = never_finite  # the instance's: Keras calls self.check_finite

  @tf.function
  def step():
    strategy.run(lambda: optimizer.apply([tf.ones([2])], [variable]))

  with canaries.watching(name, user):
    step()
  weights = [c.numpy().tolist() for c in strategy.experimental_local_results(variable.value)]
  scales = [float(s) for s in strategy.experimental_local_results(optimizer.dynamic_scale.value)]
  canaries.require(calls and not any(calls), name, user,
                   f"check_finite called in replica context; in cross-replica: {calls}")
  canaries.require(len(calls) == len(CPUS), name, user,
                   f"called once per replica, {len(calls)} calls for {len(CPUS)} replicas")
  canaries.require(weights == [[1.0, 1.0]] * len(CPUS), name, user,
                   f"a step check_finite calls not finite is skipped: weights {weights}")
  canaries.require(scales == [INITIAL_SCALE / 2] * len(CPUS), name, user,
                   f"and the scale halves: {scales}")


def test_compressed_optimizer_asks_for_one_decision_and_installs_the_patch():
  assert getattr(tf_adacomp.CompressedOptimizer, loss_scale.AGREE_ON_FINITE) is True
  assert not getattr(keras.optimizers.SGD(0.1), loss_scale.AGREE_ON_FINITE, False)
  tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1))
  assert loss_scale.loss_scale_fix_applied() and patches.applied(loss_scale.CHECK_FINITE)
  wrapper = keras.optimizers.LossScaleOptimizer.check_finite
  assert wrapper.__wrapped__ is loss_scale.original_check_finite()
  assert loss_scale.apply_loss_scale_fix()  # again: the same wrapper
  assert keras.optimizers.LossScaleOptimizer.check_finite is wrapper
