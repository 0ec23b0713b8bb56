"""benchmarks/timing.py: StepTimer times every step of model.fit."""

import keras
import numpy as np
import pytest

import benchmark_scripts  # noqa: F401  (benchmarks/ on sys.path)
import timing


def test_step_timer_times_every_step_and_skips_the_first():
  model = keras.Sequential([keras.Input([4]), keras.layers.Dense(2)])
  model.compile(optimizer="sgd", loss="mse")
  timer = timing.StepTimer(skip=2)
  x = np.ones([40, 4], np.float32)
  model.fit(x, np.zeros([40, 2]), batch_size=8, epochs=1, verbose=0, callbacks=[timer])
  assert len(timer.times) == 5 and all(t > 0 for t in timer.times)
  assert timer.median() == sorted(timer.times[2:])[1]


def test_step_timer_without_timed_steps_names_the_skip():
  timer = timing.StepTimer(skip=3)
  timer.times = [0.1, 0.2]
  with pytest.raises(ValueError, match="skip=3"):
    timer.median()
