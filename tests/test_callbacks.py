"""CompressionStats: per-step logs and the run's totals, from a stand-in source."""

import math
import types

import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp.compressors import base

CONV = base.TensorPlan("conv2d/kernel", tf.TensorShape([1, 1, 10, 10]), tf.float32, "conv",
                       summable=False)  # 400 float32 bytes
DENSE = base.TensorPlan("dense/kernel", tf.TensorShape([10, 25]), tf.float32, "dense",
                        summable=False)  # 1000 float32 bytes


class _Source:
  """Returns the given per-step variable bytes in turn (as CompressedOptimizer would)."""

  def __init__(self, steps):
    self.steps = list(steps)

  def variable_bytes(self):
    return self.steps.pop(0)


class _Model:
  """What the callback reads of a model after fit began: its History's dict."""

  def __init__(self):
    self.history = types.SimpleNamespace(history={})


def _step(conv_sent, dense_sent):
  return [(CONV, conv_sent), (DENSE, dense_sent)]


def test_totals_are_sums_over_the_steps_and_logs_per_step():
  stats = tf_adacomp.CompressionStats(source=_Source([_step(40, 10), _step(20, 5)]),
                                      progress_bar="all")
  stats.on_train_begin()
  logs = [{}, {}]
  for batch, log in enumerate(logs):
    stats.on_train_batch_end(batch, log)
  assert logs[0]["bytes_sent"] == 50 and logs[1]["compression_ratio_conv"] == 20
  totals = stats.totals()
  assert totals["total"] == {"dense_bytes": 2800.0, "sent_bytes": 75.0, "steps": 2,
                             "ratio": pytest.approx(2800 / 75)}
  assert totals["conv"]["ratio"] == pytest.approx(800 / 60)
  epoch = {}
  stats.on_epoch_end(0, epoch)
  assert epoch["bytes_sent"] == pytest.approx(37.5)  # the epoch's mean
  assert epoch["compression_ratio"] == pytest.approx(2800 / 75)  # of the epoch's sums


def test_an_epoch_whose_steps_sent_nothing_but_one_has_the_ratio_of_its_sums():
  # Local steps: only a round's last step sends.
  stats = tf_adacomp.CompressionStats(source=_Source([_step(0, 0), _step(0, 0), _step(20, 5)]))
  stats.set_model(_Model())
  stats.on_train_begin()
  for batch in range(3):
    stats.on_train_batch_end(batch, {})
  epoch = {}
  stats.on_epoch_end(0, epoch)
  history = stats.model.history.history
  assert epoch["compression_ratio"] == pytest.approx(3 * 1400 / 25)
  assert history["compression_ratio_conv"] == [pytest.approx(3 * 400 / 20)]
  assert history["bytes_sent"] == [pytest.approx(25 / 3)]


def test_totals_restart_with_each_fit_and_skip_steps_without_figures():
  stats = tf_adacomp.CompressionStats(source=_Source([_step(40, 10), [], _step(20, 5)]))
  stats.on_train_begin()
  stats.on_train_batch_end(0, {})
  stats.on_train_begin()  # a second fit
  stats.on_train_batch_end(0, {})  # nothing measured yet (e.g. an unbuilt optimizer)
  stats.on_train_batch_end(1, {})
  assert stats.totals()["total"]["steps"] == 1
  assert stats.totals()["total"]["sent_bytes"] == 25.0
  assert math.isclose(stats.totals()["dense"]["ratio"], 200.0)


def test_the_progress_bar_gets_one_figure_the_epoch_so_far_and_no_nan():
  # Local steps: the first steps send nothing; then one round sends.
  stats = tf_adacomp.CompressionStats(source=_Source(
      [_step(0, 0), _step(0, 0), _step(20, 5), _step(0, 0), _step(40, 10), _step(0, 0)]))
  stats.set_model(_Model())
  stats.on_train_begin()
  bars = []
  for batch in range(5):
    logs = {"loss": 1.0}
    stats.on_train_batch_end(batch, logs)
    bars.append(logs)
  assert bars[0] == bars[1] == {"loss": 1.0}  # nothing sent yet: no figure, not NaN
  assert bars[2] == {"loss": 1.0, "compression_ratio": pytest.approx(3 * 1400 / 25)}
  assert bars[3]["compression_ratio"] == pytest.approx(4 * 1400 / 25)  # the epoch so far
  assert bars[4]["compression_ratio"] == pytest.approx(5 * 1400 / 75)
  epoch = {"loss": 1.0}
  stats.on_epoch_end(0, epoch)  # Keras prints these at the bar's end: one figure
  assert epoch == {"loss": 1.0, "compression_ratio": bars[4]["compression_ratio"]}
  assert set(stats.model.history.history) == {  # the rest goes to the History
      "bytes_sent", "compression_ratio_conv", "compression_ratio_dense"}
  assert stats.model.history.history["bytes_sent"] == [pytest.approx(75 / 5)]
  stats.on_epoch_begin(1)  # a new epoch's bar starts from its own first step
  logs = {}
  stats.on_train_batch_end(0, logs)
  assert logs == {}


class _AdamSource(_Source):
  """A source with Adam's shared moment: its moment averages and its step counter."""

  def __init__(self, steps, moments, iterations):
    super().__init__(steps)
    self.moments = list(moments)
    self.counts = list(iterations)
    self.iterations = None

  def moment_bytes(self):
    return self.moments.pop(0)

  def _advance(self):
    self.iterations = tf.constant(self.counts.pop(0))


def test_adams_moment_averages_count_in_bytes_but_not_in_the_ratio():
  # Step 1 averages the moments (dense bfloat16: 2 moments x 2 bytes x 100 and 250
  # elements); step 2 does not; step 3 was skipped (non-finite gradients), so the
  # optimizer's counter did not move and its last average (step 1's) is not this step's.
  source = _AdamSource([_step(440, 1010), _step(40, 10), _step(40, 10)],
                       moments=[[400, 1000], [0, 0], [400, 1000]], iterations=[0, 1, 2, 2])
  source._advance()
  stats = tf_adacomp.CompressionStats(source=source)
  stats.set_model(_Model())
  stats.on_train_begin()
  bars = []
  for batch in range(3):
    source._advance()
    logs = {}
    stats.on_train_batch_end(batch, logs)
    bars.append(logs)
  assert bars[0]["compression_ratio"] == pytest.approx(1400 / 50)  # the moments apart
  assert bars[1]["compression_ratio"] == pytest.approx(2800 / 100)
  assert bars[2]["compression_ratio"] == pytest.approx(4200 / 150)
  epoch = {}
  stats.on_epoch_end(0, epoch)
  history = stats.model.history.history
  assert history["moment_bytes"] == [pytest.approx(1400 / 3)]
  assert history["bytes_sent"] == [pytest.approx((1450 + 50 + 50) / 3)]  # every byte
  assert epoch == {"compression_ratio": pytest.approx(4200 / 150)}
  assert stats.totals()["total"]["sent_bytes"] == 1550  # every byte


def test_a_progress_bar_setting_it_does_not_know_is_named():
  with pytest.raises(ValueError, match="Received: progress_bar='every'"):
    tf_adacomp.CompressionStats(progress_bar="every")


def test_variable_totals_are_per_variable_sums_over_the_steps():
  stats = tf_adacomp.CompressionStats(source=_Source([_step(40, 10), _step(20, 5)]))
  stats.on_train_begin()
  for batch in range(2):
    stats.on_train_batch_end(batch, {})
  variables = stats.variable_totals()
  assert list(variables) == ["conv2d/kernel", "dense/kernel"]
  assert variables["conv2d/kernel"] == {"kind": "conv", "shape": [1, 1, 10, 10],
                                        "dense_bytes": 800.0, "sent_bytes": 60.0, "steps": 2,
                                        "ratio": pytest.approx(800 / 60)}
  assert variables["dense/kernel"]["ratio"] == pytest.approx(2000 / 15)
