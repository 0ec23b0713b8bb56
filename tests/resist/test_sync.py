"""The ResIST exchange: averages over each block's holders, bit-identical on every replica."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp import resist
from tf_adacomp.resist import sync

REPLICAS = 4
SHAPES = {"shared": [(3, 2), (5,)], "blocks": [[(4,)], [(2, 2), (3,)], [(1,)], [(6,)]]}


def _variables(strategy):
  with strategy.scope():
    make = lambda shape: keras.Variable(np.zeros(shape, np.float32))  # noqa: E731
    return ([make(s) for s in SHAPES["shared"]],
            [[make(s) for s in block] for block in SHAPES["blocks"]])


def _copies(variable, strategy):
  return strategy.experimental_local_results(variable.value)


def test_every_parameter_becomes_its_mean_over_its_holders():
  strategy = tf_adacomp.distribute.mirrored_strategy(
      devices=[f"/cpu:{i}" for i in range(REPLICAS)])
  shared, blocks = _variables(strategy)
  held = resist.deal((2, 2), REPLICAS, round_index=1, seed=5, min_blocks=2)
  assert held.sum(axis=0).max() > 1 and held.sum(axis=0).min() == 1  # both cases
  rng = np.random.default_rng(0)
  values = {}
  for k, segment in enumerate([shared] + blocks):
    for variable in segment:
      rows = rng.standard_normal([REPLICAS, *variable.shape]).astype(np.float32)
      if k:  # what a replica did not train must not travel: make it poison
        rows[~held[:, k - 1]] = np.nan
      for copy, row in zip(_copies(variable, strategy), rows):
        copy.assign(row)
      values[id(variable)] = (rows, held[:, k - 1] if k else np.ones(REPLICAS, bool))

  exchange = resist.HolderAverage(strategy, shared, blocks)
  lengths = exchange(held)

  for segment in [shared] + blocks:
    for variable in segment:
      rows, holders = values[id(variable)]
      total = np.zeros(variable.shape, np.float32)
      for r in range(REPLICAS):  # float32, in replica order: as every replica sums
        if holders[r]:
          total = total + rows[r]
      expected = total / np.float32(holders.sum())
      for copy in _copies(variable, strategy):
        np.testing.assert_array_equal(copy.numpy(), expected)
  words = [sum(int(np.prod(s)) for s in block) for block in SHAPES["blocks"]]
  np.testing.assert_array_equal(lengths, np.c_[np.full(REPLICAS, 11), held * words])
  cost = sync.round_bytes(lengths)
  np.testing.assert_array_equal(cost.sent, 4 * (11 + (held * words).sum(axis=1)) + 4 * 5)
  assert cost.padded == cost.sent.max()

  with pytest.raises(ValueError, match="holder for every block"):
    exchange(np.zeros([REPLICAS, 4], bool))


def test_the_optimizer_state_is_reset_and_the_step_count_kept():
  variable = keras.Variable(np.ones([3], np.float32))
  optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
  for _ in range(3):
    optimizer.apply([tf.ones([3])], [variable])
  assert np.any(optimizer.momentums[0].numpy())
  reset = resist.reset_optimizer(optimizer)
  assert [id(v) for v in reset] == [id(optimizer.momentums[0])]
  assert not np.any(optimizer.momentums[0].numpy())
  assert int(optimizer.iterations.numpy()) == 3


def test_the_learning_rate_is_kept_constant_or_scheduled():
  variable = keras.Variable(np.ones([3], np.float32))
  optimizer = keras.optimizers.Adam(0.25)
  optimizer.apply([tf.ones([3])], [variable])
  rate = optimizer.learning_rate  # a variable, among optimizer.variables
  reset = resist.reset_optimizer(optimizer)
  assert all(v is not rate for v in reset) and len(reset) == 2  # both moments
  assert float(rate.numpy()) == 0.25

  schedule = keras.optimizers.schedules.ExponentialDecay(0.5, 10, 0.5)
  optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
  optimizer.apply([tf.ones([3])], [variable])
  reset = resist.reset_optimizer(optimizer)
  assert [id(v) for v in reset] == [id(optimizer.momentums[0])]
  assert int(optimizer.iterations.numpy()) == 1


def test_local_gradients_are_each_replicas_own_mean_gradient():
  """Keras scales each replica's loss by 1/replicas; the hook undoes it, and sums nothing."""
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=["/cpu:0", "/cpu:1"])
  scaled = strategy.experimental_distribute_values_from_function(
      lambda ctx: tf.constant(0.5 * (ctx.replica_id_in_sync_group + 1)))

  def own(value):
    return sync.local_gradients([(value, None)])[0][0]

  result = strategy.experimental_local_results(strategy.run(own, args=(scaled,)))
  np.testing.assert_array_equal([g.numpy() for g in result], [1.0, 2.0])
  assert sync.local_gradients([(None, "v")]) == [(None, "v")]
  assert float(own(tf.constant(3.0))) == 3.0  # no strategy: unchanged
