"""mixed_float16: an overflow on any one replica lowers the loss scale and skips the step
everywhere (Keras' LossScaleOptimizer around CompressedOptimizer, MirroredStrategy on
logical CPUs)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp.compat import loss_scale
from tf_adacomp.compat import patches
import tiers

DEVICES = ["/cpu:0", "/cpu:1"]
EXCHANGES = ("updates", "gradients")
INITIAL_SCALE = 2.0**10
# Cast to float16 by the first layer, this is inf (float16's largest finite value is 65504).
OVERFLOWING_INPUT = 1e5


@pytest.fixture
def mixed_float16():
  """The global policy "mixed_float16" for the test; the previous policy afterwards."""
  previous = keras.mixed_precision.global_policy()
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    yield
  finally:
    keras.mixed_precision.set_global_policy(previous)


def _compressed(exchange):
  # Kernels compressed, biases dense (fewer XLA compilations on 2 cores); momentum so
  # that the inner optimizer has slots to keep.
  return tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                        tf_adacomp.AdaComp(min_size=100), exchange=exchange)


def _model():
  keras.utils.set_random_seed(0)
  return keras.Sequential([keras.Input([16]), keras.layers.Dense(16, activation="relu"),
                           keras.layers.Dense(8)])


def _data(rows, overflowing=()):
  """``rows`` inputs and targets; the inputs of the rows in ``overflowing`` overflow."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(rows, 16)).astype("float32")
  y = rng.normal(size=(rows, 8)).astype("float32")
  x[list(overflowing)] = OVERFLOWING_INPUT
  return x, y


def _local(strategy, variable):
  """The value of every replica's copy of a Keras (or tf) variable, as NumPy arrays."""
  variable = variable.value if isinstance(variable, keras.Variable) else variable
  return [np.array(c.numpy()) for c in strategy.experimental_local_results(variable)]


def _state(strategy, model, optimizer):
  """Every replica's weights, residues, inner slots and loss-scale variables."""
  inner = optimizer.inner_optimizer  # the CompressedOptimizer
  named = ([("weight " + v.path, v) for v in model.trainable_variables]
           + [(f"residue {i}.{j}", r) for i, state in enumerate(inner.residues)
              for j, r in enumerate(state)]
           + [("inner " + v.path, v) for v in inner.inner_optimizer.variables]
           + [("dynamic_scale", optimizer.dynamic_scale),
              ("step_counter", optimizer.step_counter)])
  return {name: _local(strategy, v) for name, v in named}


def _assert_replicas_identical(state, names):
  for name in names:
    first, *others = state[name]
    for other in others:
      np.testing.assert_array_equal(first, other, err_msg=f"{name} differs across replicas")


def _train_step(strategy, model, optimizer):
  """One step as Keras' TensorFlow trainer takes it: scale the loss, apply in replicas."""

  @tf.function
  def step(x, y):
    def replica_fn(x, y):
      with tf.GradientTape() as tape:
        prediction = tf.cast(model(x, training=True), "float32")
        loss = tf.reduce_mean(tf.square(prediction - y)) / strategy.num_replicas_in_sync
        scaled = optimizer.scale_loss(loss)
      grads = tape.gradient(scaled, model.trainable_variables)
      optimizer.apply(grads, model.trainable_variables)
    strategy.run(replica_fn, args=(x, y))

  def run(x, y):
    """``x``, ``y``: one array per replica."""
    def per_replica(values):
      return strategy.experimental_distribute_values_from_function(
          lambda context: tf.constant(values[context.replica_id_in_sync_group]))
    step(per_replica(x), per_replica(y))

  return run


# Pairwise with --full: each exchange and each overflowing replica. Slow (all four): the
# skip and the halved scale are
# test_without_a_strategy_an_overflow_lowers_the_scale_and_skips_the_step[updates]'s in the
# fast tier, every replica's same answer
# test_check_finite_gives_every_replica_the_same_answer_in_either_tf_path's.
@pytest.mark.parametrize("exchange, overflowing_replica", [
    tiers.slow("updates", 1), pytest.param("gradients", 0, marks=pytest.mark.slow),
    pytest.param("updates", 0, marks=pytest.mark.slow),
    pytest.param("gradients", 1, marks=pytest.mark.slow)])
def test_an_overflow_on_one_replica_lowers_the_scale_and_skips_the_step_on_every_replica(
    mixed_float16, exchange, overflowing_replica):
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES)
  with strategy.scope():
    model = _model()
    optimizer = keras.optimizers.LossScaleOptimizer(_compressed(exchange),
                                                    initial_scale=INITIAL_SCALE)
    optimizer.build(model.trainable_variables)
  step = _train_step(strategy, model, optimizer)
  x, y = _data(16)
  replicas = len(DEVICES)
  halves = lambda a: np.split(a, replicas)  # noqa: E731

  step(halves(x), halves(y))  # a normal step first: residues and momentum are not zero
  before = _state(strategy, model, optimizer)
  assert any(np.abs(r).sum() > 0 for name in before if name.startswith("residue")
             for r in before[name])
  iterations = int(optimizer.iterations.numpy())
  assert iterations == 1 and before["step_counter"] == [1] * replicas

  bad_x = halves(x)
  bad_x[overflowing_replica] = np.full_like(bad_x[overflowing_replica], OVERFLOWING_INPUT)
  step(bad_x, halves(y))
  after = _state(strategy, model, optimizer)
  # As Keras' LossScaleOptimizer on a non-finite step: the scale halves, its growth
  # counter restarts, the inner optimizer is not called (iterations stay).
  assert [float(s) for s in after["dynamic_scale"]] == [INITIAL_SCALE / 2] * replicas
  assert [int(s) for s in after["step_counter"]] == [0] * replicas
  assert int(optimizer.iterations.numpy()) == iterations
  for name, values in before.items():
    if name in ("dynamic_scale", "step_counter"):
      continue
    for replica, (a, b) in enumerate(zip(values, after[name])):
      np.testing.assert_array_equal(a, b, err_msg=f"{name} changed on replica {replica}")
  _assert_replicas_identical(after, [n for n in after if n.startswith("weight")]
                             + ["dynamic_scale", "step_counter"])

  step(halves(x), halves(y))  # and the next normal step goes through everywhere
  last = _state(strategy, model, optimizer)
  assert int(optimizer.iterations.numpy()) == iterations + 1
  assert [float(s) for s in last["dynamic_scale"]] == [INITIAL_SCALE / 2] * replicas
  assert [int(s) for s in last["step_counter"]] == [1] * replicas
  weights = [n for n in last if n.startswith("weight")]
  _assert_replicas_identical(last, weights)
  assert all(np.all(np.isfinite(last[n][0])) for n in weights)
  assert any(not np.array_equal(after[n][0], last[n][0]) for n in weights)


# Slow: the same skip through model.fit; the fast tier checks it through model.fit
# without a strategy (test_without_a_strategy_an_overflow_lowers_the_scale_and_skips_the_step)
# and the replicas' one answer in test_check_finite_gives_every_replica_the_same_answer_in_
# either_tf_path.
@pytest.mark.slow
def test_model_fit_under_mixed_float16_skips_a_batch_that_overflows_on_replica_1_only(
    mixed_float16):
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES)
  with strategy.scope():
    model = _model()
    model.compile(_compressed("updates"), "mse")
  assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
  scale = float(model.optimizer.initial_scale)
  # One global batch of 16 rows: MirroredStrategy gives rows 0-7 to replica 0 and rows
  # 8-15 to replica 1, whose inputs overflow in float16.
  x, y = _data(16, overflowing=range(8, 16))
  model.build((None, 16))
  weights = model.get_weights()
  model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
  assert int(model.optimizer.iterations.numpy()) == 0
  _assert_replicas_identical(_state(strategy, model, model.optimizer),
                             ["dynamic_scale", "step_counter"])
  assert float(model.optimizer.dynamic_scale.numpy()) == scale / 2
  for a, b in zip(weights, model.get_weights()):
    np.testing.assert_array_equal(a, b)

  x, y = _data(16)
  model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
  assert int(model.optimizer.iterations.numpy()) == 1
  assert float(model.optimizer.dynamic_scale.numpy()) == scale / 2
  assert any(not np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))


# "updates" in the fast tier: the loss scale's skip comes before either exchange
# ("gradients" with --full).
@pytest.mark.parametrize("exchange", [EXCHANGES[0], tiers.slow(EXCHANGES[1])])
def test_without_a_strategy_an_overflow_lowers_the_scale_and_skips_the_step(
    mixed_float16, exchange):
  model = _model()
  optimizer = keras.optimizers.LossScaleOptimizer(_compressed(exchange),
                                                  initial_scale=INITIAL_SCALE)
  model.compile(optimizer, "mse")
  x, y = _data(8, overflowing=[3])
  model.build((None, 16))
  weights = model.get_weights()
  model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
  assert float(optimizer.dynamic_scale.numpy()) == INITIAL_SCALE / 2
  assert int(optimizer.iterations.numpy()) == 0
  for a, b in zip(weights, model.get_weights()):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("merge_call", [True, False], ids=["merge_call", "no_merge_call"])
def test_check_finite_gives_every_replica_the_same_answer_in_either_tf_path(merge_call):
  """MirroredStrategy on CPUs takes the merge-call path; TensorFlow takes the other only
  for XLA on GPUs, forced here on this instance so that its all-reduce runs on CPUs."""
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES)
  if not merge_call:
    strategy.extended._use_merge_call = lambda: False  # pylint: disable=protected-access
  with strategy.scope():
    optimizer = keras.optimizers.LossScaleOptimizer(_compressed("updates"))

  @tf.function
  def flags(bad_replica):
    def replica_fn():
      supports_no_merge_call = tf.__internal__.distribute.strategy_supports_no_merge_call()
      assert supports_no_merge_call != merge_call
      bad = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group,
                     bad_replica)
      grads = [tf.ones([3]), tf.where(bad, np.inf, 1.0) * tf.ones([2, 2])]
      return optimizer.check_finite(grads)
    return strategy.run(replica_fn)

  for bad_replica, expected in ((1, False), (0, False), (-1, True)):
    answers = [bool(f) for f in strategy.experimental_local_results(flags(bad_replica))]
    assert answers == [expected] * len(DEVICES), (bad_replica, answers)


# --- Other optimizers keep Keras' check (canaries of the Keras code: tests/compat) -----

def test_the_fix_is_installed_once_by_compressed_optimizer_and_keeps_other_optimizers():
  _compressed("updates")
  _compressed("gradients")
  cls = keras.optimizers.LossScaleOptimizer
  assert loss_scale.loss_scale_fix_applied()
  assert getattr(cls.check_finite, patches.MARK) == loss_scale.CHECK_FINITE
  assert getattr(cls.check_finite, "__wrapped__") is loss_scale.original_check_finite()
  # Any other inner optimizer: Keras' own check, no collective (one replica's own flag).
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES)
  with strategy.scope():
    plain = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    variable = keras.Variable([1.0, 2.0])
    plain.build([variable])

  @tf.function
  def flags():
    def replica_fn():
      bad = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 1)
      return plain.check_finite([tf.where(bad, np.inf, 1.0) * tf.ones([2])])
    return strategy.run(replica_fn)

  assert [bool(f) for f in strategy.experimental_local_results(flags())] == [True, False]
