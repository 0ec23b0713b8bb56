"""CompressionStats: per-step logs and the run's totals, from a stand-in source."""

import math

import pytest

import tf_adacomp


class _Source:
  """Returns the given per-step summaries in turn (as CompressedOptimizer would)."""

  def __init__(self, steps):
    self.steps = list(steps)

  def compression_stats(self):
    return self.steps.pop(0)


def _step(conv_sent, dense_sent):
  conv = {"dense_bytes": 400.0, "sent_bytes": conv_sent, "ratio": 400.0 / conv_sent}
  dense = {"dense_bytes": 1000.0, "sent_bytes": dense_sent, "ratio": 1000.0 / dense_sent}
  total = {"dense_bytes": 1400.0, "sent_bytes": conv_sent + dense_sent,
           "ratio": 1400.0 / (conv_sent + dense_sent)}
  return {"conv": conv, "dense": dense, "total": total}


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


def test_totals_restart_with_each_fit_and_skip_steps_without_figures():
  stats = tf_adacomp.CompressionStats(source=_Source([_step(40, 10), {}, _step(20, 5)]))
  stats.on_train_begin()
  stats.on_train_batch_end(0, {})
  stats.on_train_begin()  # a second fit
  stats.on_train_batch_end(0, {})  # nothing measured yet (e.g. an unbuilt optimizer)
  stats.on_train_batch_end(1, {})
  assert stats.totals()["total"]["steps"] == 1
  assert stats.totals()["total"]["sent_bytes"] == 25.0
  assert math.isclose(stats.totals()["dense"]["ratio"], 200.0)
