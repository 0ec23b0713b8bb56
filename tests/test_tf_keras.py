"""tf_adacomp.tf_keras.CompressedOptimizer: the tf_keras (Keras 2) wrapper, both
exchanges, on one host (MirroredStrategy over the conftest's logical CPUs); on 2 worker
processes in tests/examples/test_horovod_migration.py."""

import warnings

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import digits_data
import tf_adacomp
from tf_adacomp import tf_keras as adacomp_tf_keras

OPTIMIZERS = {"new": tf_keras.optimizers.SGD, "legacy": tf_keras.optimizers.legacy.SGD}


def _strategy(replicas):
  return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])


def _mlp(strategy, optimizer_fn, seed=0):
  """A tf_keras 64-32-10 MLP compiled under ``strategy`` with ``optimizer_fn()``."""
  with strategy.scope():
    tf_keras.utils.set_random_seed(seed)
    model = tf_keras.Sequential([tf_keras.layers.Dense(32, activation="relu",
                                                       input_shape=(64,)),
                                 tf_keras.layers.Dense(10)])
    optimizer = optimizer_fn()
    model.compile(optimizer,
                  tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model, optimizer


def _fit(model, steps, batch=64):
  (x, y), _ = digits_data.flat()
  return model.fit(x[:steps * batch], y[:steps * batch], batch_size=batch, epochs=1,
                   shuffle=False, verbose=0).history["loss"]


def _replica_values(variable):
  return [v.numpy() for v in variable.values]


# The whole suite only: the fast tier's tf_keras oracle (tests/conformance/
# test_oracle_tf_keras.py) trains "none" against plain tf_keras on two replicas.
@pytest.mark.parametrize("kind, exchange", [
    pytest.param("new", "updates", marks=pytest.mark.slow),
    pytest.param("new", "gradients", marks=pytest.mark.slow),
    pytest.param("legacy", "gradients", marks=pytest.mark.slow)])
def test_no_compression_trains_like_the_plain_optimizer(kind, exchange):
  strategy = _strategy(4)
  plain, plain_optimizer = _mlp(strategy, lambda: OPTIMIZERS[kind](0.1, momentum=0.9))
  _fit(plain, 6)
  default = {"new": "updates", "legacy": "gradients"}[kind]
  model, optimizer = _mlp(strategy, lambda: adacomp_tf_keras.CompressedOptimizer(
      OPTIMIZERS[kind](0.1, momentum=0.9), compressor="none",
      exchange=None if exchange == default else exchange))
  assert optimizer.exchange == exchange
  _fit(model, 6)
  for expected, found in zip(plain.trainable_variables, model.trainable_variables):
    np.testing.assert_allclose(found.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
  assert int(optimizer.iterations.numpy()) == int(plain_optimizer.iterations.numpy()) == 6
  assert optimizer.compression_stats()["total"]["ratio"] == pytest.approx(1.0)


@pytest.mark.slow
def test_an_embeddings_sparse_gradient_is_exchanged_dense_as_the_plain_optimizer_applies_it():
  strategy = _strategy(2)
  tokens = np.random.default_rng(0).integers(0, 50, size=(128, 4))
  labels = tokens[:, 0] % 10
  weights = []
  for wrap in (False, True):
    with strategy.scope():
      tf_keras.utils.set_random_seed(0)
      model = tf_keras.Sequential([tf_keras.layers.Embedding(50, 8, input_length=4),
                                   tf_keras.layers.Flatten(), tf_keras.layers.Dense(10)])
      optimizer = tf_keras.optimizers.SGD(0.5)
      if wrap:
        optimizer = adacomp_tf_keras.CompressedOptimizer(optimizer, compressor="none")
      model.compile(optimizer,
                    tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(tokens, labels, batch_size=32, epochs=1, shuffle=False, verbose=0)
    weights.append([v.numpy() for v in model.trainable_variables])
  for expected, found in zip(*weights):
    np.testing.assert_allclose(found, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["updates", "gradients"])
def test_adacomp_compresses_keeps_residues_and_replicas_identical(exchange):
  model, optimizer = _mlp(_strategy(2), lambda: adacomp_tf_keras.CompressedOptimizer(
      tf_keras.optimizers.SGD(0.1, momentum=0.9), exchange=exchange))
  losses = [_fit(model, 8)[-1] for _ in range(2)]
  assert losses[-1] < losses[0], losses
  assert optimizer.compression_stats()["total"]["ratio"] > 20
  kernel_residue = optimizer.residues[0][0]
  per_replica = _replica_values(kernel_residue)
  assert all(np.abs(r).sum() > 0 for r in per_replica)  # each replica holds back its own
  assert not np.array_equal(per_replica[0], per_replica[1])
  for variable in model.trainable_variables:
    values = _replica_values(variable)
    for other in values[1:]:
      np.testing.assert_array_equal(other, values[0])
  momentum = optimizer.inner_optimizer.variables()[1]  # the first kernel's
  if exchange == "updates":  # each replica's own, stored as their mean
    own = _replica_values(momentum)
    assert not np.array_equal(own[0], own[1])
    np.testing.assert_allclose(momentum.numpy(), (own[0] + own[1]) / 2, rtol=1e-6)
  else:
    assert np.abs(momentum.numpy()).sum() > 0


@pytest.mark.parametrize("exchange", [
    "updates", pytest.param("gradients", marks=pytest.mark.slow)])  # fast tier: 3 minutes
def test_a_non_finite_gradient_on_one_replica_changes_nothing(exchange):
  strategy = _strategy(2)
  with strategy.scope():
    variable = tf.Variable([1.0, 2.0, 3.0, 4.0])
    optimizer = adacomp_tf_keras.CompressedOptimizer(
        tf_keras.optimizers.SGD(0.1, momentum=0.9), compressor=tf_adacomp.TopK(0.5),
        exchange=exchange)

  @tf.function
  def step(bad):
    def replica_step():
      replica = tf.distribute.get_replica_context().replica_id_in_sync_group
      grad = tf.constant([1.0, -3.0, 0.5, 2.0])
      poison = tf.logical_and(bad, tf.equal(replica, 1))
      optimizer.apply_gradients([(tf.where(poison, grad * np.inf, grad), variable)])
    strategy.run(replica_step)

  step(tf.constant(False))
  def state():
    return (variable.numpy(), [r.numpy() for r in optimizer.residues[0][0].values],
            [x.numpy() for v in optimizer.inner_optimizer.variables()
             for x in getattr(v, "values", [v])], int(optimizer.iterations.numpy()))

  before = state()
  step(tf.constant(True))
  after = state()
  np.testing.assert_array_equal(after[0], before[0])
  for a, b in zip(after[1] + after[2], before[1] + before[2]):
    np.testing.assert_array_equal(a, b)
  assert after[3] == before[3] == 1
  step(tf.constant(False))  # and the next finite step trains
  assert not np.array_equal(variable.numpy(), before[0])


@pytest.mark.slow
def test_warm_up_steps_are_the_dense_step_and_keep_residues_zero():
  strategy = _strategy(2)
  plain, _ = _mlp(strategy, lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9))
  _fit(plain, 3)
  model, optimizer = _mlp(strategy, lambda: adacomp_tf_keras.CompressedOptimizer(
      tf_keras.optimizers.SGD(0.1, momentum=0.9), start_step=3))
  _fit(model, 3)
  for expected, found in zip(plain.trainable_variables, model.trainable_variables):
    np.testing.assert_allclose(found.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
  assert all(not np.any(r.numpy()) for state in optimizer.residues for r in state)
  _fit(model, 1)  # step 4 compresses: the residues hold what was not sent
  assert any(np.any(r.numpy()) for state in optimizer.residues for r in state)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["new", "legacy"])
def test_residues_restore_from_a_checkpoint_onto_fewer_replicas(kind, tmp_path):
  def wrapped():
    return adacomp_tf_keras.CompressedOptimizer(OPTIMIZERS[kind](0.1, momentum=0.9))

  model, optimizer = _mlp(_strategy(4), wrapped)
  _fit(model, 5)
  totals = [sum(_replica_values(r[0])) for r in optimizer.residues]  # 4 replicas' sum
  assert all(np.abs(t).sum() > 0 for t in totals)
  path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "ckpt"))

  strategy = _strategy(2)
  restored_model, restored = _mlp(strategy, wrapped, seed=1)
  tf.train.Checkpoint(model=restored_model, optimizer=restored).restore(path)
  with strategy.scope():  # the residues are made after the restore: a deferred restore
    restored.build(restored_model.trainable_variables)
  for total, state in zip(totals, restored.residues):  # split evenly over 2 replicas
    for half in _replica_values(state[0]):
      np.testing.assert_allclose(half, total / 2, rtol=1e-5, atol=1e-6)
  assert int(restored.iterations.numpy()) == 5
  _fit(restored_model, 2)  # and training goes on from there
  assert int(restored.iterations.numpy()) == 7


@pytest.mark.parametrize("kind", ["new", "legacy"])
def test_the_config_round_trips(kind):
  optimizer = adacomp_tf_keras.CompressedOptimizer(
      OPTIMIZERS[kind](0.05, momentum=0.5), compressor=tf_adacomp.AdaComp(dense_bin_size=100),
      start_step=7, reduction="adasum", local_clipnorm=2.0, name="wrapped")
  config = optimizer.get_config()
  copy = tf_keras.optimizers.deserialize(
      tf_keras.optimizers.serialize(optimizer), use_legacy_optimizer=False)
  for again in (adacomp_tf_keras.CompressedOptimizer.from_config(config), copy):
    assert isinstance(again, adacomp_tf_keras.CompressedOptimizer)
    found = again.get_config()
    # tf_keras names the inner optimizer's class in lower case once deserialized.
    assert found["inner_optimizer"]["config"] == config["inner_optimizer"]["config"]
    assert {k: v for k, v in found.items() if k != "inner_optimizer"} == {
        k: v for k, v in config.items() if k != "inner_optimizer"}
    assert type(again.inner_optimizer) is type(optimizer.inner_optimizer)
    assert again.exchange == "gradients"  # Adasum's default, as in the Keras 3 wrapper
    assert again.compressor.dense_bin_size == 100
    assert float(again.learning_rate) == pytest.approx(0.05)


@pytest.mark.slow
def test_adasum_and_the_hierarchy_train_with_replicas_identical():
  for replicas, kwargs in ((2, {"reduction": "adasum"}),
                           (4, {"hierarchical": True, "devices_per_worker": 2})):
    model, optimizer = _mlp(_strategy(replicas), lambda: adacomp_tf_keras.CompressedOptimizer(
        tf_keras.optimizers.SGD(0.05), **kwargs))
    losses = [_fit(model, 6)[-1] for _ in range(2)]
    assert losses[-1] < losses[0], (kwargs, losses)
    assert (optimizer.hierarchy is not None) == ("hierarchical" in kwargs)
    assert optimizer.exchange == ("gradients" if "reduction" in kwargs else "updates")
    for variable in model.trainable_variables:
      values = _replica_values(variable)
      for other in values[1:]:
        np.testing.assert_array_equal(other, values[0])


# --- Bad input ------------------------------------------------------------------------

def test_a_keras_3_optimizer_is_refused_naming_the_wrapper_to_use():
  import keras  # pylint: disable=import-outside-toplevel
  with pytest.raises(TypeError, match=r"inner_optimizer.*tf_adacomp.CompressedOptimizer"):
    adacomp_tf_keras.CompressedOptimizer(keras.optimizers.SGD(0.1))


@pytest.mark.parametrize("kwargs, name", [
    ({"start_step": -1}, "start_step"),
    ({"reduction": "max"}, "reduction"),
    ({"local_clipnorm": 0.0}, "local_clipnorm"),
    ({"compressor": "nope"}, "nope"),
    ({"hierarchical": "yes"}, "hierarchical"),
    ({"devices_per_worker": 0}, "devices_per_worker"),
    ({"exchange": "weights"}, "exchange"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, name):
  with pytest.raises((TypeError, ValueError), match=name):
    adacomp_tf_keras.CompressedOptimizer(tf_keras.optimizers.SGD(0.1), **kwargs)


def test_a_legacy_optimizer_cannot_take_the_update_exchange():
  with pytest.raises(TypeError, match=r"exchange=\"updates\".*tf_keras.optimizers.SGD"):
    adacomp_tf_keras.CompressedOptimizer(tf_keras.optimizers.legacy.SGD(0.1),
                                         exchange="updates")


def test_a_loss_scale_optimizer_inside_or_around_is_refused():
  inner = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD(0.1))
  with pytest.raises(TypeError, match="LossScaleOptimizer"):
    adacomp_tf_keras.CompressedOptimizer(inner)
  wrapper = adacomp_tf_keras.CompressedOptimizer(tf_keras.optimizers.SGD(0.1))
  outer = tf_keras.mixed_precision.LossScaleOptimizer(wrapper)
  variable = tf.Variable([1.0, 2.0])
  with pytest.raises(ValueError, match="skip_gradients_aggregation=True"):
    outer.apply_gradients([(tf.ones([2]), variable)])
  np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])  # nothing was applied
  assert all(not np.any(r.numpy()) for state in wrapper.residues for r in state)
  assert int(wrapper.iterations.numpy()) == 0


def test_a_variable_the_optimizer_was_not_built_for_is_refused_naming_it():
  optimizer = adacomp_tf_keras.CompressedOptimizer(tf_keras.optimizers.SGD(0.1))
  known = tf.Variable([1.0, 2.0], name="known")
  optimizer.apply_gradients([(tf.ones([2]), known)])
  stranger = tf.Variable([3.0, 4.0], name="stranger")
  with pytest.raises(ValueError, match="stranger"):
    optimizer.apply_gradients([(tf.ones([2]), stranger)])
  np.testing.assert_array_equal(stranger.numpy(), [3.0, 4.0])


def test_from_config_without_the_inner_optimizer_is_refused_naming_the_key():
  with pytest.raises(ValueError, match="inner_optimizer"):
    adacomp_tf_keras.CompressedOptimizer.from_config({"compressor": "adacomp"})
  with pytest.raises(TypeError, match="config"):
    adacomp_tf_keras.CompressedOptimizer.from_config(["not", "a", "dict"])


@pytest.mark.slow
def test_a_tf_keras_model_trains_with_compressed_cross_device_ops_and_checkpoints_them(
    tmp_path):
  # The other way in on one host: the strategy's cross-device ops, a plain tf_keras
  # optimizer (tf_keras' own all-reduce goes through them).
  strategy = tf.distribute.MirroredStrategy(
      ["/cpu:0", "/cpu:1"], cross_device_ops=tf_adacomp.CompressedAllReduce("adacomp"))
  model, _ = _mlp(strategy, lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9))
  losses = [_fit(model, 8)[-1] for _ in range(2)]
  assert losses[-1] < losses[0], losses
  ops = tf_adacomp.CompressedAllReduce.of(strategy)
  assert ops.compression_stats()["total"]["ratio"] > 20
  path = tf.train.Checkpoint(model=model, residues=ops).save(str(tmp_path / "ckpt"))
  saved = [k for k, _ in tf.train.list_variables(path) if k.startswith("residues/")]
  assert saved, tf.train.list_variables(path)


# --- Workers that would train alone ----------------------------------------------------

@pytest.mark.parametrize("workers, where", [
    (2, "outside any strategy"), (2, "MirroredStrategy"), (None, "outside any strategy"),
    (1, "outside any strategy")])
def test_a_worker_of_several_training_alone_is_warned_once_a_single_one_not(
    monkeypatch, workers, where):
  # With TF_CONFIG naming several workers, an optimizer outside a multi-worker strategy
  # trains each worker alone (issue 42); one worker, or no TF_CONFIG, is no mistake.
  if workers is None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
  else:  # nothing listens there: no strategy here reads TF_CONFIG
    monkeypatch.setenv("TF_CONFIG", tf_adacomp.distribute.tf_config(
        [f"127.0.0.1:{20000 + i}" for i in range(workers)], 0))
  strategy = _strategy(2) if where == "MirroredStrategy" else tf.distribute.get_strategy()
  with warnings.catch_warnings(record=True) as caught:
    # Each one counted, not only the first per place.
    warnings.simplefilter("always", tf_adacomp.UnsynchronizedWorkersWarning)
    with strategy.scope():
      variable = tf.Variable(tf.zeros([4]))
      optimizer = adacomp_tf_keras.CompressedOptimizer(tf_keras.optimizers.SGD(0.1), "none")
      optimizer.build([variable])  # a build alone trains nothing: no warning yet
    built = [w for w in caught
             if issubclass(w.category, tf_adacomp.UnsynchronizedWorkersWarning)]
    assert not built, [str(w.message) for w in built]
    step = tf.function(lambda: strategy.run(
        lambda: optimizer.apply_gradients([(tf.ones([4]), variable)])), autograph=False)
    for _ in range(2):
      step()
  assert int(optimizer.iterations.numpy()) == 2
  found = [str(w.message) for w in caught
           if issubclass(w.category, tf_adacomp.UnsynchronizedWorkersWarning)]
  if workers != 2:
    assert found == []
    return
  assert len(found) == 1, found
  assert found[0].startswith(
      "TF_CONFIG names 2 workers (this process is its worker 0), but "
      "tf_adacomp.tf_keras.CompressedOptimizer is training under "), found[0]
  assert ("a MirroredStrategy of 2 replicas on this worker alone"
          if where == "MirroredStrategy" else "no tf.distribute strategy") in found[0]
  for fix in ("tf.distribute.MultiWorkerMirroredStrategy", "strategy.scope()",
              "model.compile", "global batch size", "unset TF_CONFIG"):
    assert fix in found[0], fix


def test_a_misspelt_keyword_is_refused_naming_the_closest_one():
  with pytest.raises(TypeError) as error:
    adacomp_tf_keras.CompressedOptimizer(tf_keras.optimizers.SGD(0.1), start_stpe=3)
  assert str(error.value) == (
      "CompressedOptimizer() got an unexpected keyword argument 'start_stpe' "
      "(Received: start_stpe=3). Did you mean 'start_step'?")
