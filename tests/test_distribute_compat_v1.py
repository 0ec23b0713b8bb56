"""``tf.compat.v1.distribute.MirroredStrategy`` objects in one process, one after the other.

The v1 class is not a subclass of ``tf.distribute.MirroredStrategy`` and keeps its own
``_collective_key_base``: before tf_adacomp gave it keys of its own too
(``compat.internals.own_collective_keys_per_strategy``), a v1 strategy over 2 devices and
then one over 3 both took group key 1, and the second one's first all-reduce failed with
"joining a group with size 3, but that group has size 2 (group_key=1)" (and aborted every
later collective of the process). In eager mode (TensorFlow 2 behaviour), not a TF1 graph.
"""

import numpy as np
import tensorflow as tf

import tf_adacomp  # noqa: F401  (its import gives every strategy its own keys)

CPUS = [f"/cpu:{i}" for i in range(4)]


def _group_key(strategy):
  """The first group key of ``strategy``'s collectives over its devices."""
  keys = strategy.extended._collective_keys  # pylint: disable=protected-access
  return keys.get_group_key(strategy.extended.worker_devices)


def _sums(strategy):
  """A replica-context all-reduce and a cross-replica ``reduce``, as NumPy values."""
  def step():
    ctx = tf.distribute.get_replica_context()
    mine = tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.fill([3], mine)), mine

  all_reduced, own = strategy.run(step)
  reduced = strategy.reduce(tf.distribute.ReduceOp.SUM, own, axis=None)
  return [v.numpy() for v in strategy.experimental_local_results(all_reduced)], reduced.numpy()


def test_two_v1_mirrored_strategies_of_other_sizes_both_reduce():
  strategies = [tf.compat.v1.distribute.MirroredStrategy(CPUS[:n]) for n in (2, 3)]
  # Checked before any collective runs: a clash would abort the process' collectives
  # (every later test's too) rather than fail this test alone.
  keys = [_group_key(s) for s in strategies]
  assert keys[0] != keys[1] and min(keys) > 1, (
      f"the v1 strategies got TensorFlow's shared group keys {keys}")
  for strategy, replicas in zip(strategies, (2, 3)):
    total = replicas * (replicas + 1) / 2
    all_reduced, reduced = _sums(strategy)
    assert len(all_reduced) == replicas
    for value in all_reduced:
      np.testing.assert_array_equal(value, [total] * 3)
    assert reduced == total
  # The v2 strategy and the v1 one draw from one counter: their ranges differ too.
  assert _group_key(tf.distribute.MirroredStrategy(CPUS[:2])) not in keys
