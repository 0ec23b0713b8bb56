"""The measured choice between the compressed exchange and the dense all-reduces, float32
and bf16 (tf_adacomp/steps/choice.py, ``CompressedOptimizer(dense_when_faster=True)``).

- The schedule on a clock the test drives (one replica, eagerly): which exchanges are
  compressed, which dense and which bf16, what it decides from which periods, the early
  end of a dense or bf16 probe, near-ties going to dense, the re-probes and their
  doubling interval.
- ``model.fit`` on 2 replicas with short probes: every exchange runs, a dense step sends
  the float32 bytes (bf16 half) and leaves the residues alone, and with
  ``compressor="none"`` the wrapper still trains exactly as Keras does whichever
  exchange the clock picks.
- The arguments: refused where they cannot apply, each naming the argument.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp.steps import choice as choice_lib
from tf_adacomp.steps import variables as variables_lib

DEVICES = ["/cpu:0", "/cpu:1"]
PHASE = choice_lib.SETTLE + choice_lib.PROBE  # exchanges of one probe


def _choice(optimizer=None, bf16=False):
  optimizer = optimizer or keras.optimizers.SGD(0.1)
  reference = keras.Variable(np.zeros(3, np.float32), name="w")
  return choice_lib.Choice(variables_lib.Maker(optimizer), reference, bf16=bf16)


def _drive(choice, exchanges, compressed_s, dense_s, start=100.0, bf16_s=None):
  """Runs ``exchanges`` exchanges on a clock where a compressed exchange's period is
  ``compressed_s`` (a number, or a function of the exchange's index), a dense one's
  ``dense_s`` and a bf16 one's ``bf16_s``: returns the modes, "c", "d" or "b", in
  order."""
  now, modes = start, []
  cost = lambda c, k: c(k) if callable(c) else c  # noqa: E731
  for k in range(exchanges):
    kind = int(choice._schedule(tf.constant(now, tf.float64)))  # pylint: disable=protected-access
    modes.append("cdb"[kind])
    now += cost((compressed_s, dense_s, bf16_s)[kind], k)
  return "".join(modes)


def test_dense_is_chosen_where_it_is_faster():
  choice = _choice()
  modes = _drive(choice, 2 * PHASE + 5, compressed_s=0.030, dense_s=0.020)
  assert modes == "c" * PHASE + "d" * PHASE + "d" * 5
  described = choice_lib.describe(choice)
  assert described["exchange"] == "dense" and described["phase"] == "chosen"
  assert described["compressed_step_seconds"] == pytest.approx(0.030)
  assert described["dense_step_seconds"] == pytest.approx(0.020)


def test_compressed_is_kept_where_it_is_faster_and_probed_again_later_and_later():
  choice = _choice()
  first = 2 * PHASE + choice_lib.RECHECK
  # Dense 1.1x: the whole probe runs, and costs little (10 exchanges 10% slower).
  modes = _drive(choice, first + 2 * PHASE + 2 * choice_lib.RECHECK + 1,
                 compressed_s=0.010, dense_s=0.011)
  # Probes, the choice for RECHECK exchanges, probes again (the same answer), then the
  # choice for twice as long.
  assert modes == ("c" * PHASE + "d" * PHASE + "c" * choice_lib.RECHECK
                   + "c" * PHASE + "d" * PHASE + "c" * (2 * choice_lib.RECHECK + 1))
  assert int(choice.recheck.numpy()) == 2 * choice_lib.RECHECK
  assert choice_lib.describe(choice)["exchange"] == "compressed"


@pytest.mark.parametrize("dense_s,dense_steps", [(1.0, 1), (0.041, 1), (0.039, 2),
                                                (0.021, 2), (0.019, PHASE)])
def test_a_much_slower_dense_probe_ends_after_one_or_two_steps(dense_s, dense_steps):
  # Compressed 10 ms: dense above 4x (40 ms) ends after its first period, above 2x
  # after its second; closer than that, the whole probe.
  choice = _choice()
  modes = _drive(choice, PHASE + dense_steps + 5, compressed_s=0.010, dense_s=dense_s)
  assert modes == "c" * PHASE + "d" * dense_steps + "c" * 5
  described = choice_lib.describe(choice)
  assert described["dense_step_seconds"] == pytest.approx(dense_s)  # its last period


def test_near_a_tie_dense_wins_and_outliers_do_not_decide():
  choice = _choice()
  # Compressed 1% faster (inside the margin), with an evaluation-sized outlier in each
  # probe: the medians ignore them, and the exact exchange wins the near-tie.
  compressed = lambda k: 5.0 if k == 5 else 0.0099  # noqa: E731
  dense = lambda k: 5.0 if k == PHASE + 5 else 0.0100  # noqa: E731
  modes = _drive(choice, 2 * PHASE + 1, compressed_s=compressed, dense_s=dense)
  assert modes.endswith("d")
  described = choice_lib.describe(choice)
  assert described["compressed_step_seconds"] == pytest.approx(0.0099)
  assert described["dense_step_seconds"] == pytest.approx(0.0100)


# --- bf16, the third candidate ----------------------------------------------------------


def test_bf16_is_probed_after_dense_and_chosen_where_it_is_the_fastest():
  # Ahead, bf16 is chosen once the compressed and the dense exchange are probed again
  # (confirming).
  choice = _choice(bf16=True)
  modes = _drive(choice, 5 * PHASE + 5, compressed_s=0.030, dense_s=0.020, bf16_s=0.015)
  assert modes == ("c" * PHASE + "d" * PHASE + "b" * PHASE + "c" * PHASE + "d" * PHASE
                   + "b" * 5)
  described = choice_lib.describe(choice)
  assert described["exchange"] == "bf16" and described["phase"] == "chosen"
  assert described["compressed_step_seconds"] == pytest.approx(0.030)
  assert described["dense_step_seconds"] == pytest.approx(0.020)
  assert described["bf16_step_seconds"] == pytest.approx(0.015)


@pytest.mark.parametrize("compressed_s,dense_s,bf16_s,chosen", [
    (0.030, 0.0200, 0.0199, "d"),  # bf16 within the margin of dense: the exact one
    (0.030, 0.0200, 0.0190, "b"),  # 5% faster
    (0.0100, 0.0101, 0.0099, "d"),  # both lossy ones within the margin
    (0.010, 0.0150, 0.0100, "b"),  # a tie of the lossy ones: bf16 (nothing held back)
    (0.010, 0.0150, 0.0110, "c"),
])
def test_the_fastest_of_three_wins_and_near_dense_the_exact_one(compressed_s, dense_s,
                                                                bf16_s, chosen):
  choice = _choice(bf16=True)
  confirming = "c" * PHASE + "d" * PHASE if chosen == "b" else ""  # bf16 ahead
  modes = _drive(choice, 3 * PHASE + len(confirming) + 3, compressed_s=compressed_s,
                 dense_s=dense_s, bf16_s=bf16_s)
  assert modes == "c" * PHASE + "d" * PHASE + "b" * PHASE + confirming + chosen * 3


@pytest.mark.parametrize("slowed,chosen", [("c", "c"), ("d", "d")])
def test_a_probe_slowed_by_its_place_is_confirmed_before_bf16_wins(slowed, chosen):
  # The first probe of compressed (or dense) 30 ms a step (the run's first steps), then
  # 12 ms: bf16 (15 ms) looks faster, the confirming probes find the other faster.
  choice = _choice(bf16=True)
  first, later = (0, PHASE) if slowed == "c" else (PHASE, 2 * PHASE)
  slow = lambda k: 0.030 if first <= k < later else 0.012  # noqa: E731
  other = 0.020 if slowed == "c" else 0.025
  modes = _drive(choice, 5 * PHASE + 3, compressed_s=slow if slowed == "c" else other,
                 dense_s=slow if slowed == "d" else other, bf16_s=0.015)
  assert modes == ("c" * PHASE + "d" * PHASE + "b" * PHASE + "c" * PHASE + "d" * PHASE
                   + chosen * 3)
  described = choice_lib.describe(choice)
  assert described["exchange"] == {"c": "compressed", "d": "dense"}[chosen]
  assert described["phase"] == "chosen"
  assert described[{"c": "compressed", "d": "dense"}[slowed] + "_step_seconds"] == (
      pytest.approx(0.012))


@pytest.mark.parametrize("bf16_s,bf16_steps", [(0.041, 1), (0.021, 2), (0.019, PHASE)])
def test_a_much_slower_bf16_probe_ends_after_one_or_two_steps(bf16_s, bf16_steps):
  # Measured against the faster of the two before it (compressed, 10 ms): above 4x
  # (a bf16 cast that costs more than it saves) after its first period, above 2x after
  # its second.
  choice = _choice(bf16=True)
  modes = _drive(choice, 2 * PHASE + bf16_steps + 3, compressed_s=0.010, dense_s=0.012,
                 bf16_s=bf16_s)
  assert modes == "c" * PHASE + "d" * PHASE + "b" * bf16_steps + "ccc"
  assert choice_lib.describe(choice)["bf16_step_seconds"] == pytest.approx(bf16_s)


def test_no_bf16_probe_where_dense_lost_clearly():
  # A bf16 step is at least half a dense one (the same compute, half the bytes): where
  # dense took over 4 (or 2) compressed steps, bf16 takes over 2 (or 1).
  choice = _choice(bf16=True)
  modes = _drive(choice, PHASE + 6, compressed_s=0.010, dense_s=0.050, bf16_s=0.001)
  assert modes == "c" * PHASE + "d" + "c" * 5
  assert choice_lib.describe(choice)["bf16_step_seconds"] is None
  choice = _choice(bf16=True)
  choice.scouted.assign(0.041)  # the scouts skip the dense probe
  modes = _drive(choice, PHASE + 3, compressed_s=0.010, dense_s=1000.0, bf16_s=0.001)
  assert modes == "c" * (PHASE + 3)


def test_the_probes_come_back_as_late_as_their_cost_says():
  # bf16 chosen (5 ms): the two compressed probes' 20 steps cost 5 ms each over it, the
  # two dense probes' 20 steps 10 ms each: 60 bf16 steps of extra time, 2% of 3,000.
  choice = _choice(bf16=True)
  _drive(choice, 5 * PHASE + 1, compressed_s=0.010, dense_s=0.015, bf16_s=0.005)
  assert choice_lib.describe(choice)["exchange"] == "bf16"
  assert choice_lib.describe(choice)["phase"] == "chosen"
  assert abs(int(choice.recheck.numpy()) - 3000) <= 1


def test_the_choice_changes_when_the_costs_do():
  choice = _choice()
  # The dense probe ends after one exchange; the choice runs from the next one on.
  switch = PHASE + 1 + choice_lib.RECHECK
  # Compressed is faster until the link gets fast (dense cheap) at the re-probe.
  # (4.5x at first: the dense probe ends after one step, whose 3.5 extra compressed
  # steps are less than 2% of RECHECK.)
  dense = lambda k: 0.045 if k < switch else 0.005  # noqa: E731
  modes = _drive(choice, switch + 2 * PHASE + 3, compressed_s=0.010, dense_s=dense)
  assert modes[:switch] == "c" * PHASE + "d" + "c" * choice_lib.RECHECK
  assert modes[switch:] == "c" * PHASE + "d" * PHASE + "ddd"
  # A new choice: not doubled, but its probe's 10 compressed exchanges took twice the
  # dense one's time each: 10 extra dense steps, 2% of 500.
  assert abs(int(choice.recheck.numpy()) - 500) <= 1  # (float rounding of the periods)


def test_a_costly_probe_comes_back_rarely():
  # A slow link (a dense step 64 times a compressed one; the wide MLP over 10 Mbit/s is
  # near 60): one dense step, worth 63 compressed ones of extra time, then 3,150
  # exchanges, so that the next probe costs 2% of the time until it.
  choice = _choice()
  _drive(choice, PHASE + 2, compressed_s=0.25, dense_s=16.0)
  assert abs(int(choice.recheck.numpy()) - 3150) <= 1
  assert choice_lib.describe(choice)["exchange"] == "compressed"


def test_between_probes_a_step_moves_only_the_count():
  # Nearly every step falls between a decision and the next probe: there the schedule
  # records no period and touches nothing but the count (its other ops made the
  # default's dense step slower than Keras'). The re-probe after such steps is
  # test_compressed_is_kept_where_it_is_faster_and_probed_again_later_and_later's.
  choice = _choice()
  assert _drive(choice, 2 * PHASE + 1, compressed_s=0.030, dense_s=0.020).endswith("d")
  state = {name: getattr(choice, name).numpy().copy() for name in (
      "phase", "chosen", "recheck", "periods", "medians", "last_time", "scouted")}
  count = int(choice.count.numpy())
  assert _drive(choice, 5, compressed_s=0.030, dense_s=0.020, start=1e4) == "d" * 5
  assert int(choice.count.numpy()) == count + 5
  for name, value in state.items():
    np.testing.assert_array_equal(getattr(choice, name).numpy(), value, err_msg=name)


def test_a_restored_probe_does_not_count_the_time_between_the_save_and_the_restore():
  # Saved after the dense probe's first exchange (dense 20 ms, compressed 30 ms),
  # restored 10,000 s later: the restored schedule goes on with the dense probe, as
  # if nothing had happened between. (The time of the last exchange, were it restored,
  # would make one period of 10,000 s, a dense probe "4x slower" ended at once.)
  saved_optimizer, restored_optimizer = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
  saved = _choice(saved_optimizer)
  assert _drive(saved, PHASE + 1, compressed_s=0.030, dense_s=0.020) == "c" * PHASE + "d"
  store = {}
  saved_optimizer.save_own_variables(store)
  restored = _choice(restored_optimizer)
  restored_optimizer.load_own_variables(store)
  modes = _drive(restored, PHASE - 1 + 5, compressed_s=0.030, dense_s=0.020, start=1e4)
  assert modes == "d" * (PHASE - 1) + "d" * 5
  described = choice_lib.describe(restored)
  assert described["phase"] == "chosen" and described["exchange"] == "dense"
  assert described["dense_step_seconds"] == pytest.approx(0.020)



@pytest.mark.parametrize("before_bf16", [False, True])
def test_a_checkpoint_restores_the_choice_by_name(tmp_path, before_bf16):
  # tf.train.Checkpoint matches the wrapper's variables by name (CompressedOptimizer.
  # _trackable_children): the choice's state is under exchange_choice_state, so a probe
  # under way resumes where it was. One written before bf16 was a candidate (without
  # its variables) restores the rest, and bf16's stay unmeasured.
  def compiled():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input([4]), keras.layers.Dense(2)])
    model.compile(tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    return model

  def state(optimizer):
    return {v.path.rsplit("/", 1)[-1].split("exchange_choice_")[-1]: v.numpy()
            for v in optimizer.variables if "exchange_choice_" in v.path}

  model = compiled()
  rng = np.random.default_rng(0)
  model.fit(rng.random((24, 4)), rng.random((24, 2)), batch_size=4, verbose=0)
  saved = state(model.optimizer)
  assert saved["count"] == 6 and set(saved) == {
      "phase", "count", "chosen", "recheck", "periods", "medians", "scouted", "last_dense",
      "bf16_periods", "bf16_median"}
  if before_bf16:
    model.optimizer._choice.bf16_periods.assign(np.ones(choice_lib.PROBE))  # pylint: disable=protected-access
    del model.optimizer.exchange_choice_state.bf16_periods
    del model.optimizer.exchange_choice_state.bf16_median
  path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
  resumed = compiled()
  tf.train.Checkpoint(model=resumed).restore(path)
  resumed.optimizer.build(resumed.trainable_variables)
  restored = state(resumed.optimizer)
  assert set(restored) == set(saved)
  for name, value in saved.items():
    if before_bf16 and name.startswith("bf16_"):
      value = np.zeros_like(value)  # not in the checkpoint: as built
    np.testing.assert_array_equal(restored[name], value, err_msg=name)

def _drive_scouted(choice, exchanges, compressed_s, scouted_s):
  """``_drive`` where every scout estimated a dense exchange at ``scouted_s``."""
  choice.scouted.assign(scouted_s)
  return _drive(choice, exchanges, compressed_s, dense_s=1000.0)


def test_a_scout_that_finds_the_link_slow_skips_the_dense_probe():
  # Compressed 10 ms; a dense exchange estimated at 41 ms (over 4x): no dense step at
  # all, and the next probe is pushed out by what its two scouts cost (2 x 41/16 ms,
  # 0.51 compressed steps: under RECHECK).
  choice = _choice()
  modes = _drive_scouted(choice, PHASE + 3, compressed_s=0.010, scouted_s=0.041)
  assert modes == "c" * (PHASE + 3)
  described = choice_lib.describe(choice)
  assert described["phase"] == "chosen" and described["exchange"] == "compressed"
  assert described["dense_step_seconds"] == pytest.approx(0.041)
  assert described["scouted_dense_seconds"] == pytest.approx(0.041)
  assert int(choice.recheck.numpy()) == choice_lib.RECHECK
  # 39 ms (under 4x): the dense probe runs as without a scout (and ends after its first
  # step, a period of 1000 s here).
  choice = _choice()
  modes = _drive_scouted(choice, PHASE + 3, compressed_s=0.010, scouted_s=0.039)
  assert modes == "c" * PHASE + "d" + "cc"


def test_a_very_slow_link_is_probed_again_only_when_the_scouts_are_worth_it():
  # A dense exchange estimated at 16 s against 0.25 s compressed: the probe's scouts
  # cost 2 x 1 s, 8 compressed steps, at most 2% of the time until the next probe.
  choice = _choice()
  _drive_scouted(choice, PHASE + 2, compressed_s=0.25, scouted_s=16.0)
  assert abs(int(choice.recheck.numpy()) - 400) <= 1


@pytest.mark.parametrize("seed", range(20))
def test_the_median_is_numpys_upper_median(seed):
  rng = np.random.default_rng(seed)
  values = rng.choice([0.5, 1.0, 2.0, 3.0], size=8) if seed % 2 else rng.exponential(size=8)
  got = float(choice_lib._median(tf.constant(values, tf.float64)))  # pylint: disable=protected-access
  assert got == np.sort(values)[len(values) // 2]


# --- In model.fit, on 2 replicas ---------------------------------------------------------


@pytest.fixture
def short_probes(monkeypatch):
  """Probes of 1 settling and 2 counted periods, re-probed every 4 exchanges: both
  exchanges run within a few steps (read when the optimizer is built)."""
  monkeypatch.setattr(choice_lib, "SETTLE", 1)
  monkeypatch.setattr(choice_lib, "PROBE", 2)
  monkeypatch.setattr(choice_lib, "RECHECK", 4)
  monkeypatch.setattr(choice_lib, "RECHECK_MAX", 4)
  # The scouts run, but never estimate: CPU jitter must not skip these tests' dense probes.
  monkeypatch.setattr(choice_lib, "SCOUT_MIN_SECONDS", float("inf"))


@pytest.fixture
def full_dense_probes(short_probes, monkeypatch):
  """``short_probes`` whose dense probe is never ended early: on a loaded machine a dense
  step looked 2x slower and the probe ran "ddc" where a test expects "ddd"."""
  del short_probes
  monkeypatch.setattr(choice_lib, "EARLY_FACTORS",
                      {k: float("inf") for k in choice_lib.EARLY_FACTORS})


def _data(steps, batch=8):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(steps * batch, 5)).astype("float32")
  y = rng.integers(0, 3, size=steps * batch)
  return x, y


def _fit(optimizer_fn, steps, callbacks=()):
  """``model.fit`` on 2 replicas: ``(weights, optimizer, per-step record or None)``."""
  strategy = tf.distribute.MirroredStrategy(DEVICES)
  keras.utils.set_random_seed(3)
  with strategy.scope():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    optimizer = optimizer_fn()
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  x, y = _data(steps)
  record = _Steps(optimizer) if isinstance(optimizer, tf_adacomp.CompressedOptimizer) else None
  model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
            callbacks=([record] if record else []) + list(callbacks))
  return [w.numpy() for w in model.weights], optimizer, record


class _Steps(keras.callbacks.Callback):
  """Per step: the exchange it ran ("c"/"d"), its bytes and the residues after it."""

  def __init__(self, optimizer):
    super().__init__()
    self.optimizer, self.modes, self.bytes, self.residues = optimizer, [], [], []

  def on_train_batch_end(self, batch, logs=None):
    choice = self.optimizer.exchange_choice()
    self.modes.append(choice["exchange"][0] if choice else "c")
    self.bytes.append(int(self.optimizer.bytes_sent.numpy().sum()))
    self.residues.append([x.numpy().copy() for r in self.optimizer.residues for x in r])


def test_fit_runs_every_exchange_and_a_dense_step_keeps_the_residues(full_dense_probes):
  del full_dense_probes
  _, _, steps = _fit(lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.SGD(0.05), compressor="adacomp",
      dense_when_faster=True), steps=14)
  assert steps.modes[:9] == list("cccdddbbb")  # the probes
  dense_bytes = 4 * (5 * 3 + 3)
  for k, mode in enumerate(steps.modes):
    if mode in "db":  # float32, or bf16's half
      assert steps.bytes[k] == dense_bytes // (2 if mode == "b" else 1), (
          k, steps.modes, steps.bytes)
      for before, after in zip(steps.residues[k - 1], steps.residues[k]):
        np.testing.assert_array_equal(after, before)  # nothing held back
    else:
      assert 0 < steps.bytes[k] < dense_bytes, (k, steps.modes, steps.bytes)


def test_rounds_take_every_exchange_and_a_bf16_round_sends_half(full_dense_probes):
  # Local steps: the choice takes each round's exchange (Choice.exchange), whose bytes
  # are counted at the round's end.
  del full_dense_probes
  _, _, steps = _fit(lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.SGD(0.05), compressor="adacomp", local_steps=2,
      dense_when_faster=True), steps=24)
  ends = [k for k in range(24) if k % 2 == 1]  # a round's end, every second step
  assert "".join(steps.modes[k] for k in ends[:9]) == "cccdddbbb"
  dense_bytes = 4 * (5 * 3 + 3)
  for k in ends:
    if steps.modes[k] in "db":
      assert steps.bytes[k] == dense_bytes // (2 if steps.modes[k] == "b" else 1), (
          k, steps.modes, steps.bytes)


def test_float32_alone_never_rounds(full_dense_probes):
  del full_dense_probes
  _, optimizer, steps = _fit(lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.SGD(0.05), compressor="adacomp", dense_when_faster="float32"),
      steps=10)
  assert steps.modes[:6] == list("cccddd") and "b" not in steps.modes
  assert optimizer.exchange_choice()["bf16_step_seconds"] is None


def test_bf16_sums_the_rounded_values_and_counts_their_bytes():
  strategy = tf.distribute.MirroredStrategy(DEVICES)
  rng = np.random.default_rng(0)
  values = [rng.normal(size=(2, 7)).astype(np.float32),
            rng.normal(size=(2, 5)).astype(np.float16)]

  def replica():
    replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
    own = [tf.gather(tf.constant(v), replica_id) for v in values]
    return choice_lib._dense_sums(  # pylint: disable=protected-access
        tf.distribute.get_replica_context(), own, bf16=True)

  sums, nbytes = tf.function(lambda: strategy.run(replica))()
  rounded = values[0].astype(tf.bfloat16.as_numpy_dtype).astype(np.float32)
  # Summed in bfloat16: the rounded values' sum, rounded once more.
  want = rounded.sum(0).astype(tf.bfloat16.as_numpy_dtype).astype(np.float32)
  for got in strategy.experimental_local_results(sums[0]):
    assert got.dtype == tf.float32
    np.testing.assert_array_equal(got.numpy(), want)
    assert not np.array_equal(got.numpy(), values[0].sum(0))
  for got in strategy.experimental_local_results(sums[1]):  # float16: as it was
    assert got.dtype == tf.float16
    np.testing.assert_array_equal(got.numpy(), values[1].sum(0))
  assert [int(strategy.experimental_local_results(n)[0]) for n in nbytes] == [2 * 7, 2 * 5]


@pytest.mark.parametrize("exchange", ["updates", "gradients"])
def test_with_nothing_compressed_it_trains_as_keras_whatever_it_chooses(short_probes,
                                                                       exchange):
  del short_probes
  got, _, steps = _fit(lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.SGD(0.05, momentum=0.9), compressor="none", exchange=exchange,
      dense_when_faster=True), steps=12)
  assert "c" in steps.modes and "d" in steps.modes
  want, _, _ = _fit(lambda: keras.optimizers.SGD(0.05, momentum=0.9), steps=12)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)


def test_adam_inside_local_steps_trains_alike_whichever_exchange_a_round_takes(short_probes):
  # The default second moment with local steps (each replica's estimate of the global
  # batch's), under the choice: with nothing compressed, a round's dense exchange and
  # its "compressed" one are the same mean.
  del short_probes

  def make(choose):
    return lambda: tf_adacomp.CompressedOptimizer(
        keras.optimizers.Adam(0.01), compressor="none", local_steps=2,
        dense_when_faster=choose)

  got, optimizer, steps = _fit(make(True), steps=24)
  assert optimizer.second_moment == "global"
  assert "c" in steps.modes and "d" in steps.modes
  want, _, _ = _fit(make(False), steps=24)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)


def test_in_fit_the_scouts_estimate_decides_for_every_replica(short_probes, monkeypatch):
  # The scout replaced by one that estimates 1,000 s on replica 0 and 0 (no estimate)
  # on replica 1: their mean, 500 s, skips the dense probe on both.
  del short_probes
  sent = []

  def scout(ready, nbytes):
    sent.append(nbytes)
    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
    return tf.where(tf.equal(replica, 0), tf.constant(1000.0, tf.float64), 0.0)

  monkeypatch.setattr(choice_lib, "_scout", scout)
  _, optimizer, steps = _fit(lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.SGD(0.05), compressor="adacomp", dense_when_faster=True), steps=8)
  assert steps.modes == list("cccccccc")
  described = optimizer.exchange_choice()
  assert described["dense_step_seconds"] == pytest.approx(500.0)
  assert described["scouted_dense_seconds"] == pytest.approx(500.0)
  assert set(sent) == {4 * (5 * 3 + 3) // choice_lib.SCOUT_FRACTION}  # a dense step's 1/16
  # The first exchange scouted (SETTLE=1 here): its bytes are the compressed exchange's
  # and the scout's two all-reduces (a float32 scalar, 4 bytes of zeros).
  _, _, plain = _fit(lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.SGD(0.05), compressor="adacomp", dense_when_faster=False), steps=2)
  assert steps.bytes[0] == plain.bytes[0] + 4 + 4


def test_a_scout_of_many_bytes_estimates_a_dense_exchange():
  # 2 replicas on one host: 64 MB of zeros take well past the latency and 5 ms, and the
  # estimate is SCOUT_FRACTION times such a transfer (more than 4 times one timed here).
  strategy = tf.distribute.MirroredStrategy(DEVICES)
  nbytes = 64 << 20

  def scout_then_transfer():
    estimate = choice_lib._scout([tf.zeros([1])], nbytes)  # pylint: disable=protected-access
    with tf.control_dependencies([estimate]):
      start = tf.timestamp()
    with tf.control_dependencies([start]):
      done = tf.distribute.get_replica_context().all_reduce(
          tf.distribute.ReduceOp.SUM, tf.zeros([nbytes // 4]))
    with tf.control_dependencies([done]):
      return estimate, tf.timestamp() - start

  results = tf.function(lambda: strategy.run(scout_then_transfer))()
  for estimate, transfer in zip(*[strategy.experimental_local_results(r) for r in results]):
    assert float(estimate) > max(4 * float(transfer), 8 * choice_lib.SCOUT_MIN_SECONDS), (
        float(estimate), float(transfer))


def test_a_dense_step_clips_each_replicas_gradient_as_a_compressed_step_does(short_probes):
  # With nothing compressed and SGD (linear), a step of the update exchange on the
  # replicas' clipped gradients and Keras' dense step on their sum are the same step.
  del short_probes

  def wrapper(**kwargs):
    return lambda: tf_adacomp.CompressedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), compressor="none", local_clipnorm=0.05,
        **kwargs)

  got, _, steps = _fit(wrapper(dense_when_faster=True), steps=8)
  assert "d" in steps.modes
  want, _, _ = _fit(wrapper(), steps=8)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)


def _copies(variable):
  """Each replica's copy of a Keras variable, as NumPy arrays."""
  return [v.numpy() for v in variable.value.values]


def test_dense_steps_start_from_the_replicas_mean_state_and_keep_them_equal(full_dense_probes):
  # The update exchange: 3 compressed steps leave each replica its own momentum; the 3
  # dense steps after them start from their mean, so the momenta stay equal (Keras'
  # dense step, the same on every replica).
  del full_dense_probes
  _, optimizer, steps = _fit(lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.SGD(0.05, momentum=0.9), compressor="adacomp",
      dense_when_faster=True), steps=6)
  assert steps.modes == list("cccddd")
  momenta = [v for v in optimizer.inner_optimizer.variables if "momentum" in v.path]
  assert momenta
  for variable in momenta:
    first, second = _copies(variable)
    np.testing.assert_array_equal(first, second)
    assert np.any(first != 0)


def test_adams_dense_exchange_keeps_each_replicas_own_moments(full_dense_probes):
  # Adam's default every step (each replica divides by its own estimate of the global
  # batch's second moment): the choice takes the exchange, not the whole step. A dense
  # step is the mean of the replicas' own Adam steps, and each keeps its own moments.
  # Keras' dense Adam step instead would divide by the replicas' mean second moment,
  # which holds R times the global batch's noise: on the character LSTM it ended 1.96
  # points below Keras' Adam where this is 0.45 above (docs/convergence.md).
  del full_dense_probes
  _, optimizer, steps = _fit(lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.Adam(0.01), compressor="adacomp", dense_when_faster=True), steps=6)
  assert optimizer.second_moment_interval == 0
  assert steps.modes == list("cccddd")
  assert steps.bytes[-1] == 4 * (5 * 3 + 3)  # a dense exchange
  moments = [v for v in optimizer.inner_optimizer.variables
             if "momentum" in v.path or "velocity" in v.path]
  assert len(moments) == 4
  for variable in moments:
    first, second = _copies(variable)
    assert not np.array_equal(first, second)


def test_compression_stats_logs_each_decision(full_dense_probes, caplog, monkeypatch):
  del full_dense_probes
  # No probe after the decision: the last line is the choice the run ends with.
  monkeypatch.setattr(choice_lib, "RECHECK", 100)
  monkeypatch.setattr(choice_lib, "RECHECK_MAX", 100)
  with caplog.at_level(logging.INFO, logger="tf_adacomp"):
    _, optimizer, steps = _fit(lambda: tf_adacomp.CompressedOptimizer(
        keras.optimizers.SGD(0.05), dense_when_faster=True), steps=18,
        callbacks=[tf_adacomp.CompressionStats()])
  lines = [r.getMessage() for r in caplog.records if "dense_when_faster" in r.getMessage()]
  assert lines, steps.modes
  choice = optimizer.exchange_choice()
  assert f"the {choice['exchange']} exchange" in lines[-1]
  assert f"{1e3 * choice['dense_step_seconds']:.1f} ms dense" in lines[-1]
  assert f"{1e3 * choice['bf16_step_seconds']:.1f} ms bf16" in lines[-1]


# --- Arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,named", [
    ({"dense_when_faster": 1}, "dense_when_faster=1"),
    ({"dense_when_faster": "bf16"}, "dense_when_faster='bf16'"),
    ({"dense_when_faster": "float32", "start_step": 5}, "start_step=5"),
    ({"dense_when_faster": True, "reduction": "adasum"}, "reduction='adasum'"),
    ({"dense_when_faster": True, "start_step": 5}, "start_step=5"),
    ({"dense_when_faster": True, "momentum_masking": True}, "momentum_masking=True"),
])
def test_refused_where_it_cannot_apply(kwargs, named):
  with pytest.raises(ValueError, match="dense_when_faster") as error:
    tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), **kwargs)
  assert named in str(error.value)


@pytest.mark.parametrize("kwargs,on", [
    ({}, True),  # the default: on wherever it applies
    ({"dense_when_faster": True}, True),
    ({"dense_when_faster": False}, False),
    ({"dense_when_faster": "float32"}, "float32"),
    ({"compressor": "none"}, False),  # nothing to choose between
    ({"compressor": "none", "dense_when_faster": True}, True),
    ({"reduction": "adasum"}, False),
    ({"start_step": 5}, False),
    ({"momentum_masking": True}, False),
])
def test_on_by_default_wherever_it_applies(kwargs, on):
  wrapper = tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), **kwargs)
  assert wrapper.dense_when_faster == on and type(wrapper.dense_when_faster) is type(on)
  config = wrapper.get_config()
  assert config["dense_when_faster"] == on
  assert tf_adacomp.CompressedOptimizer.from_config(config).dense_when_faster == on
  assert wrapper.exchange_choice() is None  # not built
  wrapper.build([keras.Variable(np.zeros(3, np.float32))])
  assert (wrapper.exchange_choice() is not None) is bool(on)
  assert any("exchange_choice" in v.path for v in wrapper.variables) is bool(on)
  # The time of the last exchange is not saved (restored, it would span the gap).
  assert not any("last_time" in v.path for v in wrapper.variables)
