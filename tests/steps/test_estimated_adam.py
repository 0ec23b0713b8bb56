"""Adam with each replica's estimate of the global batch's second moment
(tf_adacomp/steps/estimated_adam.py: ``second_moment="global"`` inside local steps, or
with ``second_moment_interval=0`` at every step), against a NumPy replay of its
docstring's algorithm."""

import math

import keras
import numpy as np
import pytest

import tf_adacomp
import tiers
from tf_adacomp import shared_moment
from adam_reference import np_global_moment
from replica_harness import (fit, linear_model, data, own_mean_gradients, replica_values,
                             replica_weights, shards)

ADAM = dict(learning_rate=0.01, beta_1=0.9, beta_2=0.99, epsilon=1e-3)
WEIGHT_DECAY = 0.1


def replay(start, replicas, steps, local_steps, infer_first_moments=True):
  """Each replica's weights and ``(m, v, w)`` after ``steps`` steps of AdamW (weight
  decay on every variable) with rounds of ``local_steps``, without compression: float64.
  At a round's end each replica's first moment becomes the one that over the round's
  steps would have moved the weights by the mean pseudo-update (with
  ``infer_first_moments``; with one replica or a round of one step: not)."""
  lr, b1, b2, eps = ADAM["learning_rate"], ADAM["beta_1"], ADAM["beta_2"], ADAM["epsilon"]
  anchor = [w.astype(np.float64) for w in start]
  weights = [[w.copy() for w in anchor] for _ in range(replicas)]
  zeros = lambda: [[np.zeros_like(w) for w in anchor] for _ in range(replicas)]  # noqa: E731
  m, v, w = zeros(), zeros(), zeros()
  for step in range(steps):
    t = step + 1
    alpha = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    for r, (xs, ys) in enumerate(shards(replicas, step, steps)):
      grads = own_mean_gradients([x.astype(np.float32) for x in weights[r]], xs, ys)
      for k, g in enumerate(grads):
        m[r][k] += (g - m[r][k]) * (1 - b1)
        v[r][k] += (g * g - v[r][k]) * (1 - b2)
        w[r][k] += ((m[r][k] / (1 - b1 ** t)) ** 2 - w[r][k]) * (1 - b2)
        divisor = np.sqrt(np_global_moment(v[r][k], w[r][k], replicas, b1)) + eps
        weights[r][k] = weights[r][k] * (1 - WEIGHT_DECAY * lr) - alpha * m[r][k] / divisor
    if t % local_steps == 0:  # the round's end: every replica takes the mean
      new = [np.mean([weights[r][k] for r in range(replicas)], axis=0)
             for k in range(len(anchor))]
      if infer_first_moments and local_steps > 1 and replicas > 1:
        for r in range(replicas):
          for k, (a, b) in enumerate(zip(anchor, new)):
            divisor = np.sqrt(np_global_moment(v[r][k], w[r][k], replicas, b1)) + eps
            m[r][k] = -(b - a) * divisor / (alpha * local_steps)
      anchor = new
      weights = [[a.copy() for a in anchor] for _ in range(replicas)]
  return weights, m, v, w


def _estimated(compressor="none", **kwargs):
  return lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.AdamW(weight_decay=WEIGHT_DECAY, **ADAM), compressor,
      local_steps=2, second_moment="global", **kwargs)


def test_each_replica_divides_by_its_own_estimate_of_the_global_moment():
  # 3 replicas whose data disagree, rounds of 2, 3 steps: a round's end at step 2 (every
  # replica takes the mean), then a local step from it (each its own).
  replicas, steps = 3, 3
  start, model, strategy = fit(_estimated(), replicas, steps)
  expected, m, v, w = replay(start, replicas, steps, local_steps=2)
  held = replica_weights(model, strategy)
  for k, copies in enumerate(held):
    for r, copy in enumerate(copies):
      np.testing.assert_allclose(copy, expected[r][k], rtol=1e-5, atol=1e-6)
  assert not np.allclose(held[0][0], held[0][1])  # the replicas have moved apart again
  optimizer = model.optimizer
  assert int(optimizer.iterations.numpy()) == steps
  momentums, velocities = shared_moment.moment_slots(optimizer.inner_optimizer)
  for k in range(len(start)):
    for r in range(replicas):
      # Inferred at the round's end from a difference of float32 weights (of order 1):
      # an ulp of a weight, over alpha H, is about 1e-7 of m.
      np.testing.assert_allclose(replica_values(momentums[k], strategy)[r], m[r][k],
                                 rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(replica_values(velocities[k], strategy)[r], v[r][k],
                                 rtol=1e-5, atol=1e-9)
      np.testing.assert_allclose(replica_values(optimizer.momentum_squares[k], strategy)[r],
                                 w[r][k], rtol=1e-4, atol=1e-9)
  # The estimate binds at neither end everywhere: it is not each replica's own moment.
  estimate = np_global_moment(v[0][0], w[0][0], replicas, ADAM["beta_1"])
  assert np.any((estimate < v[0][0]) & (estimate > v[0][0] / replicas))
  # Nothing is averaged but the rounds' pseudo-updates: no moment bytes.
  assert optimizer.moment_bytes() == [0] * len(start)


def _first_moments_after_one_round(compressor):
  """``(held, own, inferred)``, each ``[replica][variable]``: the first moments that 2
  replicas hold after one round of 2 steps with ``compressor``, and the replay's with
  each replica's own and with the inferred ones (nothing arrived before the round)."""
  replicas, steps = 2, 2
  start, model, strategy = fit(_estimated(compressor), replicas, steps)
  _, own, _, _ = replay(start, replicas, steps, local_steps=2, infer_first_moments=False)
  _, inferred, _, _ = replay(start, replicas, steps, local_steps=2)
  momentums, _ = shared_moment.moment_slots(model.optimizer.inner_optimizer)
  held = [[replica_values(momentums[k], strategy)[r] for k in range(len(start))]
          for r in range(replicas)]
  return held, own, inferred


def test_compressed_rounds_keep_each_replicas_own_first_moment():
  # With AdaComp the mean that arrives is not what the replicas stepped: nothing is
  # inferred from it.
  held, own, inferred = _first_moments_after_one_round("adacomp")
  for r, moments in enumerate(held):
    for k, moment in enumerate(moments):
      np.testing.assert_allclose(moment, own[r][k], rtol=1e-5, atol=1e-7)
      assert not np.allclose(moment, inferred[r][k], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("compressor", tiers.fast_only(["bf16", "fp16"], keep={0}))
def test_half_precision_rounds_infer_the_first_moment_from_what_arrived(compressor):
  # A cast sends every element: the mean that arrives is what the replicas stepped, to
  # the cast's rounding, and the first moments are inferred from it as without one.
  held, own, inferred = _first_moments_after_one_round(compressor)
  for r, moments in enumerate(held):
    for k, moment in enumerate(moments):
      # bfloat16 keeps 8 bits of each replica's pseudo-update: where the replicas'
      # updates cancel, the mean's error is 2^-8 of theirs, not of it (atol).
      np.testing.assert_allclose(moment, inferred[r][k], rtol=1e-2, atol=1e-3)
      assert not np.allclose(moment, own[r][k], rtol=1e-2, atol=1e-3)


def test_every_step_with_interval_zero_applies_the_mean_of_the_estimated_steps():
  # second_moment_interval=0: every step each replica divides by its own estimate and the
  # replicas' steps are averaged, a round of one step; nothing else is averaged.
  replicas, steps = 3, 3
  make = lambda: tf_adacomp.CompressedOptimizer(  # noqa: E731
      keras.optimizers.AdamW(weight_decay=WEIGHT_DECAY, **ADAM), "none",
      second_moment="global", second_moment_interval=0, dense_when_faster=False)
  start, model, strategy = fit(make, replicas, steps)
  expected, m, v, w = replay(start, replicas, steps, local_steps=1)
  for k, copies in enumerate(replica_weights(model, strategy)):
    for copy in copies:  # equal on every replica
      np.testing.assert_allclose(copy, expected[0][k], rtol=1e-5, atol=1e-6)
  optimizer = model.optimizer
  for k in range(len(start)):
    for r in range(replicas):
      np.testing.assert_allclose(replica_values(optimizer.momentum_squares[k], strategy)[r],
                                 w[r][k], rtol=1e-4, atol=1e-9)
  assert not hasattr(optimizer, "shared_velocities")
  assert optimizer.moment_bytes() == [0] * len(start)


def test_interval_zero_trains_under_the_default_choice_of_exchange():
  # dense_when_faster (the default) chooses at each exchange; the replicas stay equal.
  make = lambda: tf_adacomp.CompressedOptimizer(  # noqa: E731
      keras.optimizers.Adam(**ADAM), second_moment_interval=0)
  start, model, strategy = fit(make, 2, 6)
  for copies in replica_weights(model, strategy):
    np.testing.assert_array_equal(copies[0], copies[1])
  assert not np.allclose(replica_weights(model, strategy)[0][0], start[0])
  assert model.optimizer.moment_bytes() == [0] * len(start)


def test_one_replica_is_keras_adamw():
  x, y = data(1, 5)
  results = []
  for optimizer in (keras.optimizers.AdamW(weight_decay=WEIGHT_DECAY, **ADAM), _estimated()()):
    model = linear_model()
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=4, verbose=0, shuffle=False)
    results.append(model.get_weights())
  # The anchor moves by the pseudo-update, a + (w - a): float32 rounds it (one ulp a round).
  for a, b in zip(*results):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_one_replica_on_an_embedding_is_keras_adam():
  # Keras' Adam adds an IndexedSlices gradient's squared slices to v (repeated tokens).
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, 12, size=(8 * 4, 6)).astype(np.int32)
  labels = (tokens.sum(axis=1) % 3).astype(np.int32)
  results = []
  for optimizer in (keras.optimizers.Adam(**ADAM), tf_adacomp.CompressedOptimizer(
      keras.optimizers.Adam(**ADAM), "none", local_steps=2, second_moment="global")):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input([6], dtype="int32"), keras.layers.Embedding(12, 4),
                              keras.layers.Flatten(), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(tokens, labels, batch_size=8, verbose=0, shuffle=False)
    results.append(model.get_weights())
  for a, b in zip(*results):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs,match", [
    ({"second_moment": "shared"}, r"second_moment='shared', local_steps=2"),
    ({"inner_optimizer": keras.optimizers.SGD(0.1)}, r"inner_optimizer=<"),
    ({"inner_optimizer": keras.optimizers.Adam(amsgrad=True)}, r"amsgrad"),
    # Nothing is averaged, and each replica divides its own steps.
    ({"second_moment_interval": 8}, r"second_moment_interval=8, local_steps=2"),
    ({"precondition": "after"}, r"precondition='after', local_steps=2"),
    # Every step: 0 (nothing averaged) is for "global" alone, without "after".
    ({"local_steps": 1, "second_moment": "shared", "second_moment_interval": 0},
     r"second_moment_interval=0, second_moment='shared'"),
    ({"local_steps": 1, "second_moment_interval": 0, "precondition": "after"},
     r"precondition='after', second_moment_interval=0"),
    ({"local_steps": 1, "second_moment_interval": -1}, r"second_moment_interval=-1"),
])
def test_bad_arguments_name_themselves(kwargs, match):
  kwargs = {"inner_optimizer": keras.optimizers.Adam(), "second_moment": "global",
            "local_steps": 2, **kwargs}
  with pytest.raises(ValueError, match=match):
    tf_adacomp.CompressedOptimizer(**kwargs)
