"""WarmupDecay: values against the formulas, serialization, argument checks."""

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
