"""The exchange engine: reductions as values, and the bytes it reports against the wire."""

import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp import exchange
from tf_adacomp import stats
from tf_adacomp.compressors import registry

DEVICES = ["/cpu:0", "/cpu:1"]  # 2 replicas: XLA compiles every kernel once per device


def test_reductions_are_values():
  assert exchange.REDUCTIONS == ("sum", "adasum")
  assert exchange.get_reduction("sum") is exchange.SUM
  assert exchange.get_reduction(exchange.ADASUM) is exchange.ADASUM
  assert exchange.SUM.to_mean(8.0, 4) == 2.0 and exchange.SUM.to_sum(8.0, 4) == 8.0
  assert exchange.ADASUM.to_mean(2.0, 4) == 2.0 and exchange.ADASUM.to_sum(2.0, 4) == 8.0
  a = tf.constant([1.0, 0.0])
  np.testing.assert_allclose(exchange.ADASUM.combine([a, a]), [1.0, 0.0])  # equal: mean
  np.testing.assert_allclose(exchange.SUM.combine([a, a]), [2.0, 0.0])


@pytest.mark.parametrize("bad", ["mean", None, 3])
def test_unknown_reduction_is_named(bad):
  with pytest.raises(ValueError, match=f"reduction={bad!r}"):
    exchange.get_reduction(bad)


@pytest.mark.parametrize("fuse", [pytest.param(False, marks=pytest.mark.slow), True])
def test_replica_exchange_reports_what_the_joined_gather_sends(fuse):
  """Replicas of unequal payload lengths: the bytes reported for all tensors add up to the
  padded joined buffer plus one length word per payload (per tensor, or one bucket), from
  the real payloads."""
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES)
  replicas = len(DEVICES)
  compressor = tf_adacomp.AdaComp(min_size=0, fuse=fuse)
  plans = [compressor.plan([2000], tf.float32, "a"), compressor.plan([3000], tf.float32, "b")]
  rng = np.random.default_rng(0)
  # Replica r's gradients are sparse to a different degree: unequal payloads.
  grads = [[(rng.standard_normal(p.num_elements) * (rng.random(p.num_elements) < 0.1 * (r + 1)))
            .astype(np.float32) for p in plans] for r in range(replicas)]

  @tf.function
  def step():
    def replica_fn():
      r = tf.distribute.get_replica_context().replica_id_in_sync_group
      own = [tf.gather(tf.constant(np.stack([g[i] for g in grads])), r) for i in range(2)]
      states = [compressor.init(p) for p in plans]
      return exchange.replica_exchange(compressor, plans, own, states).nbytes
    return strategy.run(replica_fn)

  reported = [strategy.experimental_local_results(b)[0].numpy() for b in step()]
  states = [compressor.init(p) for p in plans]
  if fuse:  # one bucket payload per replica
    words = np.array([[int(tf.reduce_sum(compressor.nbytes(compressor.compress(
        [tf.constant(x) for x in g], states, plans)[0], plans))) // 4] for g in grads])
  else:
    words = np.array([[int(tf_adacomp.ops.payload_nbytes(compressor.compress(
        [tf.constant(g[i])], [states[i]], [plans[i]])[0])) // 4 for i in range(2)]
                      for g in grads])
  assert len(set(words[:, 0])) > 1  # the lengths differ between replicas
  assert sum(reported) == 4 * words.shape[1] + 4 * words.sum(axis=1).max()  # 4-byte words
  if not fuse:
    np.testing.assert_array_equal(reported, stats.exchange_nbytes(words).numpy())
  assert all(r > 0 for r in reported)


@pytest.mark.slow  # 96 steps of real training; the exchange engine in a custom loop under
# MirroredStrategy (bit-identical replicas, residues per replica) runs in the fast tier
# in test_replica_exchange_reports_what_the_joined_gather_sends and tests/compressors/
# test_fft_compressor.py (test_exchange_under_mirrored_strategy_is_bit_identical_...).
def test_the_documented_custom_loop_trains_and_keeps_replicas_equal():
  """docs/distributed.md, "Custom training loops": the loop as printed there."""
  import keras  # pylint: disable=g-import-not-at-top
  import digits_data  # pylint: disable=g-import-not-at-top
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES)
  (x, y), _ = digits_data.flat()
  with strategy.scope():
    model = digits_data.mlp(0)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  compressor = tf_adacomp.AdaComp()
  exchange = tf_adacomp.Exchange(compressor, reduction="sum")
  variables = model.trainable_variables
  plans = [compressor.plan(v.shape, v.dtype, v.path) for v in variables]
  with strategy.scope():  # each replica keeps its own residues
    residues = [[tf.Variable(s, trainable=False,
                             synchronization=tf.VariableSynchronization.ON_READ,
                             aggregation=tf.VariableAggregation.SUM)
                 for s in compressor.init(p)] for p in plans]

  def apply_sgd(strategy, sums):
    for variable, total in zip(variables, sums):
      strategy.extended.update(variable.value, lambda v, g: v.assign_sub(0.1 * g),
                               args=(total,))

  def replica_step(x, y):
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True)) / strategy.num_replicas_in_sync
    grads = tape.gradient(loss, variables)
    states = [tuple(v.read_value() for v in r) for r in residues]
    exchanged = exchange.replica_exchange(plans, grads, states)
    for r, new in zip(residues, exchanged.states):
      for variable, value in zip(r, new):
        variable.assign(value)
    tf.distribute.get_replica_context().merge_call(apply_sgd, args=(exchanged.sums,))
    return loss

  step = tf.function(lambda x, y: strategy.run(replica_step, args=(x, y)))
  dataset = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x[:1024], y[:1024])).batch(64).repeat(6))
  losses = [float(strategy.reduce("SUM", step(a, b), axis=None)) for a, b in dataset]
  assert np.mean(losses[-8:]) < 0.8 * np.mean(losses[:8]), losses
  for variable in variables:
    copies = [v.numpy() for v in variable.value.values]
    np.testing.assert_array_equal(copies[0], copies[1])
  kernel = next(i for i, p in enumerate(plans) if not p.dense)
  held = [r.numpy() for r in strategy.experimental_local_results(residues[kernel][0])]
  assert all(np.abs(h).sum() > 0 for h in held) and not np.array_equal(held[0], held[1])


@pytest.mark.parametrize("reduction", ["sum", "adasum"])
def test_decode_reads_one_incoming_record(reduction):
  """``decode`` takes what arrived as one ``Incoming``: built by hand from each replica's
  ``Outgoing`` (joined buffers, stacked lengths, summed or stacked summable payloads), it
  gives the totals of ``local_exchange`` bit for bit."""
  compressor = tf_adacomp.AdaComp(min_size=100)
  engine = exchange.Exchange(compressor, reduction)
  plans = [compressor.plan([2000], tf.float32, "a"), compressor.plan([10], tf.float32, "b"),
           compressor.plan([3000], tf.float32, "c")]
  rng = np.random.default_rng(1)
  grads = [[tf.constant(rng.standard_normal(p.num_elements).astype(np.float32)) for p in plans]
           for _ in range(2)]
  states = [[compressor.init(p) for p in plans] for _ in range(2)]
  totals, _ = engine.local_exchange(plans, grads, states, DEVICES, DEVICES[:1])

  outs = [engine.compress(plans, g, s) for g, s in zip(grads, states)]
  summable = list(outs[0].summable)
  incoming = exchange.Incoming(
      replicas=2,
      data=tf.concat([o.buffer() for o in outs], axis=0),
      lengths=tf.stack([o.lengths() for o in outs]),
      **({"summed": [tf.add_n([o.summable[i] for o in outs]) for i in summable]}
         if reduction == "sum" else
         {"summable_rows": [tf.stack([o.summable[i] for o in outs]) for i in summable]}))
  decoded = engine.decode(plans, outs[0], incoming)
  assert summable == [1] and len(outs[0].gathered) >= 1
  for got, want in zip(decoded, totals[0]):
    np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.parametrize("compressor", ["none", "adacomp"])
def test_slices_without_a_static_shape_are_exchanged_dense(compressor):
  """An IndexedSlices gradient whose ``dense_shape`` is not static (LossScaleOptimizer's
  unscaled slices of an Embedding) is summed into its rows, with the plan's shape: the
  joined all-reduce needs it (a TypeError on ``num_elements()`` before)."""
  compressor = registry.get_compressor(compressor)
  plans = [compressor.plan([5, 2], tf.float32, "embeddings")]
  values = np.arange(6, dtype=np.float32).reshape(3, 2)
  indices = np.array([1, 1, 4], np.int32)

  @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)])
  def exchanged(dense_shape):  # the shape known only when the function runs
    grad = tf.IndexedSlices(tf.constant(values), tf.constant(indices), dense_shape)
    return exchange.replica_exchange(compressor, plans, [grad],
                                     [compressor.init(plans[0])]).sums[0]

  total = exchanged(tf.constant([5, 2], tf.int32)).numpy()
  expected = np.zeros([5, 2], np.float32)
  np.add.at(expected, indices, values)
  if compressor.name == "none":
    np.testing.assert_array_equal(total, expected)
  else:  # AdaComp sends a part, with its residue: the shape is what matters here
    assert total.shape == (5, 2)


def test_an_exchange_sends_exactly_only_whole_summed_gradients():
  """Where ``CompressedOptimizer`` may send an IndexedSlices by the strategy's own
  all-reduce: a gradient sent whole and summed, nothing that a compressor or Adasum
  changes."""
  plan = lambda c: c.plan([100, 4], tf.float32, "embeddings")  # noqa: E731
  assert exchange.Exchange("none").sends_exactly(plan(exchange.Exchange("none").compressor))
  assert not exchange.Exchange("none", "adasum").sends_exactly(
      plan(exchange.Exchange("none").compressor))
  for name in ("adacomp", "topk", "fp16"):
    compressor = registry.get_compressor(name)
    assert not exchange.Exchange(compressor).sends_exactly(plan(compressor)), name
  small = tf_adacomp.AdaComp(min_size=10_000)  # below min_size: sent dense, as it is
  assert exchange.Exchange(small).sends_exactly(plan(small))
