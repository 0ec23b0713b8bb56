"""CompressedAllReduce under MirroredStrategy on 2 logical CPU devices.

Two replicas take the code paths of four (XLA compiles every kernel once per device);
one compressor configuration ("adacomp", min_size=0) and one vector shape ([600]) for
the custom loops, so that the process compiles their kernels once; the model.fit tests
share one trained run (``adacomp_fit``).
"""

import copy

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
import digits_data

DEVICES = ["/cpu:0", "/cpu:1"]
REPLICAS = len(DEVICES)
SIZE = 600  # the custom loops' vector: one set of kernels for all of them


def _strategy(ops=None):
  # Through the helper: every strategy gets collective keys of its own (see distribute).
  return tf_adacomp.distribute.mirrored_strategy(devices=DEVICES, cross_device_ops=ops)


def _fit(strategy, steps=4, seed=0):
  (x, y), _ = digits_data.flat()
  with strategy.scope():
    model = digits_data.mlp(seed)
  model.fit(x[:64 * steps], y[:64 * steps], batch_size=64, epochs=1, verbose=0,
            shuffle=False)
  return model


@pytest.fixture(scope="module")
def adacomp_fit():
  """One model.fit of the digits MLP through CompressedAllReduce("adacomp"), shared by
  the tests that inspect its replicas and residues; the biases go dense (half the
  kernels to compile: 1-D tensors are compressed in the custom loops). ``(ops, model)``."""
  ops = tf_adacomp.CompressedAllReduce("adacomp", min_size=100)
  return ops, _fit(_strategy(ops), steps=6)


# Slow: CompressedAllReduce("none") under model.fit trains as the default all-reduce in
# tests/conformance/test_oracle_cross_device_ops.py's test_trains_as_the_default_all_reduce
# [replicas=2] in the fast tier.
@pytest.mark.slow
def test_no_compression_trains_like_plain_mirrored_strategy():
  plain = _fit(_strategy())
  ops = tf_adacomp.CompressedAllReduce("none")
  compressed = _fit(_strategy(ops))
  for a, b in zip(plain.get_weights(), compressed.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  dense_kernel = [v for k, v in ops.bytes_sent().items() if k.endswith("64x64_float32")]
  assert dense_kernel == [64 * 64 * 4]


def test_adacomp_replicas_stay_bit_identical_and_residues_persist(adacomp_fit):
  ops, model = adacomp_fit
  for variable in model.trainable_variables:
    copies = [v.numpy() for v in variable.value.values]
    assert len(copies) == REPLICAS
    for other in copies[1:]:
      np.testing.assert_array_equal(copies[0], other)
  kernel_key = next(k for k in ops.residues if k.endswith("64x64_float32"))
  residues = [vs[0].numpy() for vs in ops.residues[kernel_key]]
  assert all(np.abs(r).sum() > 0 for r in residues)  # error feedback is held per device
  assert not np.array_equal(residues[0], residues[1])  # each device has its own
  assert 0 < ops.bytes_sent()[kernel_key] < 64 * 64 * 4 / 20


def test_residues_survive_a_checkpoint_round_trip(tmp_path, adacomp_fit):
  ops, _ = adacomp_fit
  # The compressed tensors' residues (a tensor sent dense holds none).
  held = {k: v for k, v in ops.residues.items() if all(v)}
  assert len(held) == 2  # the two kernels
  saved = {k: [vs[0].numpy() for vs in v] for k, v in held.items()}
  # Something to restore: zeros would come back as zeros from no checkpoint at all.
  assert any(np.abs(r).sum() > 0 for per_device in saved.values() for r in per_device)
  path = tf.train.Checkpoint(ops=ops).save(str(tmp_path / "ckpt"))
  for per_device in held.values():
    for state in per_device:
      state[0].assign(tf.zeros_like(state[0]))
  tf.train.Checkpoint(ops=ops).restore(path).assert_consumed()
  for key, values in saved.items():
    for state, value in zip(ops.residues[key], values):
      np.testing.assert_array_equal(state[0].numpy(), value)


# MEAN in the fast tier (SUM, the same path without the division, with --full).
@pytest.mark.parametrize("reduce_op", [
    pytest.param(tf.distribute.ReduceOp.SUM, marks=pytest.mark.slow), tf.distribute.ReduceOp.MEAN])
def test_custom_loop_all_reduce_of_floats_ints_and_indexed_slices(reduce_op):
  ops = tf_adacomp.CompressedAllReduce("adacomp", min_size=0)
  strategy = _strategy(ops)
  rng = np.random.default_rng(0)
  grads = rng.standard_normal([REPLICAS, SIZE]).astype(np.float32)

  @tf.function
  def step():
    def replica_fn():
      ctx = tf.distribute.get_replica_context()
      r = ctx.replica_id_in_sync_group
      grad = tf.gather(tf.constant(grads), r)
      counts = tf.fill([3], tf.cast(r, tf.int64) + 1)  # int32 would bypass the ops entirely
      sparse = tf.IndexedSlices(tf.ones([1, 2]) * tf.cast(r, tf.float32), tf.reshape(r, [1]),
                                tf.constant([REPLICAS, 2]))
      return ctx.all_reduce(reduce_op, [grad, counts, sparse])
    return strategy.run(replica_fn)

  grad_sum, counts, sparse = [strategy.experimental_local_results(v) for v in step()]
  divide = REPLICAS if reduce_op == tf.distribute.ReduceOp.MEAN else 1
  # The compressed float: each device gets the same decoded sum of the replicas' payloads.
  expected = sum(tf_adacomp.ops.adacomp_decompress(
      tf_adacomp.ops.adacomp_compress(g, tf.zeros_like(g), 500)[0], [SIZE]) for g in grads)
  for value in grad_sum:
    np.testing.assert_allclose(value.numpy(), expected.numpy() / divide, rtol=1e-6)
    np.testing.assert_array_equal(value.numpy(), grad_sum[0].numpy())
  # Integers and IndexedSlices are reduced exactly.
  total = REPLICAS * (REPLICAS + 1) // 2  # 1 + 2 + ...
  np.testing.assert_allclose(counts[0].numpy(), np.full([3], total / divide))  # as TF reduces
  dense = tf.convert_to_tensor(sparse[0]).numpy()
  np.testing.assert_allclose(dense[:, 0], np.arange(REPLICAS) / divide)


def test_only_compact_payloads_cross_devices():
  """Every tensor that one device's op reads from another device is int32 (payloads
  and lengths) or a scalar: no gradient-sized float tensor crosses devices."""
  ops = tf_adacomp.CompressedAllReduce("adacomp", min_size=0)
  strategy = _strategy(ops)

  @tf.function
  def step():
    def replica_fn():
      ctx = tf.distribute.get_replica_context()
      # Made on the replica's own device, so that only the reduction moves data.
      grad = tf.random.stateless_normal([SIZE], [ctx.replica_id_in_sync_group, 0])
      return ctx.all_reduce(tf.distribute.ReduceOp.SUM, grad)
    return strategy.run(replica_fn)

  graph = step.get_concrete_function().graph
  crossing = []
  for op in graph.get_operations():
    for tensor in op.inputs:
      if op.device and tensor.op.device and tf.DeviceSpec.from_string(op.device) != \
          tf.DeviceSpec.from_string(tensor.op.device):
        crossing.append(tensor)
  assert crossing, "expected payload copies between devices"
  for tensor in crossing:
    if tensor.dtype.is_floating:
      assert tensor.shape.num_elements() is not None and tensor.shape.num_elements() <= 1, tensor
  assert any(t.dtype == tf.int32 and t.shape.rank == 1 for t in crossing)
  step()
  assert 0 < max(ops.bytes_sent().values()) < SIZE * 4 / 8


def test_warm_up_steps_are_exact():
  ops = tf_adacomp.CompressedAllReduce("adacomp", start_step=2, min_size=0)
  strategy = _strategy(ops)
  grads = tf.random.normal([REPLICAS, SIZE])

  @tf.function
  def step():
    def replica_fn():
      ctx = tf.distribute.get_replica_context()
      return ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                            tf.gather(grads, ctx.replica_id_in_sync_group))
    return strategy.run(replica_fn)

  exact = tf.reduce_sum(grads, 0).numpy()
  for _ in range(2):
    np.testing.assert_allclose(strategy.experimental_local_results(step())[0], exact, rtol=1e-5)
  third = strategy.experimental_local_results(step())[0].numpy()
  assert np.count_nonzero(third) < SIZE  # compressed from now on


def test_deepcopy_gives_an_equal_configuration_without_state():
  ops = tf_adacomp.CompressedAllReduce(tf_adacomp.TopK(0.1), start_step=3)
  strategy = _strategy(ops)
  per_replica = strategy.experimental_distribute_values_from_function(
      lambda ctx: tf.fill([100], float(ctx.replica_id_in_sync_group)))
  strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
  strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(per_replica, per_replica)])
  assert ops.residues
  copied = copy.deepcopy(ops)
  assert copied.compressor == ops.compressor and copied.start_step == 3
  assert copied.residues == {}
  strategy = copy.deepcopy(strategy)  # as strategies do with their ops
  assert isinstance(strategy.extended._cross_device_ops, tf_adacomp.CompressedAllReduce)  # pylint: disable=protected-access


@pytest.mark.parametrize("kwargs,match", [
    ({"compressor": "zip"}, "identifier='zip'"), ({"start_step": -1}, "start_step=-1"),
    ({"min_size": -2}, "min_size=-2")])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tf_adacomp.CompressedAllReduce(**kwargs)


def test_a_misspelt_keyword_is_refused_naming_the_closest_one():
  with pytest.raises(TypeError) as error:
    tf_adacomp.CompressedAllReduce("adacomp", min_sise=100)
  assert str(error.value) == (
      "CompressedAllReduce() got an unexpected keyword argument 'min_sise' "
      "(Received: min_sise=100). Did you mean 'min_size'?")


# --- Contracts that the exchange engine fixed (issue 17; issue 19 item 1) ------------------


def _per_replica(strategy, fn):
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: fn(ctx.replica_id_in_sync_group))


# Pairwise with --full: each reduction and each mode (eager, in a function). Slow (all
# four): the eager placement, on each device of a mirrored variable as
# ReductionToOneDevice's, for SUM and MEAN, is tests/conformance/
# test_cross_device_ops_conformance.py's test_reduce_and_batch_reduce_as_reduction_to_one_
# device's in the fast tier (the placement is the same in either mode).
@pytest.mark.parametrize("reduce_op, in_function", [
    pytest.param(tf.distribute.ReduceOp.SUM, False, marks=pytest.mark.slow),
    pytest.param(tf.distribute.ReduceOp.MEAN, True, marks=pytest.mark.slow),
    pytest.param(tf.distribute.ReduceOp.SUM, True, marks=pytest.mark.slow),
    pytest.param(tf.distribute.ReduceOp.MEAN, False, marks=pytest.mark.slow)])
def test_results_live_on_each_destination_device(in_function, reduce_op):
  """One component on each destination device, as ReductionToOneDevice places them (they
  all sat on the first device before, or on none inside a tf.function)."""
  placed = {}
  for name, ops in [("reference", tf.distribute.ReductionToOneDevice()),
                    ("compressed", tf_adacomp.CompressedAllReduce("adacomp", min_size=0))]:
    strategy = _strategy(ops)
    with strategy.scope():
      destinations = tf.Variable(tf.zeros([SIZE]))  # a component on each device
    values = _per_replica(strategy, lambda r: tf.fill([SIZE], float(r + 1)))
    sparse = _per_replica(strategy, lambda r: tf.IndexedSlices(
        tf.ones([1, 2]), tf.reshape(r, [1]), tf.constant([REPLICAS, 2])))

    def reduce():
      results = strategy.extended.batch_reduce_to(
          reduce_op, [(values, destinations), (sparse, destinations)])
      components = strategy.experimental_local_results(results[0])
      # Inside a function: where the graph places them (its outputs come back on one).
      placed[name] = [tf.DeviceSpec.from_string(c.device).device_index for c in components]
      return components

    dense = tf.function(reduce)() if in_function else reduce()
    for c in dense:
      np.testing.assert_allclose(c.numpy(), dense[0].numpy())
  assert placed["compressed"] == placed["reference"] == list(range(REPLICAS))


@pytest.mark.parametrize("compressor", ["fft", "adacomp", "topk", "bf16", "fp16"])
@pytest.mark.parametrize("reduction", ["sum", "adasum"])
def test_scalars_are_summed_exactly(compressor, reduction):
  """Losses and metric totals: FFT used to return 3.5 for 1.2345678 + 2.2345678."""
  ops = tf_adacomp.CompressedAllReduce(compressor, min_size=0, reduction=reduction)
  strategy = _strategy(ops)
  scalars = np.array([1.2345678, 2.2345678, 0.5, -0.25][:REPLICAS], np.float32)

  @tf.function
  def step():
    def replica_fn():
      ctx = tf.distribute.get_replica_context()
      return ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                            tf.gather(tf.constant(scalars), ctx.replica_id_in_sync_group))
    return strategy.run(replica_fn)

  total = strategy.experimental_local_results(step())[0].numpy()
  np.testing.assert_allclose(total, scalars.astype(np.float64).sum(), rtol=1e-6)
  assert not ops.residues  # nothing compressed, nothing held back


def test_two_functions_reducing_the_same_shape_keep_separate_residues():
  ops = tf_adacomp.CompressedAllReduce("adacomp", min_size=0)
  strategy = _strategy(ops)
  rng = np.random.default_rng(1)
  train_grads = tf.constant(rng.standard_normal([REPLICAS, SIZE]), tf.float32)
  eval_values = tf.constant(rng.standard_normal([REPLICAS, SIZE]) * 100, tf.float32)

  def reduce(data):
    def replica_fn():
      ctx = tf.distribute.get_replica_context()
      return ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                            tf.gather(data, ctx.replica_id_in_sync_group))
    return strategy.run(replica_fn)

  @tf.function
  def train_step():
    return reduce(train_grads)

  @tf.function
  def eval_step():
    return reduce(eval_values)

  train_step()
  train_key, = ops.residues
  after_train = [s[0].numpy() for s in ops.residues[train_key]]
  eval_step()
  assert len(ops.residues) == 2  # one shared residue before
  for state, value in zip(ops.residues[train_key], after_train):
    np.testing.assert_array_equal(state[0].numpy(), value)


# Slow: warm-up is test_warm_up_steps_are_exact's and CompressionStats under model.fit
# test_optimizer.py's test_stats_callback_logs_ratios's in the fast tier.
@pytest.mark.slow
def test_warm_up_steps_count_the_dense_bytes_they_send():
  """CompressionStats under model.fit: warm-up steps logged bytes_sent 0 and ratio NaN."""
  ops = tf_adacomp.CompressedAllReduce("adacomp", min_size=100, start_step=3)
  strategy = _strategy(ops)
  (x, y), _ = digits_data.flat()
  with strategy.scope():
    model = digits_data.mlp(0)
  logged = []
  record = keras.callbacks.LambdaCallback(
      on_train_batch_end=lambda batch, logs: logged.append(dict(logs)))
  stats = tf_adacomp.CompressionStats(progress_bar="all")
  model.fit(x[:320], y[:320], batch_size=64, epochs=1, verbose=0, shuffle=False,
            callbacks=[stats, record])
  dense = sum(4 * v.shape.num_elements() for v in model.trainable_variables)
  for logs in logged[:3]:  # warm-up: every tensor sent as float32, plus its length word
    assert dense <= logs["bytes_sent"] <= dense + 4 * len(model.trainable_variables)
    assert 0.99 < logs["compression_ratio"] <= 1.0
  for logs in logged[3:]:
    assert logs["compression_ratio"] > 2
