"""WarmupDecay and LEGW: values against the formulas, serialization, argument checks."""

import math

import keras
import numpy as np
import pytest

from tf_adacomp import schedules


def _values(schedule, steps):
  return np.array([float(schedule(step)) for step in steps])


def test_linear_warmup_then_constant():
  schedule = schedules.WarmupDecay(0.4, total_steps=100, warmup_steps=10)
  np.testing.assert_allclose(_values(schedule, [0, 4, 9, 10, 99]),
                             [0.04, 0.2, 0.4, 0.4, 0.4], rtol=1e-6)


def test_cosine_reaches_zero_at_the_end():
  schedule = schedules.WarmupDecay(1.0, total_steps=110, warmup_steps=10, decay="cosine")
  expected = [0.5 * (1 + math.cos(math.pi * (s - 10) / 100)) for s in (10, 35, 60, 110)]
  np.testing.assert_allclose(_values(schedule, [10, 35, 60, 110]), expected, atol=1e-6)


def test_step_decay_at_half_and_three_quarters():
  schedule = schedules.WarmupDecay(0.1, total_steps=100, decay="step")
  np.testing.assert_allclose(_values(schedule, [0, 49, 50, 74, 75, 99]),
                             [0.1, 0.1, 0.01, 0.01, 0.001, 0.001], rtol=1e-6)


def test_round_trips_through_keras_serialization():
  schedule = schedules.WarmupDecay(0.2, total_steps=50, warmup_steps=5, decay="cosine")
  restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
  np.testing.assert_allclose(_values(restored, range(50)), _values(schedule, range(50)))


@pytest.mark.parametrize("kwargs,match", [
    ({"peak": 0.0}, "peak=0.0"), ({"peak": math.nan}, "peak=nan"),
    ({"total_steps": 0}, "total_steps=0"), ({"warmup_steps": -1}, "warmup_steps=-1"),
    ({"warmup_steps": 11}, "warmup_steps=11"), ({"decay": "poly"}, "decay='poly'")])
def test_bad_arguments_are_named(kwargs, match):
  arguments = dict(peak=0.1, total_steps=10)
  arguments.update(kwargs)
  with pytest.raises(ValueError, match=match):
    schedules.WarmupDecay(**arguments)


# --- LEGW ----------------------------------------------------------------------------

BASE = dict(base_learning_rate=0.1, base_batch_size=128, batch_size=512, base_warmup_epochs=1,
            steps_per_epoch=10, total_epochs=20)


def _legw_reference(step, base_learning_rate, base_batch_size, batch_size, base_warmup_epochs,
                    steps_per_epoch, total_epochs, decay="poly", power=2.0, decay_rate=0.1,
                    decay_epochs=None, boundaries=None, step_factor=0.1,
                    end_learning_rate=0.0):
  """The paper's rule in plain Python, step by step (0-based, as WarmupDecay)."""
  k = batch_size / base_batch_size
  peak = math.sqrt(k) * base_learning_rate
  warm = round(k * base_warmup_epochs * steps_per_epoch)
  total = round(total_epochs * steps_per_epoch)
  step = min(step, total)
  if step < warm:
    return peak * (step + 1) / warm
  if decay == "poly":
    fraction = (step - warm) / max(total - warm, 1)
    return end_learning_rate + (peak - end_learning_rate) * (1 - fraction) ** power
  if decay == "exponential":
    span = decay_epochs * steps_per_epoch if decay_epochs else max(total - warm, 1)
    return peak * decay_rate ** ((step - warm) / span)
  epochs = boundaries or (total_epochs / 2, total_epochs * 3 / 4)
  return peak * step_factor ** sum(step >= round(b * steps_per_epoch) for b in epochs)


@pytest.mark.parametrize("kwargs", [
    {}, {"power": 1.0, "end_learning_rate": 0.01},
    {"decay": "exponential"}, {"decay": "exponential", "decay_rate": 0.5, "decay_epochs": 2.5},
    {"decay": "step"}, {"decay": "step", "boundaries": [4, 12.5, 18], "step_factor": 0.2},
    {"batch_size": 96, "base_warmup_epochs": 1.5},  # k = 0.75 < 1, 1.125 epochs of warm-up
    {"base_warmup_epochs": 0}, {"base_warmup_epochs": 5}])  # none; all 20 epochs
def test_legw_matches_the_formula_at_every_step(kwargs):
  arguments = dict(BASE, **kwargs)
  schedule = schedules.LEGW(**arguments)
  steps = np.arange(schedule.total_steps + 30)
  expected = [_legw_reference(int(s), **arguments) for s in steps]
  np.testing.assert_allclose(np.asarray(schedule(steps)), expected, rtol=1e-5, atol=1e-7)
  # A scalar step, as the optimizer passes it, gives the same.
  np.testing.assert_allclose(float(schedule(37)), expected[37], rtol=1e-5)


def test_legw_warmup_takes_the_same_iterations_at_four_times_the_batch():
  """The paper's consequence: k times the epochs of 1/k the steps each."""
  examples = 10240
  base = schedules.LEGW(0.1, 128, 128, 2, examples // 128, 10)
  large = schedules.LEGW(0.1, 128, 512, 2, examples // 512, 10)
  assert base.warmup_steps == large.warmup_steps == 160
  assert large.peak_learning_rate == pytest.approx(2 * base.peak_learning_rate)
  ramp = np.arange(160)
  np.testing.assert_allclose(np.asarray(large(ramp)), 2 * np.asarray(base(ramp)), rtol=1e-6)


@pytest.mark.parametrize("batch_size", [32, 128, 384, 1024])  # k = 0.25, 1, 3, 8
def test_legw_peak_is_sqrt_k_times_the_base_rate_and_the_ramp_is_monotone(batch_size):
  schedule = schedules.LEGW(0.1, 128, batch_size, 0.5, 10, 8)
  peak = math.sqrt(batch_size / 128) * 0.1
  assert schedule.peak_learning_rate == pytest.approx(peak)
  assert schedule.warmup_steps == round(batch_size / 128 * 0.5 * 10)
  values = np.asarray(schedule(np.arange(schedule.total_steps)))
  warm = schedule.warmup_steps
  assert values[0] > 0 and np.all(np.diff(values[:warm]) > 0)  # step 0 already learns
  assert values[warm - 1] == pytest.approx(peak) and values.max() == pytest.approx(peak)
  assert np.all(np.diff(values[warm:]) <= 0)


@pytest.mark.parametrize("decay", schedules.LEGW_DECAYS)
def test_legw_holds_the_final_value_after_the_end(decay):
  schedule = schedules.LEGW(**BASE, decay=decay, end_learning_rate=0.001)
  total = schedule.total_steps
  assert total == 200
  after = np.asarray(schedule(np.array([total, total + 1, 10 * total])))
  np.testing.assert_allclose(after, after[0])
  assert float(schedule(total - 1)) >= after[0]


def test_legw_round_trips_through_keras_serialization_and_a_saved_optimizer():
  schedule = schedules.LEGW(**BASE, decay="step", boundaries=(5, 10, 15), step_factor=0.5)
  restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
  assert isinstance(restored, schedules.LEGW) and restored.get_config() == schedule.get_config()
  steps = np.arange(220)
  np.testing.assert_allclose(np.asarray(restored(steps)), np.asarray(schedule(steps)))
  optimizer = keras.optimizers.SGD(schedules.LEGW(**BASE, decay="exponential", decay_epochs=3))
  again = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
  assert again.get_config()["learning_rate"] == optimizer.get_config()["learning_rate"]
  assert again.get_config()["learning_rate"]["class_name"] == "LEGW"


@pytest.mark.parametrize("kwargs,match", [
    ({"base_learning_rate": 0.0}, "base_learning_rate=0.0"),
    ({"base_learning_rate": math.inf}, "base_learning_rate=inf"),
    ({"base_batch_size": 0}, "base_batch_size=0"), ({"batch_size": 64.5}, "batch_size=64.5"),
    ({"batch_size": True}, "batch_size=True"),
    ({"base_warmup_epochs": -1}, "base_warmup_epochs=-1"),
    ({"steps_per_epoch": 0}, "steps_per_epoch=0"), ({"total_epochs": 0}, "total_epochs=0"),
    ({"total_epochs": 0.01}, "total_epochs=0.01"),  # not one step
    ({"decay": "cosine"}, "decay='cosine'"), ({"power": -2.0}, "power=-2.0"),
    ({"decay_rate": 1.5}, "decay_rate=1.5"), ({"decay_epochs": 0}, "decay_epochs=0"),
    ({"boundaries": [10, 5]}, r"boundaries=\[10, 5\]"),
    ({"boundaries": [2, 30]}, r"boundaries=\[2, 30\]"),  # after total_epochs
    ({"boundaries": [1]}, r"boundaries=\[1\]"),  # inside the 4-epoch warm-up
    ({"boundaries": 5}, "boundaries=5"), ({"boundaries": []}, r"boundaries=\[\]"),
    ({"decay": "step", "base_warmup_epochs": 3}, "boundaries=None"),  # 12 epochs > 50%
    ({"step_factor": 0.0}, "step_factor=0.0"),
    ({"end_learning_rate": 0.5}, "end_learning_rate=0.5"),  # above the peak, 0.2
    ({"end_learning_rate": -0.1}, "end_learning_rate=-0.1")])
def test_legw_bad_arguments_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    schedules.LEGW(**dict(BASE, **kwargs))


def test_legw_warmup_longer_than_the_run_names_its_arguments():
  # 2 base warm-up epochs x k=8 = 16 epochs > 10.
  with pytest.raises(ValueError, match="base_warmup_epochs=2, batch_size=1024, "
                                       "base_batch_size=128, total_epochs=10"):
    schedules.LEGW(0.1, 128, 1024, 2, 10, 10)


def test_legw_is_an_sgd_learning_rate_in_fit():
  schedule = schedules.LEGW(0.05, 8, 16, 1, 4, 2)  # k=2: 8 warm-up steps, 8 in all
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
  x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
  model.fit(x, x.sum(axis=1), batch_size=16, epochs=1, steps_per_epoch=4, verbose=0)
  assert int(model.optimizer.iterations) == 4
  assert float(model.optimizer.learning_rate) == pytest.approx(float(schedule(4)))
  assert float(schedule(4)) == pytest.approx(schedule.peak_learning_rate * 5 / 8)
