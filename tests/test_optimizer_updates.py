"""CompressedOptimizer's update exchange, momentum masking and local clipping.

Exact checks against NumPy: each replica's own mean gradient is taken eagerly on its
shard; the replicas' local optimizer steps (SGD with momentum,
Adam), their residues, TopK's selection, the masking and the clipping are redone in
NumPy, and the weights every replica holds after a few steps are compared.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from replica_harness import (DEVICES, PER_REPLICA, assert_replicas_hold, data, fit,
                             linear_model, np_topk, own_mean_gradients, replica_values,
                             replica_weights, shards)
from tf_adacomp import optimizer as optimizer_module
from tf_adacomp.steps import momentum_masking as masking_module
from tf_adacomp import replica_steps
import tiers

LR, MOMENTUM = 0.05, 0.9
# A large epsilon: Adam's first step is +-learning_rate on every element otherwise, and
# TopK's choice among equal magnitudes is arbitrary.
ADAM = dict(learning_rate=0.01, beta_1=0.9, beta_2=0.999, epsilon=0.1)


# --- NumPy references ---------------------------------------------------------------


class NumpySGD:
  """Keras' SGD (momentum, not Nesterov) on one replica's own state."""

  def __init__(self, weights, lr=LR, momentum=MOMENTUM):
    self.lr, self.momentum = lr, momentum
    self.moments = [np.zeros_like(w, np.float64) for w in weights]

  def step(self, weights, grads, step):
    del step
    out = []
    for v, (w, g) in enumerate(zip(weights, grads)):
      self.moments[v] = self.momentum * self.moments[v] - self.lr * g
      out.append((w + self.moments[v]).astype(np.float32))
    return out


class NumpyAdam:
  """Keras' Adam on one replica's own state (``moments`` is the first moment)."""

  def __init__(self, weights, learning_rate, beta_1, beta_2, epsilon):
    self.lr, self.b1, self.b2, self.eps = learning_rate, beta_1, beta_2, epsilon
    self.moments = [np.zeros_like(w, np.float64) for w in weights]
    self.velocities = [np.zeros_like(w, np.float64) for w in weights]

  def step(self, weights, grads, step):
    t = step + 1
    alpha = self.lr * math.sqrt(1 - self.b2 ** t) / (1 - self.b1 ** t)
    out = []
    for v, (w, g) in enumerate(zip(weights, grads)):
      self.moments[v] += (g - self.moments[v]) * (1 - self.b1)
      self.velocities[v] += (g * g - self.velocities[v]) * (1 - self.b2)
      out.append((w - alpha * self.moments[v] / (np.sqrt(self.velocities[v]) + self.eps))
                 .astype(np.float32))
    return out


def np_clip(grads, clipnorm):
  norm = math.sqrt(sum(float(np.sum(np.square(g.astype(np.float64)))) for g in grads))
  scale = min(1.0, clipnorm / norm)
  return [g * scale for g in grads], scale < 1


def reference_updates(start, replicas, steps, make_local, density=None, masking=False,
                      clipnorm=None):
  """Weights after the update exchange (mean of TopK-compressed local updates)."""
  weights = [w.astype(np.float32) for w in start]
  local = [make_local(weights) for _ in range(replicas)]
  residues = [[np.zeros_like(w) for w in weights] for _ in range(replicas)]
  clipped = []
  for step in range(steps):
    total = [np.zeros_like(w) for w in weights]
    for r, (xs, ys) in enumerate(shards(replicas, step, steps)):
      grads = own_mean_gradients(weights, xs, ys)
      if clipnorm is not None:
        grads, was_clipped = np_clip(grads, clipnorm)
        clipped.append(was_clipped)
      after = local[r].step(weights, grads, step)
      for v, (w, a) in enumerate(zip(weights, after)):
        delta = a - w  # float32, as the optimizer computes it
        if density is None:
          total[v] += delta
          continue
        held = residues[r][v] + delta
        values, residues[r][v], sent = np_topk(held, density)
        total[v] += values
        if masking:
          local[r].moments[v][sent] = 0.0
    weights = [w + t / np.float32(replicas) for w, t in zip(weights, total)]
  return weights, residues, local, clipped


# --- The update exchange ------------------------------------------------------------


def _uncompressed_updates():
  return tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(LR, momentum=MOMENTUM), "none",
                                        exchange="updates")


@pytest.fixture(scope="module")
def uncompressed_fit():
  """The update exchange without compression, 3 replicas, 2 steps: shared by the tests
  that inspect it. ``(replicas, steps, start weights, model, strategy)``."""
  replicas, steps = 3, 2
  return (replicas, steps, *fit(_uncompressed_updates, replicas, steps))


def test_update_exchange_without_compression_is_the_mean_of_local_momentum_steps(
    uncompressed_fit):
  replicas, steps, start, model, strategy = uncompressed_fit
  expected, _, local, _ = reference_updates(start, replicas, steps, NumpySGD)
  assert_replicas_hold(model, strategy, expected)
  assert int(model.optimizer.iterations.numpy()) == steps
  # Each replica keeps its own velocity (the slots' copies differ on purpose).
  kernel_velocity = replica_values(model.optimizer.inner_optimizer.momentums[0], strategy)
  for r in range(replicas):
    np.testing.assert_allclose(kernel_velocity[r], local[r].moments[0], rtol=1e-5, atol=1e-6)
  assert not np.allclose(kernel_velocity[0], kernel_velocity[1])


def test_update_exchange_checkpoints_the_mean_of_the_replicas_slots(tmp_path,
                                                                    uncompressed_fit):
  # Each replica's velocity is its own (on-read): a checkpoint must store their mean, and
  # a restore (here without a strategy, one replica) must read that mean, not replica
  # 0's copy.
  replicas, steps, start, model, strategy = uncompressed_fit
  make = _uncompressed_updates
  _, _, local, _ = reference_updates(start, replicas, steps, NumpySGD)
  mean = [np.mean([local[r].moments[v] for r in range(replicas)], axis=0)
          for v in range(len(start))]
  saved = tf.train.Checkpoint(optimizer=model.optimizer).save(str(tmp_path / "ckpt"))

  restored_model = linear_model()
  restored = make()
  restored_model.compile(optimizer=restored, loss="mse")
  restored.build(restored_model.trainable_variables)
  tf.train.Checkpoint(optimizer=restored).restore(saved)
  for v, velocity in enumerate(restored.inner_optimizer.momentums):
    np.testing.assert_allclose(velocity.numpy(), mean[v], rtol=1e-5, atol=1e-6)
  del strategy


@pytest.mark.parametrize("inner,masking", [  # the fast tier: Adam with masking
    pytest.param("sgd", False, marks=pytest.mark.slow),
    pytest.param("sgd", True, marks=pytest.mark.slow), ("adam", True)])
def test_update_exchange_compresses_local_updates_with_error_feedback(inner, masking):
  replicas, steps, density = 2, 3, 0.2
  if inner == "sgd":
    make_inner, make_local = (lambda: keras.optimizers.SGD(LR, momentum=MOMENTUM)), NumpySGD
  else:
    make_inner = lambda: keras.optimizers.Adam(**ADAM)  # noqa: E731
    make_local = lambda w: NumpyAdam(w, **ADAM)  # noqa: E731
  start, model, strategy = fit(lambda: tf_adacomp.CompressedOptimizer(
      make_inner(), tf_adacomp.TopK(density), exchange="updates", momentum_masking=masking),
      replicas, steps)
  expected, residues, local, _ = reference_updates(start, replicas, steps, make_local,
                                                   density=density, masking=masking)
  assert_replicas_hold(model, strategy, expected)
  optimizer = model.optimizer
  for v in range(len(expected)):
    copies = replica_values(optimizer.residues[v][0], strategy)
    for r in range(replicas):
      np.testing.assert_allclose(copies[r], residues[r][v], rtol=1e-4, atol=1e-6)
  slots = masking_module.first_moment_slots(optimizer.inner_optimizer)  # pylint: disable=protected-access
  for v in range(len(expected)):
    copies = replica_values(slots[v], strategy)
    for r in range(replicas):
      np.testing.assert_allclose(copies[r], local[r].moments[v], rtol=1e-4, atol=1e-6)
      if masking:  # what the last step sent has no momentum left
        assert np.sum(copies[r] == 0) >= math.ceil(density * copies[r].size)


# "gradients" in the fast tier: the clipping happens before either exchange (updates
# with --full).
@pytest.mark.parametrize("exchange", ["gradients", tiers.slow("updates")])
def test_local_clipnorm_clips_each_replicas_own_gradient(exchange):
  replicas, steps, clipnorm = 2, 2, 4.0
  start, model, strategy = fit(lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.SGD(LR, momentum=MOMENTUM), "none", exchange=exchange,
      local_clipnorm=clipnorm), replicas, steps)
  if exchange == "updates":
    expected, _, _, clipped = reference_updates(start, replicas, steps, NumpySGD,
                                                clipnorm=clipnorm)
  else:  # the mean of the clipped own gradients, through one SGD with momentum
    weights = [w.astype(np.float32) for w in start]
    sgd, clipped = NumpySGD(weights), []
    for step in range(steps):
      mean = [np.zeros_like(w, np.float64) for w in weights]
      for xs, ys in shards(replicas, step, steps):
        grads, was_clipped = np_clip(own_mean_gradients(weights, xs, ys), clipnorm)
        clipped.append(was_clipped)
        mean = [m + g / replicas for m, g in zip(mean, grads)]
      weights = sgd.step(weights, mean, step)
    expected = weights
  assert any(clipped) and not all(clipped), clipped  # the threshold bites, not always
  assert_replicas_hold(model, strategy, expected)


# "slices" in the fast tier: its gradients are an IndexedSlices and a dense tensor ("dense",
# two dense tensors, with --full).
@pytest.mark.parametrize("kind", [tiers.slow("dense"), "slices"])
def test_local_clipnorm_is_keras_global_clipnorm_bit_for_bit(kind):
  """``replica_steps.clip_by_global_norm`` is Keras' ``global_clipnorm``, read off a
  Keras SGD with learning rate 1 from zero weights (its weights are minus its clipped
  gradient, exactly): ``c * min(1 / norm, 1 / c)``, not ``min(1, c / norm)`` (an ulp
  apart), and an IndexedSlices' norm from its slices' squares, the result dense."""
  rng = np.random.default_rng(0)
  for _ in range(50):
    clipnorm = float(rng.uniform(0.05, 3.0))
    dense = tf.constant(rng.standard_normal([4, 3]).astype(np.float32))
    if kind == "slices":  # duplicate rows: their slices, not their sum, enter the norm
      first = tf.IndexedSlices(tf.constant(rng.standard_normal([7, 2]).astype(np.float32)),
                               tf.constant([0, 0, 2, 2, 2, 4, 1]), tf.constant([5, 2]))
    else:
      first = tf.constant(rng.standard_normal([5, 2]).astype(np.float32))
    grads = [first, dense]
    variables = [keras.Variable(np.zeros([5, 2], np.float32)),
                 keras.Variable(np.zeros([4, 3], np.float32))]
    keras.optimizers.SGD(1.0, global_clipnorm=clipnorm).apply(grads, variables)
    ours = replica_steps.clip_by_global_norm(grads, clipnorm)
    for clipped, variable in zip(ours, variables):
      assert isinstance(clipped, tf.Tensor)
      np.testing.assert_array_equal(-clipped.numpy(), variable.numpy(),
                                    err_msg=f"clipnorm={clipnorm}")


def _embedding_fit(optimizer, replicas, steps=4, mixed=False):
  """``model.fit`` of an Embedding whose every row repeats its first token (IndexedSlices
  gradients with duplicate rows) under a ``replicas``-device MirroredStrategy."""
  rng = np.random.default_rng(5)
  tokens = rng.integers(0, 12, size=(8 * steps, 6)).astype(np.int32)
  tokens[:, 1] = tokens[:, 0]
  targets = rng.standard_normal([8 * steps, 3]).astype(np.float32)
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES[:replicas])
  previous = keras.config.dtype_policy()
  if mixed:
    keras.config.set_dtype_policy("mixed_float16")
  try:
    with strategy.scope():
      keras.utils.set_random_seed(0)
      model = keras.Sequential([keras.Input([6], dtype="int32"), keras.layers.Embedding(12, 4),
                                keras.layers.Flatten(), keras.layers.Dense(3)])
      model.compile(optimizer=optimizer(), loss="mse")
    model.fit(tokens, targets, batch_size=8, epochs=1, verbose=0, shuffle=False)
  finally:
    keras.config.set_dtype_policy(previous)
  return model.get_weights()


_INNER = {"sgd": lambda **kw: keras.optimizers.SGD(LR, momentum=MOMENTUM, **kw),
          "adam": lambda **kw: keras.optimizers.Adam(0.01, **kw)}


# Slow (all six): one replica on an embedding is the inner optimizer bit for bit in
# tests/conformance/test_oracle.py's fast tier, with the update exchange in
# test_one_replica_is_keras_bit_for_bit[inner=adam,mixed,model=embedding], with the gradient
# exchange and local_clipnorm=0.5 in test_trains_as_its_reference[inner=adam,
# exchange=gradients,second_moment=local,no_strategy,...,local_clipnorm=0.5,...,
# model=embedding,...]; local_clipnorm on an IndexedSlices is Keras' global_clipnorm in
# test_local_clipnorm_is_keras_global_clipnorm_bit_for_bit[slices].
@pytest.mark.parametrize("exchange,inner,clipnorm", [
    tiers.slow("gradients", "adam", None), tiers.slow("updates", "sgd", 0.5),
    pytest.param("updates", "sgd", None, marks=pytest.mark.slow),
    pytest.param("gradients", "sgd", None, marks=pytest.mark.slow),
    pytest.param("updates", "adam", None, marks=pytest.mark.slow),
    pytest.param("gradients", "adam", 0.5, marks=pytest.mark.slow)])
def test_one_replica_on_an_embedding_is_the_inner_optimizer_bit_for_bit(exchange, inner,
                                                                          clipnorm):
  """One replica, "none": the inner optimizer steps on the Embedding's IndexedSlices as
  Keras does (Adam adds the slices' squares to its second moment: the square of the
  summed rows is 1e-2 off; SGD's sparse update rounds otherwise than a dense one), and
  ``local_clipnorm=c`` is ``global_clipnorm=c``, bit for bit."""
  clip = {} if clipnorm is None else {"global_clipnorm": clipnorm}
  plain = _embedding_fit(lambda: _INNER[inner](**clip), 1)
  wrapped = _embedding_fit(lambda: tf_adacomp.CompressedOptimizer(
      _INNER[inner](), "none", exchange=exchange, second_moment="local" if inner == "adam"
      else None, local_clipnorm=clipnorm), 1)
  for a, b in zip(plain, wrapped):
    np.testing.assert_array_equal(a, b)


def test_gradient_exchange_of_an_embedding_is_keras_on_two_replicas():
  """Two replicas, "none", Adam: the replicas' IndexedSlices go joined, as Keras' own
  all-reduce sends them, and Adam adds every slice's square (the dense sum's square is
  1e-2 off after 4 steps); within float rounding of Keras under the same strategy."""
  plain = _embedding_fit(lambda: keras.optimizers.Adam(0.01), 2)
  wrapped = _embedding_fit(lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.Adam(0.01), "none", exchange="gradients"), 2)
  for a, b in zip(plain, wrapped):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)


# Slow: the same exchange as test_gradient_exchange_of_an_embedding_is_keras_on_two_replicas;
# mixed float16 is test_optimizer_mixed_precision.py's in the fast tier.
@pytest.mark.slow
def test_gradient_exchange_of_an_embedding_under_mixed_float16_is_keras():
  """LossScaleOptimizer's unscaled IndexedSlices have no static shape: the gradient
  exchange takes them (a TypeError in the joined all-reduce before), and one replica is
  Keras bit for bit."""
  plain = _embedding_fit(lambda: keras.optimizers.Adam(0.01), 1, mixed=True)
  wrapped = _embedding_fit(lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.Adam(0.01), "none", exchange="gradients"), 1, mixed=True)
  for a, b in zip(plain, wrapped):
    np.testing.assert_array_equal(a, b)


def test_update_exchange_skips_a_step_with_a_non_finite_gradient_on_one_replica():
  replicas = 2
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES[:replicas])
  x, y = data(replicas, 1)
  x[0, 0] = np.inf  # replica 0's shard only
  with strategy.scope():
    model = linear_model()
    model.compile(optimizer=tf_adacomp.CompressedOptimizer(
        keras.optimizers.SGD(LR, momentum=MOMENTUM), tf_adacomp.TopK(0.2),
        exchange="updates", momentum_masking=True, local_clipnorm=1.0), loss="mse")
  start = model.get_weights()
  model.fit(x, y, batch_size=replicas * PER_REPLICA, verbose=0, shuffle=False)
  for before, copies in zip(start, replica_weights(model, strategy)):
    for copy in copies:
      np.testing.assert_array_equal(copy, before)
  for state in model.optimizer.residues:
    for variable in state:
      assert not any(np.any(c) for c in replica_values(variable, strategy))
  for slot in model.optimizer.inner_optimizer.momentums:
    assert not any(np.any(c) for c in replica_values(slot, strategy))


# Slow: one replica, update exchange:
# test_one_replica_on_an_embedding_is_the_inner_optimizer_bit_for_bit[updates-sgd-0.5] in the fast
# tier.
@pytest.mark.slow
def test_one_replica_update_exchange_is_the_plain_optimizer():
  x, y = data(1, 3)
  results = []
  for optimizer in (keras.optimizers.Adam(**ADAM),
                    tf_adacomp.CompressedOptimizer(keras.optimizers.Adam(**ADAM), "none",
                                                   exchange="updates")):
    model = linear_model()
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=PER_REPLICA, verbose=0, shuffle=False)
    results.append(model.get_weights())
  for a, b in zip(*results):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # fast tier: an Embedding on one replica in tests/test_shared_moment.py
def test_update_exchange_trains_an_embedding_under_mirrored_strategy():
  """An Embedding's gradient is IndexedSlices: the default (update) exchange takes it."""
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES[:2])
  tokens = np.random.default_rng(0).integers(0, 20, size=(16, 4)).astype(np.int32)
  labels = (tokens.sum(axis=1) % 2).astype(np.int32)
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input([4], dtype="int32"), keras.layers.Embedding(20, 8),
                              keras.layers.Flatten(), keras.layers.Dense(2)])
    model.compile(optimizer=tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  before = model.get_weights()[0].copy()
  history = model.fit(tokens, labels, batch_size=8, epochs=1, verbose=0, shuffle=False)
  assert np.isfinite(history.history["loss"]).all()
  assert model.optimizer.exchange == "updates"
  assert not np.array_equal(before, model.get_weights()[0])  # the embedding trained


# --- Keras internals, configuration, arguments --------------------------------------


@pytest.mark.parametrize("make", [
    lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    lambda: keras.optimizers.Adam(0.1),
    lambda: keras.optimizers.AdamW(0.1),
])
def test_keras_momentum_slots_are_where_masking_reads_them(make):
  """Fails if Keras moves SGD's ``momentums`` or Adam's ``_momentums`` (masking reads
  them through ``steps.momentum_masking.first_moment_slots`` only)."""
  inner = make()
  variables = [keras.Variable(np.ones([3, 2], np.float32)), keras.Variable(np.ones([2], np.float32))]
  inner.build(variables)
  slots = masking_module.first_moment_slots(inner)  # pylint: disable=protected-access
  assert [tuple(s.shape) for s in slots] == [(3, 2), (2,)]
  grads = [np.full([3, 2], 2.0, np.float32), np.full([2], 2.0, np.float32)]
  inner.apply(grads, variables)
  for slot in slots:  # the first moment after one step: -lr * g (SGD) or 0.1 * g (Adam)
    assert np.allclose(slot.numpy(), -0.2 if isinstance(inner, keras.optimizers.SGD) else 0.2)


def test_config_round_trip_and_the_adasum_mode_synonym():
  # The defaults: local-optimizer updates when summing, Adasum of gradients for Adasum.
  assert tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(LR)).exchange == "updates"
  assert tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(LR),
                                        reduction="adasum").exchange == "gradients"
  optimizer = tf_adacomp.CompressedOptimizer(
      keras.optimizers.Adam(0.01), tf_adacomp.TopK(0.05), exchange="updates",
      momentum_masking=True, local_clipnorm=2.5)
  restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
  assert (restored.exchange, restored.momentum_masking, restored.local_clipnorm) == (
      "updates", True, 2.5)
  assert restored.reduction == "sum" and restored.adasum_mode == "delta"
  delta = tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(LR), reduction="adasum",
                                         adasum_mode="delta")
  assert delta.exchange == "updates"
  restored = tf_adacomp.CompressedOptimizer.from_config(delta.get_config())
  assert (restored.reduction, restored.exchange, restored.adasum_mode) == (
      "adasum", "updates", "delta")
  gradient = tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(LR), reduction="adasum",
                                            adasum_mode="gradient")
  assert gradient.exchange == "gradients"
  # A configuration saved before `exchange` existed keeps the exchange it ran with.
  old = {k: v for k, v in delta.get_config().items()
         if k not in ("exchange", "momentum_masking", "local_clipnorm")}
  assert tf_adacomp.CompressedOptimizer.from_config(old).exchange == "updates"
  old.update(reduction="sum")  # "delta" was silently ignored with "sum"
  assert tf_adacomp.CompressedOptimizer.from_config(old).exchange == "gradients"


@pytest.mark.parametrize("kwargs,match", [
    ({"exchange": "deltas"}, r"exchange='deltas'"),
    ({"adasum_mode": "delta"}, r"adasum_mode='delta', reduction='sum'"),
    ({"adasum_mode": "delta", "reduction": "adasum", "exchange": "gradients"},
     r"adasum_mode='delta', exchange='gradients'"),
    ({"adasum_mode": "gradient", "exchange": "updates"},
     r"adasum_mode='gradient', exchange='updates'"),
    ({"momentum_masking": 1}, r"momentum_masking=1"),
    ({"momentum_masking": True, "exchange": "gradients"},
     r"momentum_masking=True, exchange='gradients'"),
    ({"momentum_masking": True, "exchange": "updates",
      "inner_optimizer": keras.optimizers.SGD(0.1)}, r"momentum_masking=True, inner_optimizer="),
    ({"momentum_masking": True, "exchange": "updates",
      "inner_optimizer": keras.optimizers.RMSprop(0.1)}, r"momentum_masking=True, inner_opt"),
    ({"momentum_masking": True, "exchange": "updates", "compressor": "fp16"},
     r"momentum_masking=True, compressor="),
    ({"local_clipnorm": 0.0}, r"local_clipnorm=0.0"),
    ({"local_clipnorm": -1}, r"local_clipnorm=-1"),
    ({"local_clipnorm": float("inf")}, r"local_clipnorm=inf"),
    ({"local_clipnorm": "1"}, r"local_clipnorm='1'"),
    ({"local_clipnorm": True}, r"local_clipnorm=True"),
])
def test_bad_arguments_name_themselves(kwargs, match):
  kwargs = {"inner_optimizer": keras.optimizers.SGD(0.1, momentum=0.9), **kwargs}
  with pytest.raises(ValueError, match=match):
    tf_adacomp.CompressedOptimizer(**kwargs)
