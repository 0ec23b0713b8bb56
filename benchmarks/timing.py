"""Step times of ``model.fit``, as the benchmarks measure them."""

import statistics
import time

import keras


class StepTimer(keras.callbacks.Callback):
  """Records the wall time of every training step (batch begin to batch end).

  The end waits for the step's result (reads the optimizer's step counter), so
  asynchronous execution cannot hide any of it; whatever other callbacks do between
  steps (evaluations, logging) is not counted. The first ``skip`` steps (XLA
  compilation) are kept in ``times`` but left out of ``median()``.

  Args:
    skip: steps at the start left out of ``median()``.
  """

  def __init__(self, skip=2):
    super().__init__()
    self.skip = skip
    self.times = []
    self._start = None

  def on_train_batch_begin(self, batch, logs=None):
    self._start = time.perf_counter()

  def on_train_batch_end(self, batch, logs=None):
    self.model.optimizer.iterations.numpy()  # waits for the step
    self.times.append(time.perf_counter() - self._start)

  def median(self):
    """Median step time in seconds, the first ``skip`` steps left out."""
    timed = self.times[self.skip:]
    if not timed:
      raise ValueError(f"StepTimer: no steps after the first skip={self.skip} to time. "
                       f"Received: {len(self.times)} steps")
    return statistics.median(timed)
