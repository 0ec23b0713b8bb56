"""CompressionStats: per-step logs and the run's totals, from a stand-in source."""

import math

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


def _step(conv_sent, dense_sent):
  return [(CONV, conv_sent), (DENSE, dense_sent)]


def test_totals_are_sums_over_the_steps_and_logs_per_step():
  stats = tf_adacomp.CompressionStats(source=_Source([_step(40, 10), _step(20, 5)]))
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
  stats.on_train_begin()
  for batch in range(3):
    stats.on_train_batch_end(batch, {})
  epoch = {}
  stats.on_epoch_end(0, epoch)
  assert epoch["compression_ratio"] == pytest.approx(3 * 1400 / 25)
  assert epoch["compression_ratio_conv"] == pytest.approx(3 * 400 / 20)
  assert epoch["bytes_sent"] == pytest.approx(25 / 3)


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
