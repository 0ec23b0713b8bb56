"""The shared second moment (tf_adacomp/shared_moment.py and CompressedOptimizer's
``second_moment="shared"``), against NumPy.

The schedule and the step are checked against plain-Python and NumPy references; the
optimizer is run under ``model.fit`` on 3 replicas whose data disagree, and every
replica's weights, moments and residues are compared with a NumPy replay of the
algorithm in shared_moment's docstring.
"""

import json
import math
import re
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tf_adacomp
import tiers
from tf_adacomp import optimizer as optimizer_module
from tf_adacomp import shared_moment
from adam_reference import np_global_moment
from replica_harness import (DEVICES, FEATURES, OUTPUTS, PER_REPLICA, assert_replicas_hold,
                             data, fit, linear_model, np_topk, own_mean_gradients,
                             replica_values, shards)

ADAM = dict(learning_rate=0.01, beta_1=0.9, beta_2=0.99, epsilon=1e-3)
# The replicas average their second moments in bfloat16 (0.4% on a moment, about 0.2% on
# a step), which the float64 references do not round: what depends on the shared moment
# is compared at these tolerances. A wrong bias correction or estimate is off by percents.
STEP_TOLERANCE = dict(rtol=1e-2, atol=1e-5)
MOMENT_TOLERANCE = dict(rtol=2e-2, atol=1e-9)


def py_sync_steps(steps, max_interval):
  """The sync steps among 1..steps, by the schedule's definition."""
  powers = {2 ** k for k in range(64) if 2 ** k <= steps}
  if max_interval is None:
    return sorted(powers)
  return sorted({p for p in powers if p < max_interval} |
                set(range(max_interval, steps + 1, max_interval)))


@settings(max_examples=tiers.examples(60), deadline=None)
@given(st.integers(1, 5000), st.one_of(st.none(), st.integers(1, 600)))
def test_schedule_matches_its_definition(step, max_interval):
  syncs = py_sync_steps(step, max_interval)
  assert bool(shared_moment.is_sync_step(step, max_interval)) == (step in syncs)


def test_schedule_is_logarithmic_without_a_cap():
  syncs = [t for t in range(1, 1025) if shared_moment.is_sync_step(t)]
  assert syncs == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
  assert bool(shared_moment.is_sync_step(2 ** 40)) and not shared_moment.is_sync_step(2 ** 40 + 4)


def np_adam_ratio(grads, b1, b2):
  """``|m| / sqrt(v)`` of Keras' Adam (no bias correction: it is in ``alpha``) after
  ``grads``, from zeros."""
  m = v = 0.0
  for g in grads:
    m, v = m + (g - m) * (1 - b1), v + (g * g - v) * (1 - b2)
  return abs(m) / math.sqrt(v)


@pytest.mark.parametrize("b1,b2", [(0.9, 0.999), (0.9, 0.99), (0.0, 0.999), (0.5, 0.9)])
def test_step_bound_is_adams_largest_step(b1, b2):
  bound = shared_moment.step_bound(1.0, b1, b2)
  rng = np.random.default_rng(0)
  for _ in range(20):  # random histories stay below it
    assert np_adam_ratio(rng.standard_normal(300) * rng.uniform(0.1, 10), b1, b2) <= bound
  # The gradient that grows by b2 / b1 a step (Cauchy-Schwarz's equality) comes within
  # 1% of it; an element first seen late has (1 - b1) / sqrt(1 - b2).
  growth = (b2 / b1) if b1 else 1e6
  history = [growth ** k for k in range(300 if b1 else 2)]
  assert np_adam_ratio(history, b1, b2) == pytest.approx(bound, rel=0.01)
  assert np_adam_ratio([0.0] * 500 + [1.0], b1, b2) <= bound


def test_step_is_keras_adams_step_when_the_moment_is_fresh():
  rng = np.random.default_rng(0)
  w, g = rng.standard_normal(6).astype(np.float32), rng.standard_normal(6).astype(np.float32)
  adam = keras.optimizers.Adam(**ADAM)
  variable = keras.Variable(w)
  adam.build([variable])
  adam.apply([g], [variable])
  m, v = shared_moment.local_moments(tf.zeros(6), tf.zeros(6), g, ADAM["beta_1"], ADAM["beta_2"])
  update = shared_moment.step(m, v, ADAM["learning_rate"], 1, 1, ADAM["beta_1"],
                              ADAM["beta_2"], ADAM["epsilon"])
  np.testing.assert_allclose(w + update.numpy(), variable.numpy(), rtol=1e-6, atol=1e-7)


def test_global_moment_recovers_the_mean_gradients_second_moment():
  # Replicas whose gradients are a fixed G plus white noise of variance S: the mean of R
  # has second moment G^2 + S / R, which the replicas' own v (G^2 + S) overstates.
  replicas, steps, b1, b2 = 4, 400, 0.9, 0.98
  rng = np.random.default_rng(0)
  signal = np.concatenate([np.zeros(2000), np.full(2000, 1.0), np.full(2000, 0.2)])
  noise = np.concatenate([np.full(2000, 1.0), np.zeros(2000), np.full(2000, 1.0)])
  m = v = w = [tf.zeros(signal.size, tf.float64)] * replicas
  for t in range(1, steps + 1):
    grads = signal + np.sqrt(noise) * rng.standard_normal([replicas, signal.size])
    pairs = [shared_moment.local_moments(m[r], v[r], grads[r], b1, b2) for r in range(replicas)]
    m, v = [p[0] for p in pairs], [p[1] for p in pairs]
    w = [shared_moment.local_momentum_square(w[r], m[r], t, b1, b2) for r in range(replicas)]
  correction = 1 - b2 ** steps
  mean_v, mean_w = (tf.add_n(x) / replicas / correction for x in (v, w))
  estimate = shared_moment.global_moment(mean_v, mean_w, replicas, b1).numpy()
  truth = signal ** 2 + noise / replicas
  for part in (slice(0, 2000), slice(2000, 4000), slice(4000, 6000)):
    assert abs(np.mean(estimate[part]) / np.mean(truth[part]) - 1) < 0.1, part
  assert np.mean(mean_v.numpy()[:2000]) > 3 * np.mean(truth[:2000])  # what "shared" uses


# --- CompressedOptimizer(second_moment="shared") under model.fit ------------------------


class NumpySharedAdam:
  """The algorithm of shared_moment's docstring for all replicas, in float64."""

  def __init__(self, weights, replicas, max_interval=None, weight_decay=None, decayed=None,
               mode="shared", **adam):
    self.lr, self.b1, self.b2, self.eps = (adam["learning_rate"], adam["beta_1"],
                                           adam["beta_2"], adam["epsilon"])
    self.replicas, self.max_interval, self.mode = replicas, max_interval, mode
    self.wd, self.decayed = weight_decay, decayed or []
    zeros = lambda: [np.zeros_like(w, np.float64) for w in weights]  # noqa: E731
    self.m = [zeros() for _ in range(replicas)]
    self.v = [zeros() for _ in range(replicas)]
    self.w = [zeros() for _ in range(replicas)]  # moving average of (m / (1 - b1^t))^2
    self.shared = zeros()
    self.synced_at, self.syncs = 0, []

  def updates(self, grads, t, divide=True):
    """Each replica's update at step ``t`` (1-based) from its own ``grads`` (without
    the division by ``self.divisors`` unless ``divide``)."""
    for r in range(self.replicas):
      for k, g in enumerate(grads[r]):
        self.m[r][k] += (g - self.m[r][k]) * (1 - self.b1)
        self.v[r][k] += (g * g - self.v[r][k]) * (1 - self.b2)
        m_hat = self.m[r][k] / (1 - self.b1 ** t)
        self.w[r][k] += (m_hat * m_hat - self.w[r][k]) * (1 - self.b2)
    scheduled = t in py_sync_steps(t, self.max_interval)
    if self.replicas == 1 or scheduled or self.synced_at == 0:
      self.synced_at = t
      self.syncs.append(t)
      for k in range(len(self.shared)):
        v = np.mean([self.v[r][k] for r in range(self.replicas)], axis=0)
        w = np.mean([self.w[r][k] for r in range(self.replicas)], axis=0)
        self.shared[k] = v if self.mode == "shared" else np_global_moment(
            v, w, self.replicas, self.b1)
        for r in range(self.replicas):
          self.v[r][k], self.w[r][k] = v.copy(), w.copy()
    alpha = self.lr * math.sqrt(1 - self.b2 ** self.synced_at) / (1 - self.b1 ** t)
    # Bounded only where the shared moment is older than this step.
    bound = shared_moment.step_bound(alpha, self.b1, self.b2)
    self.bound = np.float32(bound if self.synced_at != t else np.inf)
    self.divisors = [(np.sqrt(v) + self.eps).astype(np.float32) for v in self.shared]
    # "after" bounds the undivided step by bound * divisor: the same quotient.
    return [[self.clip(-alpha * m / d) if divide else self.clip(-alpha * m, d)
             for m, d in zip(self.m[r], self.divisors)] for r in range(self.replicas)]

  def clip(self, update, divisor=np.float32(1)):
    return np.clip(update.astype(np.float32), -self.bound * divisor, self.bound * divisor)

  def decay(self, weights):
    if not self.wd:
      return weights
    return [w - w * np.float32(self.wd * self.lr) if k in self.decayed else w
            for k, w in enumerate(weights)]


def reference(start, replicas, steps, density=None, precondition="before", **kwargs):
  weights = [w.astype(np.float32) for w in start]
  adam = NumpySharedAdam(weights, replicas, **kwargs, **ADAM)
  residues = [[np.zeros_like(w) for w in weights] for _ in range(replicas)]
  for step in range(steps):
    grads = [own_mean_gradients(weights, xs, ys) for xs, ys in shards(replicas, step, steps)]
    updates = adam.updates(grads, step + 1, divide=precondition == "before")
    total = [np.zeros_like(w) for w in weights]
    for r in range(replicas):
      for k, u in enumerate(updates[r]):
        if density is None:
          total[k] += u
        else:
          values, residues[r][k], _ = np_topk(residues[r][k] + u, density)
          total[k] += values
    mean = [t / np.float32(replicas) for t in total]
    if precondition == "after":  # the decoded mean, divided on arrival
      mean = [m / d for m, d in zip(mean, adam.divisors)]
    weights = [w + m for w, m in zip(adam.decay(weights), mean)]
  return weights, adam, residues


def _shared(inner=None, compressor="none", mode="shared", **kwargs):
  # The averages at steps 1, 2, 4, ... ("global" averages nothing by default).
  kwargs.setdefault("second_moment_interval", "doubling")
  return lambda: tf_adacomp.CompressedOptimizer(
      inner() if inner else keras.optimizers.Adam(**ADAM), compressor, exchange="updates",
      second_moment=mode, **kwargs)


# "shared" in the slow tier: "global" takes the same path, and more.
@pytest.fixture(scope="module", params=["global", pytest.param("shared", marks=pytest.mark.slow)])
def uncompressed(request):
  """3 replicas, 3 steps (averages at steps 1 and 2, not 3), no compression."""
  replicas, steps = 3, 3
  return (replicas, steps, request.param,
          *fit(_shared(mode=request.param), replicas, steps))


def test_without_compression_every_replica_takes_adams_step_on_the_mean_gradient(uncompressed):
  replicas, steps, mode, start, model, strategy = uncompressed
  expected, adam, _ = reference(start, replicas, steps, mode=mode)
  assert_replicas_hold(model, strategy, expected, **STEP_TOLERANCE)
  optimizer = model.optimizer
  assert int(optimizer.iterations.numpy()) == steps
  momentums, velocities = shared_moment.moment_slots(optimizer.inner_optimizer)
  for k in range(len(start)):
    np.testing.assert_allclose(replica_values(optimizer.shared_velocities[k], strategy),
                               [adam.shared[k]] * replicas, **MOMENT_TOLERANCE)
    for r, (m, v) in enumerate(zip(replica_values(momentums[k], strategy),
                                   replica_values(velocities[k], strategy))):
      np.testing.assert_allclose(m, adam.m[r][k], **STEP_TOLERANCE)
      np.testing.assert_allclose(v, adam.v[r][k], **MOMENT_TOLERANCE)
    if mode == "global":
      for r, w in enumerate(replica_values(optimizer.momentum_squares[k], strategy)):
        np.testing.assert_allclose(w, adam.w[r][k], **MOMENT_TOLERANCE)
  # Step 3 was not a sync step: the replicas' own second moments have moved apart.
  assert adam.syncs == [1, 2] and int(optimizer.moment_synced_at.numpy()) == 2
  assert not np.allclose(adam.v[0][0], adam.v[1][0])
  if mode == "global":  # the estimate is neither bound everywhere
    v = np.mean([adam.v[r][0] for r in range(replicas)], axis=0)
    assert np.any((adam.shared[0] < v) & (adam.shared[0] > v / replicas))


# "after" in the slow tier: the same bound, on the step before it is divided.
@pytest.mark.parametrize("precondition", ["before",
                                          pytest.param("after", marks=pytest.mark.slow)])
def test_an_element_first_seen_after_an_average_moves_no_further_than_adam_can(precondition):
  # Feature 0 is zero in the first two steps' data: the shared moment of its weights is
  # zero after the average at step 2, and step 3 (not an average) would divide their
  # first moment by epsilon alone. Adam's bound on a step holds them.
  replicas, steps = 3, 3
  adam = dict(ADAM, epsilon=1e-7)
  x, y = data(replicas, steps)
  x[:2 * replicas * PER_REPLICA, 0] = 0.0
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES[:replicas])
  with strategy.scope():
    model = linear_model()
    model.compile(optimizer=tf_adacomp.CompressedOptimizer(
        keras.optimizers.Adam(**adam), "none", precondition=precondition,
        second_moment_interval="doubling"), loss="mse")
  start = model.get_weights()
  model.fit(x, y, batch_size=replicas * PER_REPLICA, verbose=0, shuffle=False)
  optimizer = model.optimizer
  assert int(optimizer.moment_synced_at.numpy()) == 2
  assert np.all(optimizer.shared_velocities[0].numpy()[0] == 0)  # feature 0's weights
  moved = np.abs(model.get_weights()[0][0] - start[0][0])
  alpha = adam["learning_rate"] * math.sqrt(1 - 0.99 ** 2) / (1 - 0.9 ** 3)
  bound = shared_moment.step_bound(alpha, adam["beta_1"], adam["beta_2"])
  # Each replica's step is clipped (before it is sent, with either precondition), and
  # their signs differ.
  assert np.all(moved <= bound * (1 + 1e-6)), (moved, bound)
  assert np.all(moved > 0.2 * bound), (moved, bound)


# The fast tier counts both moments of "global" at a sync step; the rest is slow.
@pytest.mark.parametrize("steps,mode", [pytest.param(1, "shared", marks=pytest.mark.slow),
                                        pytest.param(3, "shared", marks=pytest.mark.slow),
                                        (1, "global")])
def test_bytes_count_the_averaged_moments_at_sync_steps(steps, mode):
  # Step 1 averages the moments (bfloat16: v, and w for "global"), step 3 does not.
  _, model, _ = fit(_shared(mode=mode), 2, steps)
  averaged = 2 if mode == "global" else 1
  moments = model.optimizer.moment_bytes()  # the part CompressionStats keeps apart
  for (plan, nbytes), moment in zip(model.optimizer.variable_bytes(), moments):
    size = plan.shape.num_elements()
    assert nbytes == (4 + 2 * averaged) * size if steps == 1 else 4 * size, (plan, nbytes)
    assert moment == (2 * averaged * size if steps == 1 else 0), (plan, moment)


def test_the_checkpoint_holds_the_shared_moment(tmp_path, uncompressed):
  replicas, steps, mode, start, model, strategy = uncompressed
  _, adam, _ = reference(start, replicas, steps, mode=mode)
  saved = tf.train.Checkpoint(optimizer=model.optimizer).save(str(tmp_path / "ckpt"))
  restored_model = linear_model()
  restored = _shared(mode=mode)()
  restored_model.compile(optimizer=restored, loss="mse")
  restored.build(restored_model.trainable_variables)
  tf.train.Checkpoint(optimizer=restored).restore(saved)
  for k, variable in enumerate(restored.shared_velocities):
    np.testing.assert_allclose(variable.numpy(), adam.shared[k], **MOMENT_TOLERANCE)
    if mode == "global":  # the mean of the replicas' own
      np.testing.assert_allclose(restored.momentum_squares[k].numpy(),
                                 np.mean([adam.w[r][k] for r in range(replicas)], axis=0),
                                 **MOMENT_TOLERANCE)
  assert int(restored.iterations.numpy()) == steps
  del strategy


# "after" in the slow tier: the same exchange, of the first moment, divided on arrival.
@pytest.mark.parametrize("precondition", ["before",
                                          pytest.param("after", marks=pytest.mark.slow)])
def test_compressed_steps_keep_error_feedback_and_adamw_decays_as_keras(precondition):
  replicas, steps, density, decay = 2, 3, 0.25, 0.5

  def adamw():
    inner = keras.optimizers.AdamW(weight_decay=decay, **ADAM)
    inner.exclude_from_weight_decay(var_names=["bias"])
    return inner

  start, model, strategy = fit(_shared(adamw, tf_adacomp.TopK(density),
                                       precondition=precondition), replicas, steps)
  expected, _, residues = reference(start, replicas, steps, density=density,
                                    precondition=precondition,
                                    weight_decay=decay, decayed=[0])  # kernel, not bias
  assert_replicas_hold(model, strategy, expected, **STEP_TOLERANCE)
  for k in range(len(start)):
    for r, copy in enumerate(replica_values(model.optimizer.residues[k][0], strategy)):
      np.testing.assert_allclose(copy, residues[r][k], **STEP_TOLERANCE)


# Slow (both; AdamW is Adam with a decay): one replica is Keras' Adam in
# test_one_replica_on_an_embedding_is_keras_adam in the fast tier (and bit for bit in
# tests/conformance/test_oracle.py's test_one_replica_is_keras_bit_for_bit[inner=adam,mixed,
# model=embedding]), AdamW's decay in
# test_compressed_steps_keep_error_feedback_and_adamw_decays_as_keras[before].
@pytest.mark.parametrize("make", [
    pytest.param(lambda: keras.optimizers.Adam(**ADAM), marks=pytest.mark.slow),
    pytest.param(lambda: keras.optimizers.AdamW(weight_decay=0.3, **ADAM),
                 marks=pytest.mark.slow)], ids=["Adam", "AdamW"])
def test_one_replica_is_the_plain_optimizer(make):
  x, y = data(1, 3)
  results = []
  for optimizer in (make(), _shared(make)()):
    model = linear_model()
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=4, verbose=0, shuffle=False)
    results.append(model.get_weights())
  # Its average of one sends nothing: the bytes are the uncompressed updates'.
  for plan, nbytes in optimizer.variable_bytes():
    assert nbytes == 4 * plan.shape.num_elements()
  for a, b in zip(*results):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_non_finite_gradient_on_one_replica_changes_nothing():
  replicas = 2
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=["/cpu:0", "/cpu:1"])
  x, y = data(replicas, 1)
  x[0, 0] = np.inf  # replica 0's shard only
  with strategy.scope():
    model = linear_model()
    model.compile(optimizer=_shared(compressor=tf_adacomp.TopK(0.2))(), loss="mse")
  start = model.get_weights()
  model.fit(x, y, batch_size=replicas * 4, verbose=0, shuffle=False)
  for before, after in zip(start, model.get_weights()):
    np.testing.assert_array_equal(after, before)
  optimizer = model.optimizer
  assert int(optimizer.iterations.numpy()) == 0
  slots = [*shared_moment.moment_slots(optimizer.inner_optimizer)]
  for variable in [*optimizer.shared_velocities, *slots[0], *slots[1],
                   *(s for state in optimizer.residues for s in state)]:
    assert not any(np.any(c) for c in replica_values(variable, strategy))


def test_default_and_config():
  adam = tf_adacomp.CompressedOptimizer(keras.optimizers.AdamW(0.01))
  assert (adam.exchange, adam.second_moment) == ("updates", optimizer_module.DEFAULT_SECOND_MOMENT)
  for inner, kwargs in [(keras.optimizers.SGD(0.1, momentum=0.9), {}),
                        (keras.optimizers.RMSprop(0.1), {}),
                        (keras.optimizers.Adam(0.1, amsgrad=True), {}),
                        (keras.optimizers.Adam(0.1, global_clipnorm=1.0), {}),
                        (keras.optimizers.Adam(0.1), {"exchange": "gradients"}),
                        (keras.optimizers.Adam(0.1), {"momentum_masking": True})]:
    assert tf_adacomp.CompressedOptimizer(inner, **kwargs).second_moment == "local"
  optimizer = tf_adacomp.CompressedOptimizer(keras.optimizers.Adam(0.01), "topk",
                                             second_moment="shared",
                                             second_moment_interval=64, precondition="after")
  restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
  assert (restored.second_moment, restored.second_moment_interval, restored.precondition) == (
      "shared", 64, "after")
  # Saved before `second_moment` existed: each replica kept its own.
  old = {k: v for k, v in optimizer.get_config().items()
         if k not in ("second_moment", "second_moment_interval", "precondition")}
  assert tf_adacomp.CompressedOptimizer.from_config(old).second_moment == "local"


@pytest.mark.parametrize("kwargs,interval", [
    ({}, 0),  # "global": each replica's own estimate, nothing averaged
    ({"precondition": "after"}, "doubling"),  # divides by the averaged moment
    ({"second_moment": "shared"}, "doubling"),
    ({"second_moment": "global", "second_moment_interval": "doubling"}, "doubling"),
    ({"second_moment_interval": 64}, 64),
    ({"local_steps": 4}, 0),
    ({"second_moment": "local"}, None),
])
def test_the_interval_resolves_and_is_saved_resolved(kwargs, interval):
  optimizer = tf_adacomp.CompressedOptimizer(keras.optimizers.Adam(0.01), **kwargs)
  assert optimizer.second_moment_interval == interval
  config = optimizer.get_config()
  assert config["second_moment_interval"] == interval
  assert tf_adacomp.CompressedOptimizer.from_config(config).second_moment_interval == interval


@pytest.mark.parametrize("saved,interval", [
    # Written when None meant averages at steps 1, 2, 4, ...: they keep them.
    ({"second_moment": "global"}, "doubling"),
    ({"second_moment": "shared"}, "doubling"),
    # Local steps never averaged; "local" shares nothing.
    ({"second_moment": "global", "local_steps": 4}, 0),
    ({"second_moment": "local"}, None),
])
def test_a_config_saved_with_none_keeps_what_it_trained_with(saved, interval):
  config = tf_adacomp.CompressedOptimizer(keras.optimizers.Adam(0.01)).get_config()
  config.update(saved, second_moment_interval=None)
  assert tf_adacomp.CompressedOptimizer.from_config(config).second_moment_interval == interval


def test_a_keras_file_saved_with_the_averages_loads_them(tmp_path):
  # A .keras file of a release whose "global" averaged by default: its config says
  # second_moment_interval=None, and its optimizer variables include the shared moment.
  # Loaded now, it keeps averaging and every saved variable loads into its own.
  x, y = data(1, 2)
  model = linear_model()
  model.compile(optimizer=_shared(mode="global")(), loss="mse")
  model.fit(x, y, batch_size=PER_REPLICA, verbose=0, shuffle=False)
  path = str(tmp_path / "old.keras")
  model.save(path)
  _rewrite_keras_config(path, second_moment_interval=None)
  loaded = keras.saving.load_model(path)
  optimizer = loaded.optimizer
  assert optimizer.second_moment_interval == "doubling"
  assert len(optimizer.variables) == len(model.optimizer.variables)
  for a, b in zip(optimizer.variables, model.optimizer.variables):
    assert a.path.rsplit("_", 2)[-2:] == b.path.rsplit("_", 2)[-2:]  # the same slot
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  assert np.any(optimizer.shared_velocities[0].numpy())


def _by_role(optimizer):
  """``{(wrapper or inner, the variable's own name): value}`` of every optimizer variable."""
  inner = {id(v) for v in optimizer.inner_optimizer.variables}
  def name(v):  # the same in another model of the same layers
    return re.sub(r"(sequential|dense)_\d+", r"\1", v.path.rsplit("/", 1)[-1])
  return {("inner" if id(v) in inner else "wrapper", name(v)): v.numpy()
          for v in optimizer.variables}


@pytest.mark.parametrize("build_first", [False, True])
def test_a_checkpoint_saved_with_the_averages_resumes_into_the_default(
    tmp_path, monkeypatch, build_first):
  # A tf.train.Checkpoint of a release whose "global" averaged by default: it matched
  # the wrapper's variables by their places in Keras' list, which the default (no shared
  # moment) fills otherwise. Restored now, each variable gets its own saved value (by
  # name); the shared moment, which the default does not have, is left out, and so is
  # the choice of exchange, which that release kept only in the list.
  replicas = 2
  x, y = data(replicas, 2)
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES[:replicas])
  with strategy.scope():
    model = linear_model()
    model.compile(optimizer=_shared(compressor="adacomp", mode="global")(), loss="mse")
  with monkeypatch.context() as release:  # the checkpoint that release wrote
    release.setattr(tf_adacomp.CompressedOptimizer, "_trackable_children",
                    keras.optimizers.Adam._trackable_children)
    model.fit(x, y, batch_size=PER_REPLICA * replicas, verbose=0, shuffle=False)
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "old"))
  saved = _by_role(model.optimizer)
  with strategy.scope():
    resumed = linear_model()
    resumed.compile(optimizer=tf_adacomp.CompressedOptimizer(
        keras.optimizers.Adam(**ADAM), "adacomp", exchange="updates",
        second_moment="global"), loss="mse")
  assert resumed.optimizer.dense_when_faster  # its choice's variables fill the old places
  checkpoint = tf.train.Checkpoint(model=resumed)
  with strategy.scope():
    if build_first:
      resumed.optimizer.build(resumed.trainable_variables)
      checkpoint.restore(path)
    else:
      checkpoint.restore(path)  # deferred: each variable when the optimizer makes it
      resumed.optimizer.build(resumed.trainable_variables)
  restored = _by_role(resumed.optimizer)
  assert resumed.optimizer.second_moment_interval == 0
  kept = [key for key in restored if "exchange_choice" not in key[1]]
  assert any("momentum_square" in name for _, name in kept)
  assert any("residue" in name for _, name in kept)
  for key in kept:
    np.testing.assert_array_equal(restored[key], saved[key], err_msg=str(key))
  assert np.any(restored["inner", "iteration"])


def _rewrite_keras_config(path, **optimizer_config):
  """Replaces entries of the optimizer's config inside a ``.keras`` file."""
  with zipfile.ZipFile(path) as archive:
    files = {name: archive.read(name) for name in archive.namelist()}
  config = json.loads(files["config.json"])
  config["compile_config"]["optimizer"]["config"].update(optimizer_config)
  files["config.json"] = json.dumps(config).encode()
  with zipfile.ZipFile(path, "w") as archive:
    for name, data_bytes in files.items():
      archive.writestr(name, data_bytes)


@pytest.mark.parametrize("inner,kwargs,match", [
    (None, {"second_moment": "mean"}, r"second_moment='mean'"),
    (None, {"second_moment": "global", "exchange": "gradients"}, r"exchange='gradients'"),
    (None, {"second_moment": "shared", "exchange": "gradients"}, r"exchange='gradients'"),
    (None, {"second_moment": "shared", "reduction": "adasum"}, r"reduction='adasum'"),
    (None, {"second_moment": "shared", "momentum_masking": True}, r"momentum_masking=True"),
    (lambda: keras.optimizers.SGD(0.1), {"second_moment": "shared"}, r"inner_optimizer=<"),
    (lambda: keras.optimizers.Adam(amsgrad=True), {"second_moment": "shared"}, r"amsgrad"),
    (lambda: keras.optimizers.Adam(clipnorm=1.0), {"second_moment": "shared"},
     r"clipnorm=1.0"),
    (lambda: keras.optimizers.Adam(use_ema=True), {"second_moment": "shared"},
     r"use_ema=True"),
    (None, {"precondition": "sideways"}, r"precondition='sideways'"),
    (None, {"precondition": "after", "second_moment": "local"},
     r"precondition='after', second_moment='local'"),
    # 0 (nothing averaged) is "global"'s alone: each replica's own estimate.
    (None, {"second_moment": "shared", "second_moment_interval": 0},
     r"second_moment_interval=0, second_moment='shared'"),
    (None, {"second_moment_interval": -1}, r"second_moment_interval=-1"),
    (None, {"second_moment_interval": 2.5}, r"second_moment_interval=2.5"),
    (None, {"second_moment_interval": "weekly"}, r"second_moment_interval='weekly'"),
    (None, {"second_moment_interval": np.array([1, 2])},
     r"second_moment_interval=array\(\[1, 2\]\)"),
    (None, {"second_moment_interval": "doubling", "local_steps": 2},
     r"second_moment_interval='doubling', local_steps=2"),
    (None, {"second_moment": "local", "second_moment_interval": "doubling"},
     r"second_moment_interval='doubling', second_moment='local'"),
    (None, {"second_moment": "local", "second_moment_interval": 8},
     r"second_moment_interval=8, second_moment='local'"),
])
def test_bad_arguments_name_themselves(inner, kwargs, match):
  inner = inner() if inner else keras.optimizers.Adam(0.01)
  with pytest.raises(ValueError, match=match):
    tf_adacomp.CompressedOptimizer(inner, **kwargs)


def _token_model():
  keras.utils.set_random_seed(0)
  return keras.Sequential([keras.Input([6], dtype="int32"), keras.layers.Embedding(12, 4),
                           keras.layers.Flatten(), keras.layers.Dense(3)])


def _token_fit(optimizer, replicas, steps):
  """``model.fit`` of an Embedding whose batches repeat tokens (IndexedSlices gradients
  with duplicate rows)."""
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, 12, size=(8 * steps, 6)).astype(np.int32)
  labels = (tokens.sum(axis=1) % 3).astype(np.int32)
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES[:replicas])
  with strategy.scope():
    model = _token_model()
    model.compile(optimizer=optimizer(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(tokens, labels, batch_size=8, epochs=1, verbose=0, shuffle=False)
  return model


def test_one_replica_on_an_embedding_is_keras_adam():
  # Keras' Adam squares an IndexedSlices gradient's slices before summing duplicates.
  plain = _token_fit(lambda: keras.optimizers.Adam(**ADAM), 1, 3)
  one = _token_fit(_shared(mode="global"), 1, 3)
  for a, b in zip(plain.get_weights(), one.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# The fast tier has the one-replica case above; sparse moments take one path in both modes.
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "global"])
def test_an_embeddings_shared_moment_is_keras_on_the_global_batch(mode):
  # With 2 replicas the Embedding's shared moment after an average is the sum of the
  # squared slices of both replicas' batches: Keras' Adam on the global batch.
  plain = _token_fit(lambda: keras.optimizers.Adam(**ADAM), 2, 1)
  two = _token_fit(_shared(mode=mode), 2, 1)
  _, keras_v = shared_moment.moment_slots(plain.optimizer)
  assert np.max(keras_v[0].numpy()) > 0
  np.testing.assert_allclose(two.optimizer.shared_velocities[0].numpy(),
                             np.asarray(keras_v[0].numpy()), rtol=2e-2, atol=1e-12)


# Slow: the embedding's IndexedSlices path is test_one_replica_on_an_embedding_is_keras_adam's
# in the fast tier.
@pytest.mark.slow
def test_one_replica_on_repeated_tokens_is_keras_adam_bit_for_bit():
  # Repeated tokens put their summed gradient in m but only the sum of their squares in
  # v, so |m| / sqrt(v) can exceed Adam's bound on a dense step; with the moment fresh
  # (every step, with one replica) nothing is clipped. Default epsilon, 20 steps.
  adam = {"learning_rate": 0.01}
  plain = _token_fit(lambda: keras.optimizers.Adam(**adam), 1, 20)
  one = _token_fit(_shared(lambda: keras.optimizers.Adam(**adam), mode="global"), 1, 20)
  for a, b in zip(plain.get_weights(), one.get_weights()):
    np.testing.assert_array_equal(a, b)


# Slow: local_clipnorm on an embedding: test_optimizer_updates.py's
# test_local_clipnorm_is_keras_global_clipnorm_bit_for_bit[slices] in the fast tier.
@pytest.mark.slow
def test_one_replica_local_clipnorm_on_an_embedding_is_keras_global_clipnorm():
  # Keras' global_clipnorm takes the norm of the slices and hands Adam the clipped
  # gradient dense: v gets the square of the clipped, summed rows (the slices' squares
  # are 1e-2 off), bit for bit with the shared moment of one replica.
  adam = {"learning_rate": 0.01}
  plain = _token_fit(lambda: keras.optimizers.Adam(global_clipnorm=0.5, **adam), 1, 6)
  one = _token_fit(_shared(lambda: keras.optimizers.Adam(**adam), mode="global",
                           local_clipnorm=0.5), 1, 6)
  for a, b in zip(plain.get_weights(), one.get_weights()):
    np.testing.assert_array_equal(a, b)


# Slow (both modes): precondition="after" trains in the fast tier in
# tests/conformance/test_oracle.py's row "inner=adam,second_moment=global,precondition=after".
@pytest.mark.parametrize("mode", [pytest.param("shared", marks=pytest.mark.slow),
                                  pytest.param("global", marks=pytest.mark.slow)])
def test_precondition_after_is_before_without_compression(mode):
  # 2 replicas, 8 steps (averages at 1, 2, 4, 8): between averages both bound each
  # replica's step, so without compression they differ by float rounding only.
  results = [fit(_shared(mode=mode, precondition=p), 2, 8)[1].get_weights()
             for p in ("before", "after")]
  for a, b in zip(*results):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # a 16k-parameter layer, AdaComp's kernels: 10 s of the fast tier
def test_the_moments_average_is_not_counted_as_all_gather():
  # Step 1 averages Adam's moments densely (an all-reduce), beside AdaComp's payload:
  # the all-gather check counts the payload only, so 2 senders are not "past the
  # crossover" (the false AllGatherScalingWarning every Adam user saw).
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES[:2])
  rng = np.random.default_rng(0)
  x = rng.standard_normal([16, 64]).astype(np.float32)
  y = rng.standard_normal([16, 256]).astype(np.float32)
  with strategy.scope():
    model = keras.Sequential([keras.Input([64]), keras.layers.Dense(256)])
    model.compile(optimizer=tf_adacomp.CompressedOptimizer(
        keras.optimizers.Adam(), "adacomp", second_moment_interval="doubling"), loss="mse")
  model.fit(x, y, batch_size=16, epochs=1, verbose=0)
  optimizer = model.optimizer
  assert optimizer.second_moment == "global" and sum(optimizer.moment_bytes()) > 0
  assert optimizer.check_scaling(warn=False) is False
