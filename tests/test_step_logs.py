"""tf_adacomp.step_logs: a marked function's logs averaged only where its condition holds.

The cross-worker path runs in tests/test_optimizer_multi_worker.py (two processes over
gRPC); here the held values' mechanics, under a MirroredStrategy of 2 CPU replicas,
with an average that counts its calls."""

import tensorflow as tf

from tf_adacomp import step_logs


def _strategy():
  return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


class _Holder:
  pass


def _run(marked, steps=7, every=3):
  """``steps`` calls of a function that makes per-replica logs (the step count, and the
  replica's id) and reduces them like Keras' ``reduce_per_replica``: the logs each call
  returned, and how many calls averaged."""
  strategy = _strategy()
  holder = _Holder()
  with strategy.scope():
    step = tf.Variable(0, dtype=tf.int64, trainable=False,
                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    averaged = tf.Variable(0, dtype=tf.int64, trainable=False,
                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

  def mean(values, strategy):
    averaged.assign_add(1)
    return {k: strategy.reduce("MEAN", v, axis=None) for k, v in values.items()}

  @tf.function
  def call():
    def replica():
      step.assign_add(1)
      if marked:
        step_logs.average_only_when(lambda: tf.equal(tf.math.floormod(step, every), 0),
                                    holder)
      replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
      return {"loss": tf.cast(step, tf.float32) * 10.0 + tf.cast(replica_id, tf.float32)}
    values = strategy.run(replica)
    return step_logs.mean_or_held(values, strategy, mean)

  logs = [float(call()["loss"]) for _ in range(steps)]
  return logs, int(averaged.numpy())


def test_a_marked_function_averages_at_its_condition_and_holds_between():
  logs, averaged = _run(marked=True)
  # Averaged at step 1 (nothing held yet), 3 and 6; the mean of replicas 0 and 1 is +0.5.
  assert logs == [10.5, 10.5, 30.5, 30.5, 30.5, 60.5, 60.5]
  assert averaged == 3


def test_an_unmarked_function_averages_every_call():
  logs, averaged = _run(marked=False)
  assert logs == [10.5 + 10 * k for k in range(7)]
  assert averaged == 7


def test_marking_outside_a_function_does_nothing():
  step_logs.average_only_when(lambda: tf.constant(False), _Holder())
  assert not step_logs.marked()
