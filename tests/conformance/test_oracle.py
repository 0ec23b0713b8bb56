"""The differential oracle for ``tf_adacomp.CompressedOptimizer(inner, "none", ...)``.

With ``compressor="none"`` nothing is lost, so the wrapper must train as plain Keras with
the same inner optimizer: bit for bit on one replica (no strategy, or a 1-device
``MirroredStrategy``), within float tolerance on 2 and 4 replicas against plain Keras
under a ``MirroredStrategy`` on the same devices and global batches, and against an
eager replay where the wrapper's algorithm is not Keras' on the global batch (local
steps, each replica's own Adam, Adam's shared second moment, local clipping).
tests/conformance/oracle.py says which reference each configuration gets and why the
tolerances are what they are.

- ``test_trains_as_its_reference``: a pairwise covering array over the wrapper's axes
  crossed with what Keras users do (``oracle.TRAINING_AXES``): the fast tier runs its
  first ``oracle.FAST_ROWS`` rows on at most 2 replicas (``oracle.fast_rows``), ``--full``
  all of them.
- ``test_targeted_configuration_trains_as_its_reference`` (``--full``): each of issue
  43's defects in its smallest configuration, and a few combinations the array holds
  only among other factors.
- ``test_one_replica_is_keras_bit_for_bit``: one replica against Keras, bit for bit,
  whatever rounding defect is listed.
- ``test_precondition_after_is_before_without_compression``: what must hold where no
  exact reference exists (Adam's shared moment between its averages).
- ``test_a_mutation_is_caught``: the oracle fails when tf_adacomp is changed (a
  monkeypatched term): a test that cannot fail would be a defect of its own.
- ``test_the_constructor_refuses_exactly_the_invalid_combinations``: a ValueError naming
  the offending argument exactly where the documented rules say.

Configurations that fail because of a defect are ``xfail(strict=True)`` through
``oracle.KNOWN_DEFECTS`` (issue 43) and ``oracle.FOUND_DEFECTS``.
"""

import dataclasses
import itertools

import pytest

import oracle
import tiers
from tf_adacomp import replica_steps
from tf_adacomp import shared_moment

CONFIGS = oracle.training_configs()

# The configurations that passed ``oracle.check`` unmutated in this process: a
# configuration held by two of the lists below (a targeted one that is also a mutation's
# unmutated configuration) is trained and compared once. One that failed is not here,
# and fails again wherever it is held.
_PASSED = set()


def _check(config, directory):
  if config in _PASSED:
    return
  oracle.check(config, directory)
  _PASSED.add(config)


def _params(configs, fast=0, exact=False, fast_rows=None):
  """``fast_rows``: the indices in the fast tier (default: the first ``fast``)."""
  fast_rows = set(range(fast) if fast_rows is None else fast_rows)
  return [pytest.param(c, id=c.id, marks=oracle.marks(c, exact)
                       + ([] if i in fast_rows else [pytest.mark.slow]))
          for i, c in enumerate(configs)]


# The fast tier: the first three small rows (the fourth, on tf_keras with devices_per_worker
# and an export, is covered there by test_oracle_tf_keras.py and tests/test_hierarchy.py).
@pytest.mark.parametrize("config", _params(CONFIGS, fast_rows=oracle.fast_rows(CONFIGS, 3)))
def test_trains_as_its_reference(config, tmp_path):
  _check(config, str(tmp_path))


@pytest.mark.parametrize("config", _params(oracle.TARGETED))
def test_targeted_configuration_trains_as_its_reference(config, tmp_path):
  _check(config, str(tmp_path))


ONE_REPLICA = [
    oracle.Config(inner="adam", model="embedding", mixed=True),
    oracle.Config(inner="adamw", exchange="gradients", no_strategy=True, weight_decay=True,
                  schedule=True, ema=True),
    oracle.Config(model="embedding"),
    oracle.Config(local_clipnorm=oracle.CLIPNORM),
    oracle.Config(inner="adam", model="embedding", steps=20),  # issue 43 defect 3
    oracle.Config(inner="adam", second_moment="shared", precondition="after",
                  weight_decay=True, start_step=2),
    oracle.Config(inner="adamw", second_moment="local", no_strategy=True, ema=True),
]


# The fast tier: the first (mixed precision on an embedding). The second with --full: the
# fast tier's array row test_trains_as_its_reference[inner=adam,exchange=gradients,
# second_moment=local,no_strategy,...,schedule,weight_decay,ema,...] holds its factors (one
# replica, the gradient exchange, a schedule, a weight decay, an EMA) and is compared bit
# for bit too.
@pytest.mark.parametrize("config", _params(ONE_REPLICA, fast=1, exact=True))
def test_one_replica_is_keras_bit_for_bit(config, tmp_path):
  if config in _PASSED and oracle.tolerance(config) == oracle.EXACT:
    # oracle.check made this very comparison (the wrapper's run against plain Keras',
    # bit for bit) in this process: inner=adam,model=embedding,steps=20 is targeted too.
    return
  ours = oracle.train(config, True, str(tmp_path / "ours"))
  keras_run = oracle.keras_reference(config, str(tmp_path / "keras"))
  oracle.compare(config, ours, keras_run, how=oracle.EXACT)


# Slow: the mixed-precision replay is checked bit for bit by
# test_one_replica_is_keras_bit_for_bit[inner=adam,mixed,model=embedding] in the fast tier.
@pytest.mark.slow
def test_the_replay_is_keras_under_mixed_precision_on_two_replicas(tmp_path):
  """Where plain Keras and the replay both are references (SGD, the update exchange, one
  step a round: linear in the gradient), they agree under mixed_float16 on 2 replicas:
  the replay's float16 backward pass sees what Keras' does, each replica's loss divided
  by the replica count before the loss scale (defect G: with the whole scale a shard's
  gradient overflowed to inf in the replay at step 5, and its weights ended NaN)."""
  config = oracle.Config(replicas=2, mixed=True)
  assert oracle.reference_kind(config) == "keras"
  keras_run = oracle.train(config, False, str(tmp_path))
  replayed = oracle.replay(config, keras_run.start)
  oracle.compare(config, replayed, keras_run, how=oracle.MIXED)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "global"])
def test_precondition_after_is_before_without_compression(mode, tmp_path):
  """Dividing each replica's step by the shared moment before the exchange, or their
  mean after it, is the same without compression: the divisor is the same on every
  replica (shared_moment's docstring). 2 replicas, 8 steps (averages at 1, 2, 4, 8; each
  replica's step bounded in between, by the same bound either way). Within ``FLOAT``:
  (a / d + b / d) / 2 and (a + b) / 2 / d round differently by an ulp."""
  runs = []
  for precondition in ("before", "after"):
    config = oracle.Config(inner="adam", second_moment=mode, precondition=precondition,
                           second_moment_interval="doubling", replicas=2, steps=8)
    runs.append(oracle.train(config, True, str(tmp_path / precondition)))
  oracle.compare(config, runs[1], runs[0], how=oracle.FLOAT)


def _step_size_without_the_moments_age(learning_rate, t, synced_at, beta_1, beta_2):
  return _STEP_SIZE(learning_rate, t, t, beta_1, beta_2)


def _clip_by_double_the_norm(tensors, clipnorm):
  return _CLIP(tensors, 2 * clipnorm)


def _global_moment_of_one_replica(v, w, replicas, beta_1):
  return _GLOBAL_MOMENT(v, w, 1, beta_1)


_STEP_SIZE = shared_moment.step_size
_GLOBAL_MOMENT = shared_moment.global_moment
_CLIP = replica_steps.clip_by_global_norm
MUTATIONS = {
    # The bias correction's sqrt(1 - beta_2^s) with this step's t instead of the step s
    # of the last average: right at the averages (steps 1, 2, 4), wrong in between.
    "shared_moment.step_size ignores the moment's age": (
        shared_moment, "step_size", _step_size_without_the_moments_age,
        oracle.Config(inner="adam", second_moment="shared", replicas=2)),
    # A term off by a factor: each replica's gradient clipped at twice local_clipnorm.
    "replica_steps.clip_by_global_norm clips at twice the norm": (
        replica_steps, "clip_by_global_norm", _clip_by_double_the_norm,
        oracle.Config(inner="adam", second_moment="local", replicas=2,
                      local_clipnorm=oracle.CLIPNORM)),
    # Adam inside local steps divides by its own second moment (the estimate for one
    # replica), not by its estimate of the global batch's.
    "shared_moment.global_moment estimates one replica's moment": (
        shared_moment, "global_moment", _global_moment_of_one_replica,
        oracle.Config(inner="adam", local_steps=3, replicas=2, event="set_weights")),
    # The same at every step (the default for Adam: nothing averaged).
    "shared_moment.global_moment estimates one replica's moment, every step": (
        shared_moment, "global_moment", _global_moment_of_one_replica,
        oracle.Config(inner="adamw", replicas=2, weight_decay=True)),
}


@pytest.mark.parametrize("mutation", [
    pytest.param(name, marks=[] if i == 0 else [pytest.mark.slow])
    for i, name in enumerate(MUTATIONS)])
def test_a_mutation_is_caught(mutation, monkeypatch, tmp_path):
  """The configuration passes the oracle unchanged (``test_trains_as_its_reference``'s
  rows and the targeted ones hold it, or its neighbours), and fails it mutated."""
  module, name, replacement, config = MUTATIONS[mutation]
  monkeypatch.setattr(module, name, replacement)
  with pytest.raises(AssertionError, match=r"max \|ours - reference\|"):
    oracle.check(config, str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_the_mutated_configurations_pass_unmutated(mutation, tmp_path):
  _check(MUTATIONS[mutation][3], str(tmp_path))


def test_the_constructor_refuses_exactly_the_invalid_combinations():
  """All pairs of the constructor's axes (with ``--full`` every combination of the axes
  its rules read): a ValueError naming the offending argument where a documented rule
  is broken, none elsewhere, and the documented default ``second_moment``."""
  wrong = []
  for c in oracle.construction_configs(everything=tiers.full()):
    broken = oracle.construction_error(c)
    try:
      optimizer = oracle.make_wrapper(c)
    except ValueError as error:
      if not broken:
        wrong.append(f"{c.id}: refused ({error})")
      elif not any(name in str(error) for name in broken):
        wrong.append(f"{c.id}: the message names none of {broken}: {error}")
      continue
    if broken:
      wrong.append(f"{c.id}: accepted, but it breaks {broken}")
    elif optimizer.second_moment != oracle.resolved_second_moment(c):
      wrong.append(f"{c.id}: second_moment {optimizer.second_moment!r}, documented "
                   f"{oracle.resolved_second_moment(c)!r}")
  assert not wrong, "\n".join(wrong)


def test_the_covering_array_holds_every_valid_pair():
  """Every pair of values of two training axes that some valid configuration holds is
  in some row (checked against a brute-force search of the valid configurations'
  pairs over the constrained axes), and every row is valid."""
  rules = oracle.TRAINING_RULES
  for c in CONFIGS + list(oracle.TARGETED):
    row = dataclasses.asdict(c)
    assert all(p(*(row[a] for a in axes)) for axes, p in rules), c.id
    assert not oracle.construction_error(c), c.id
  held = {}
  for c in CONFIGS:
    row = dataclasses.asdict(c)
    for a in oracle.TRAINING_AXES:
      for b in oracle.TRAINING_AXES:
        held.setdefault((a, b), set()).add((row[a], row[b]))
  # The pairs a valid row can hold: search every row of the constrained axes' values
  # (the others are free: every pair with them is feasible if each value is).
  constrained = sorted({a for axes, _ in rules for a in axes},
                       key=list(oracle.TRAINING_AXES).index)
  feasible = {}
  for values in itertools.product(*(oracle.TRAINING_AXES[a] for a in constrained)):
    row = dict(zip(constrained, values))
    if all(p(*(row[a] for a in axes)) for axes, p in rules):
      for a, b in itertools.combinations(constrained, 2):
        feasible.setdefault((a, b), set()).add((row[a], row[b]))
  for (a, b), pairs in feasible.items():
    assert pairs <= held[(a, b)], (a, b, pairs - held[(a, b)])
  free = [a for a in oracle.TRAINING_AXES if a not in constrained]
  for a in free:
    for b in oracle.TRAINING_AXES:
      if a != b:
        want = {(x, y) for x in oracle.TRAINING_AXES[a] for y in oracle.TRAINING_AXES[b]}
        assert want <= held[(a, b)], (a, b, want - held[(a, b)])
