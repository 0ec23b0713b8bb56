"""CompressedAllReduce against the contract TensorFlow's own tests ask of a CrossDeviceOps.

Drawn from tensorflow/python/distribute/cross_device_ops_test.py (and its v1 version's
``_testReductionAndBroadcast``) and mirrored_strategy_test.py: ``reduce`` and
``batch_reduce`` of SUM and MEAN to destinations given as a device string, a mirrored
variable or a per-replica value return one component on each destination device (a
``Mirrored``, or a tensor for one device); a value that is not per-replica is reduced as one;
``broadcast`` and ``gather`` behave as ``ReductionToOneDevice``'s. Run against every
compressor and both reductions; values are compared with ``ReductionToOneDevice`` where
they do not depend on lossy compression (the exact paths, and the "none" compressor).
"""

import numpy as np
import pytest
import tensorflow as tf

import adasum_reference
import tf_adacomp

DEVICES = ["/cpu:0", "/cpu:1"]
SUM, MEAN = tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN
SHAPE = [4, 16]  # one shape for every compressor: one set of kernels each to compile


def _per_replica(strategy, fn):
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: fn(ctx.replica_id_in_sync_group))


def _device_index(tensor):
  return tf.DeviceSpec.from_string(tensor.device).device_index


def _batch(strategy):
  """A batch as Keras' gradients and a custom loop's metrics give it: a dense float
  tensor, an IndexedSlices, an int32 tensor and a float scalar."""
  return [
      _per_replica(strategy, lambda r: tf.reshape(tf.range(64, dtype=tf.float32), SHAPE)
                   * float(r + 1)),
      _per_replica(strategy, lambda r: tf.IndexedSlices(
          tf.fill([1, 16], float(r + 1)), tf.reshape(r, [1]), tf.constant(SHAPE))),
      _per_replica(strategy, lambda r: tf.fill([3], r + 1)),
      _per_replica(strategy, lambda r: tf.constant(float(r + 1))),
  ]


def _destinations(strategy, kind):
  if kind == "string":
    return "/cpu:1"
  if kind == "variable":
    with strategy.scope():
      return tf.Variable(tf.zeros(SHAPE))
  return _per_replica(strategy, lambda r: tf.zeros(SHAPE))  # "per_replica"


def _dense_gradients():
  """What each replica gives as the batch's dense float tensor (``_batch``'s first)."""
  return [np.arange(64, dtype=np.float32).reshape(SHAPE) * float(r + 1)
          for r in range(len(DEVICES))]


def _error_feedback_result(ops, batch_size, reduce_op, reduction):
  """What a compressed reduction of the dense tensor must return, from the residues it
  left: each device's decoded contribution is its gradient less its new residue (the old
  ones were zero), and the contributions are summed (or combined by Adasum)."""
  key, = [k for k in ops.residues if k.startswith(f"eager/batch{batch_size}_0_")]
  decoded = []
  for gradient, state in zip(_dense_gradients(), ops.residues[key]):
    residue = state[0].numpy() if state else np.zeros(SHAPE, np.float32)  # fp16, bf16, none
    decoded.append(gradient.astype(np.float64) - residue)
  replicas = len(DEVICES)
  if reduction == "adasum":
    total = adasum_reference.np_adasum(decoded).reshape(SHAPE)
    return total * replicas if reduce_op == SUM else total
  total = sum(decoded)
  return total if reduce_op == SUM else total / replicas


def _run(ops, reduce_op, kind):
  """The batch reduced by ``ops`` with batch_reduce and with reduce, as numpy arrays
  (IndexedSlices made dense), and the result's type and where each component lives."""
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES, cross_device_ops=ops)
  batch = _batch(strategy)
  destinations = _destinations(strategy, kind)
  batched = ops.batch_reduce(reduce_op, [(v, destinations) for v in batch])
  single = [ops.reduce(reduce_op, v, destinations) for v in batch]
  out = []
  for results in (batched, single):
    for result in results:
      # One destination device: a plain tensor, as regroup gives it; several: a Mirrored.
      components = strategy.experimental_local_results(result)
      out.append(([tf.convert_to_tensor(c).numpy() for c in components],
                  [type(result).__name__] + [_device_index(c) for c in components]))
  return out


def _compressor_reduction_pairs():
  """Every (compressor, reduction); the fast tier: each compressor once, the reductions
  in turn (each compressor's kernels compile for every destination kind)."""
  return [pytest.param(compressor, reduction, id=f"{reduction}-{compressor}",
                       marks=() if (i + j) % 2 == 0 else pytest.mark.slow)
          for i, compressor in enumerate(tf_adacomp.available_compressors())
          for j, reduction in enumerate(["sum", "adasum"])]


@pytest.mark.parametrize("compressor, reduction", _compressor_reduction_pairs())
def test_reduce_and_batch_reduce_as_reduction_to_one_device(compressor, reduction):
  """Every destination kind, SUM and MEAN: the same devices as the reference, and the same
  values where no compression loses anything."""
  lossy = compressor != "none" or reduction == "adasum"
  for reduce_op in (SUM, MEAN):
    for kind in ("string", "variable", "per_replica"):
      ops = tf_adacomp.CompressedAllReduce(compressor, min_size=0, reduction=reduction)
      got = _run(ops, reduce_op, kind)
      expected = _run(tf.distribute.ReductionToOneDevice(), reduce_op, kind)
      # batch_reduce's dense tensor, then reduce's: separate residues, both from zero.
      fed_back = [_error_feedback_result(ops, size, reduce_op, reduction) for size in (4, 1)]
      for position, ((values, devices), (reference, reference_devices)) in enumerate(
          zip(got, expected)):
        where = f"{reduce_op} to {kind}, tensor {position % 4}"
        assert devices == reference_devices, where
        assert len(values) == len(reference), where
        for value, ref in zip(values, reference):
          assert value.shape == ref.shape and value.dtype == ref.dtype, where
          np.testing.assert_array_equal(value, values[0], err_msg=where)  # same everywhere
          if position % 4 or not lossy:  # exact paths, or nothing lost
            np.testing.assert_allclose(value, ref, rtol=1e-6, err_msg=where)
          else:  # decoded sum + new residues == exact sum + old residues (zero)
            np.testing.assert_allclose(value, fed_back[position // 4], rtol=1e-5, atol=1e-4,
                                       err_msg=where)


def test_a_value_that_is_not_per_replica_is_reduced_as_one():
  """cross_device_ops_test: a plain tensor on one device reduces to itself."""
  ops = tf_adacomp.CompressedAllReduce("topk", min_size=0)
  with tf.device("/cpu:0"):
    value = tf.reshape(tf.range(64, dtype=tf.float32), SHAPE)
  result = ops.reduce(SUM, value, "/cpu:0")
  np.testing.assert_array_equal(tf.convert_to_tensor(result).numpy(), value.numpy())


def test_broadcast_and_gather_as_reduction_to_one_device():
  ops = tf_adacomp.CompressedAllReduce("topk", min_size=0)
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES, cross_device_ops=ops)
  with strategy.scope():
    destinations = tf.Variable([0.0, 0.0])  # one component on each device
  broadcast = ops.broadcast(tf.constant([1.0, 2.0]), destinations)
  components = strategy.experimental_local_results(broadcast)
  assert [_device_index(c) for c in components] == [0, 1]
  for c in components:
    np.testing.assert_array_equal(c.numpy(), [1.0, 2.0])
  value = _per_replica(strategy, lambda r: tf.fill([1, 2], float(r)))
  gathered = strategy.gather(value, axis=0)
  np.testing.assert_array_equal(tf.convert_to_tensor(gathered).numpy(), [[0.0, 0.0],
                                                                         [1.0, 1.0]])


def test_all_reduce_in_a_replica_context_gives_every_replica_the_result():
  """mirrored_strategy_test: ReplicaContext.all_reduce inside strategy.run."""
  ops = tf_adacomp.CompressedAllReduce("none", min_size=0)
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES, cross_device_ops=ops)

  @tf.function
  def step():
    def replica_fn():
      ctx = tf.distribute.get_replica_context()
      value = tf.fill(SHAPE, tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0)
      return ctx.all_reduce(SUM, value), ctx.all_reduce(MEAN, value)
    return strategy.run(replica_fn)

  summed, mean = step()
  for c in strategy.experimental_local_results(summed):
    np.testing.assert_array_equal(c.numpy(), np.full(SHAPE, 3.0))
  for c in strategy.experimental_local_results(mean):
    np.testing.assert_array_equal(c.numpy(), np.full(SHAPE, 1.5))
