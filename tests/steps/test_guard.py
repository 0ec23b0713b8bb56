"""The guarded step (tf_adacomp/steps/guard.py) and the rules it rests on, each on its
own: one agreement over the replicas, residues kept only where a step is finite, the
bytes counted, and the one restore rule of per-holder state (replica_state.spread)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_adacomp import exchange as exchange_lib
from tf_adacomp import replica_state
from tf_adacomp import replica_steps
from tf_adacomp.steps import guard as guard_lib

DEVICES = ["/cpu:0", "/cpu:1"]


def _per_replica(strategy, values):
  return strategy.experimental_distribute_values_from_function(
      lambda context: values[context.replica_id_in_sync_group])


@pytest.mark.parametrize("bad_replica", [None, 0, 1])
def test_every_replica_gets_the_same_answer_and_the_summed_counts(bad_replica):
  strategy = tf.distribute.MirroredStrategy(DEVICES)
  finite = _per_replica(strategy, [tf.constant(r != bad_replica) for r in range(2)])
  counts = _per_replica(strategy, [tf.constant(float(r + 1)) for r in range(2)])

  @tf.function
  def run():
    return strategy.run(lambda f, c: replica_steps.all_replicas_finite(f, c),
                        args=(finite, counts))

  answers, (totals,) = run()
  assert [bool(a) for a in strategy.experimental_local_results(answers)] == \
      [bad_replica is None] * 2
  assert [float(t) for t in strategy.experimental_local_results(totals)] == [3.0, 3.0]


def _guard(strategy, residue_values):
  with strategy.scope():
    residues = [(tf.Variable(value, synchronization=tf.VariableSynchronization.ON_READ,
                             aggregation=tf.VariableAggregation.SUM),)
                for value in residue_values]
    bytes_sent = tf.Variable(tf.fill([len(residue_values)], tf.constant(-1, tf.int64)),
                             synchronization=tf.VariableSynchronization.ON_READ,
                             aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
  traced = []
  guard = guard_lib.Guard(exchange_lib.Exchange("none"), None, [None] * len(residue_values),
                          residues, bytes_sent, strategy, on_traced=lambda: traced.append(1))
  return guard, residues, bytes_sent, traced


@pytest.mark.parametrize("result, mask, kept", [
    (1.0, None, False),            # finite: the new residue is kept
    (np.nan, None, True),          # not finite: the old one stays
    (1.0, False, True),            # finite, but masked out: the old one stays
])
def test_settle_keeps_residues_only_where_the_step_is_finite(result, mask, kept):
  strategy = tf.distribute.MirroredStrategy(DEVICES)
  guard, residues, bytes_sent, traced = _guard(strategy, [np.zeros(3, np.float32),
                                                          np.zeros(2, np.float32)])

  @tf.function
  def run():
    def step():
      old = guard.states([0, 1])
      new = [(o[0] + 5.0,) for o in old]
      masks = None if mask is None else [tf.constant(mask), None]
      return guard.settle([0, 1], old, new, [tf.constant(result), tf.constant(2.0)],
                          [tf.constant(7, tf.int64), None], masks=masks)
    return strategy.run(step)

  finite = run()
  assert [bool(f) for f in strategy.experimental_local_results(finite)] == \
      [not np.isnan(result)] * 2
  for copy in residues[0][0].values:
    np.testing.assert_array_equal(copy.numpy(), np.zeros(3) if kept else np.full(3, 5.0))
  # The second variable is unmasked: it follows the step's finiteness alone.
  for copy in residues[1][0].values:
    np.testing.assert_array_equal(copy.numpy(),
                                  np.zeros(2) if np.isnan(result) else np.full(2, 5.0))
  np.testing.assert_array_equal(bytes_sent.values[0].numpy(), [7, 0])
  assert traced, "the first-compile log is told once the step is traced"


def test_record_bytes_zeroes_the_variables_a_step_did_not_send():
  strategy = tf.distribute.MirroredStrategy(DEVICES[:1])
  guard, _, bytes_sent, traced = _guard(strategy, [np.zeros(1, np.float32)] * 3)
  with strategy.scope():
    guard.record_bytes([2], [tf.constant(9, tf.int64)], traced=False)
  np.testing.assert_array_equal(bytes_sent.numpy(), [0, 0, 9])
  assert not traced


@pytest.mark.parametrize("saved, count, expected", [
    ([[1.0, 2.0], [3.0, 4.0]], 2, [[1.0, 2.0], [3.0, 4.0]]),    # as many: each its own
    ([[1.0, 2.0], [3.0, 4.0]], 4, [[1.0, 1.5]] * 4),            # floating: sum split evenly
    ([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], 1, [[9.0, 12.0]]),   # onto one: the whole sum
    ([[7, 1], [8, 2]], 3, [[7, 1]] * 3),                        # integer: the first copy
])
def test_spread_is_the_restore_rule_of_per_holder_state(saved, count, expected):
  values = replica_state.spread(tf.constant(saved), count)
  assert len(values) == count
  np.testing.assert_array_equal(np.stack([v.numpy() for v in values]), expected)
