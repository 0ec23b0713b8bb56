"""The dense warm-up (``start_step``) of the summable compressors (fp16, bf16).

A warm-up step exchanges dense float32 (CompressedOptimizer's and CompressedAllReduce's
docstrings). The compact compressors always did; the half-precision casts used to send
their half-precision payload anyway, so that a warm-up step applied the fp16 (bf16) sum.
Now their float32 gradients travel in the exchange's warm-up bucket during warm-up and the
total is their float32 sum in replica order (the bits a dense float32 step gives), and
after warm-up the half-precision sum again, with 8 bytes more per step (one unread word of
the warm-up bucket, so that no gathered buffer is ever empty, and its length).

Every check compares with NumPy (``ml_dtypes`` for bfloat16) on 2 replicas of
MirroredStrategy over the CPUs of tests/conftest.py. The gradients are chosen so that the
float32 sum and the half-precision one differ everywhere.
"""

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp import exchange

DEVICES = ["/cpu:0", "/cpu:1"]
SHAPES = ([6, 5], [7])
HALF = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def _grads(replica):
  """Replica ``replica``'s float32 gradients: values that no half precision holds, in
  [0.25, 1) with both signs (the sum of two of them is exact in float32)."""
  rng = np.random.default_rng(10 + replica)
  return [(rng.uniform(0.25, 1.0, s) * rng.choice([-1.0, 1.0], s) + 1e-4).astype(np.float32)
          for s in SHAPES]


def _float32_sum(k, replicas=2):
  total = _grads(0)[k]
  for r in range(1, replicas):  # replica order
    total = total + _grads(r)[k]
  return total


def _half_sum(k, compressor, replicas=2):
  half = HALF[compressor]
  total = _grads(0)[k].astype(half)
  for r in range(1, replicas):
    total = (total + _grads(r)[k].astype(half)).astype(half)
  return total.astype(np.float32)


def _assert_bits(actual, expected):
  np.testing.assert_array_equal(np.asarray(actual, np.float32).view(np.int32),
                                np.asarray(expected, np.float32).view(np.int32))


def _exchange(compressor, reduction="sum", hierarchy=None, strategy=None):
  """``run(dense)``: one ``replica_exchange`` on every replica (traced once), giving
  ``(sums, nbytes)`` of the first replica."""
  strategy = strategy or tf_adacomp.distribute.mirrored_strategy(devices=DEVICES)
  devices = strategy.extended.worker_devices
  compressor = tf_adacomp.get_compressor(compressor)
  plans = [compressor.plan(tf.TensorShape(s), tf.float32, f"v{k}") for k, s in enumerate(SHAPES)]
  engine = tf_adacomp.Exchange(compressor, reduction)
  grads = [np.stack([_grads(r)[k] for r in range(len(devices))]) for k in range(len(SHAPES))]

  @tf.function
  def step(dense):
    def replica_fn():
      replica = tf.distribute.get_replica_context().replica_id_in_sync_group
      own = [tf.gather(tf.constant(g), replica) for g in grads]
      states = [tuple(compressor.init(p)) for p in plans]
      out = engine.replica_exchange(plans, own, states, dense, hierarchy=hierarchy)
      return out.sums, out.nbytes
    return strategy.run(replica_fn)

  def run(dense):
    sums, nbytes = step(tf.constant(dense))
    first = lambda v: strategy.experimental_local_results(v)[0].numpy()  # noqa: E731
    for values in sums:  # every replica holds the same bits
      results = [x.numpy() for x in strategy.experimental_local_results(values)]
      for other in results[1:]:
        _assert_bits(other, results[0])
    return [first(s) for s in sums], [int(first(b)) for b in nbytes]

  return run


@pytest.mark.parametrize("compressor", ["fp16", pytest.param("bf16", marks=pytest.mark.slow)])
def test_a_warm_up_step_sums_half_precision_gradients_as_float32(compressor):
  """Warm-up: the float32 sum, bit for bit (and not the half-precision one); after it the
  half-precision sum. Bytes: the half-precision payload always, plus the float32 words
  and a length word in warm-up, one word and its length after."""
  run = _exchange(compressor)
  for dense in (True, False):
    sums, nbytes = run(dense)
    for k, total in enumerate(sums):
      if dense:
        _assert_bits(total, _float32_sum(k))
        assert (total != _half_sum(k, compressor)).any()
      else:
        _assert_bits(total, _half_sum(k, compressor))
    dense_nbytes = [4 * int(np.prod(s)) for s in SHAPES]
    half_nbytes = [b // 2 for b in dense_nbytes]
    if dense:  # the length word of the one warm-up bucket goes to the largest tensor
      assert nbytes == [half_nbytes[0] + dense_nbytes[0] + 4, half_nbytes[1] + dense_nbytes[1]]
    else:  # 1 word and its length, counted with the first tensor
      assert nbytes == [half_nbytes[0] + 8, half_nbytes[1]]


@pytest.mark.slow  # Adasum's route (each replica's payload gathered) and the hierarchy
@pytest.mark.parametrize("route", ["adasum", "hierarchy"])
def test_the_warm_up_bucket_takes_adasums_and_the_hierarchys_routes(route):
  if route == "adasum":
    sums, _ = _exchange("fp16", reduction="adasum")(True)
    from adasum_reference import np_adasum  # pylint: disable=g-import-not-at-top
    for k, total in enumerate(sums):  # the Adasum of the float32 gradients
      np.testing.assert_allclose(total, np.reshape(np_adasum([_grads(0)[k], _grads(1)[k]]),
                                                 SHAPES[k]), rtol=1e-6)
      assert (total.astype(np.float16) != total).any()  # not rounded to half precision
    return
  devices = [f"/cpu:{i}" for i in range(4)]
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=devices)
  hierarchy = tf_adacomp.hierarchy.resolve(strategy, True, 2)
  run = _exchange("fp16", hierarchy=hierarchy, strategy=strategy)
  for dense in (True, False):
    sums, _ = run(dense)
    for k, total in enumerate(sums):
      # The workers' float32 local sums (devices 0+1, 2+3), then their float32 sum; after
      # warm-up the same local sums cast to half precision and added.
      local = [_grads(0)[k] + _grads(1)[k], _grads(2)[k] + _grads(3)[k]]
      if dense:
        _assert_bits(total, local[0] + local[1])
      else:
        _assert_bits(total, (local[0].astype(np.float16) + local[1].astype(np.float16))
                     .astype(np.float16).astype(np.float32))


def _apply(optimizer_of, steps, strategy=None):
  """``steps`` steps of ``apply_gradients`` on 2 replicas with the gradients above, the
  variables reset to zeros before each step: what each step applied (SGD, rate 1)."""
  strategy = strategy or tf_adacomp.distribute.mirrored_strategy(devices=DEVICES)
  with strategy.scope():
    variables = [keras.Variable(np.zeros(s, np.float32), name=f"v{k}")
                 for k, s in enumerate(SHAPES)]
    optimizer = optimizer_of()
    optimizer.build(variables)
  grads = [np.stack([_grads(r)[k] for r in range(2)]) / 2 for k in range(len(SHAPES))]

  @tf.function
  def step():
    def replica_fn():
      replica = tf.distribute.get_replica_context().replica_id_in_sync_group
      # Keras divides each replica's loss by the replicas: its gradient is half its own.
      optimizer.apply_gradients(
          [(tf.gather(tf.constant(g), replica), v) for g, v in zip(grads, variables)])
    strategy.run(replica_fn)

  applied = []
  for _ in range(steps):
    for v in variables:
      v.assign(tf.zeros_like(v))
    step()
    applied.append([-v.numpy() for v in variables])
  return applied


@pytest.mark.slow  # two optimizers under MirroredStrategy, traced and compiled
@pytest.mark.parametrize("compressor", ["fp16", "bf16"])
def test_the_gradient_exchange_applies_the_float32_sum_during_warm_up(compressor):
  applied = _apply(lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.SGD(1.0), compressor, start_step=2, exchange="gradients"), 3)
  for step, values in enumerate(applied):
    for k, value in enumerate(values):
      # The halves are exact: the sum of the replicas' own gradients, halved.
      if step < 2:
        _assert_bits(value, _float32_sum(k) / 2)
      else:
        half = HALF[compressor]
        _assert_bits(value, ((_grads(0)[k] / 2).astype(half) + (_grads(1)[k] / 2).astype(half))
                     .astype(half).astype(np.float32))


@pytest.mark.slow  # the update exchange under MirroredStrategy, traced and compiled
def test_the_default_update_exchange_applies_the_mean_float32_update_during_warm_up():
  """The default exchange ("updates"): each replica steps SGD on its own mean gradient
  (its gradient times 2) and the replicas' updates are exchanged; a warm-up step applies
  their float32 mean, bit for bit, and a later one the mean of the fp16 updates."""
  applied = _apply(lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.SGD(1.0), "fp16", start_step=1), 2)
  for step, values in enumerate(applied):
    for k, value in enumerate(values):
      # Updates -g_r (SGD at rate 1 from zeros); their mean, negated by _apply.
      if step == 0:
        _assert_bits(value, _float32_sum(k) / 2)
      else:
        _assert_bits(value, (_grads(0)[k].astype(np.float16) + _grads(1)[k].astype(np.float16))
                     .astype(np.float16).astype(np.float32) / 2)


@pytest.mark.slow  # CompressedAllReduce: the same engine, local_exchange's copies
def test_compressed_all_reduce_sums_fp16_as_float32_during_warm_up():
  strategy = tf_adacomp.distribute.mirrored_strategy(
      devices=DEVICES, cross_device_ops=tf_adacomp.CompressedAllReduce("fp16", start_step=1))
  grads = [np.stack([_grads(r)[k] for r in range(2)]) for k in range(len(SHAPES))]

  @tf.function
  def step():
    def replica_fn():
      ctx = tf.distribute.get_replica_context()
      return ctx.all_reduce(tf.distribute.ReduceOp.SUM, [
          tf.gather(tf.constant(g), ctx.replica_id_in_sync_group) for g in grads])
    return strategy.run(replica_fn)

  for reduction in range(2):  # counted per tensor: the first reduction is the warm-up
    for k, total in enumerate(step()):
      for local in strategy.experimental_local_results(total):
        _assert_bits(local.numpy(), _float32_sum(k) if reduction == 0
                     else _half_sum(k, "fp16"))


def test_narrow_summable_plans_are_the_half_precision_ones():
  assert exchange._narrow_on_the_wire(tf_adacomp.get_compressor("fp16"),  # pylint: disable=protected-access
                                      tf_adacomp.get_compressor("fp16").plan([8], tf.float32))
  assert not exchange._narrow_on_the_wire(tf_adacomp.get_compressor("fp16"),  # pylint: disable=protected-access
                                          tf_adacomp.get_compressor("fp16").plan([0], tf.float32))
  none = tf_adacomp.get_compressor("none")
  assert not exchange._narrow_on_the_wire(none, none.plan([8], tf.float32))  # pylint: disable=protected-access
  assert exchange._narrow_on_the_wire(none, none.plan([8], tf.float16))  # pylint: disable=protected-access
  adacomp = tf_adacomp.AdaComp()
  assert not exchange._narrow_on_the_wire(adacomp, adacomp.plan([8], tf.float32))  # pylint: disable=protected-access
  assert not exchange._narrow_on_the_wire(adacomp, adacomp.plan([8000], tf.float16))  # pylint: disable=protected-access


def test_an_exchanges_buckets_are_decided_once_from_the_plans():
  """``warm_up.buckets``: the compressor's buckets of the present compact gradients, and
  the warm-up bucket of the narrow summable ones (only with a warm-up), which
  ``Exchange.compress`` fills and the hierarchy's idle devices rebuild alike."""
  from tf_adacomp.exchange import warm_up  # pylint: disable=g-import-not-at-top
  adacomp = tf_adacomp.AdaComp(min_size=100)
  plans = [adacomp.plan([4000], tf.float32), adacomp.plan([8], tf.float16),
           adacomp.plan([3000], tf.float32), adacomp.plan([8], tf.float32),
           adacomp.plan([5000], tf.float32)]
  grouped = [tuple([0, 2, 4][j] for j in group)
             for group in adacomp.buckets([plans[i] for i in (0, 2, 4)])]
  warm_flag = tf.constant(True)
  assert warm_up.buckets(adacomp, plans, [0, 1, 2, 3, 4], warm_flag) == (grouped, (1,))
  assert warm_up.buckets(adacomp, plans, [0, 1, 2, 3, 4], None) == (grouped, ())
  # A gradient that is None this step is in no bucket.
  assert warm_up.buckets(adacomp, plans, [0, 3], warm_flag) == ([(0,)], ())
