"""Helpers for the example tests: small configs and what every summary must hold."""

import json
import math
import os

from tf_adacomp.examples import common

SUMMARY_FIELDS = {
    "example", "compressor", "strategy", "replicas", "steps", "batch_size", "test_accuracy",
    "test_loss", "compression", "bytes_sent_per_step", "dense_bytes_per_step",
    "compression_ratio", "train_seconds", "wall_seconds"}


def small_config(example, model_dir, **overrides):
  """Two replicas, a few steps of a small batch, quiet: a smoke run of ``example``."""
  settings = dict(replicas=2, epochs=1, steps_per_epoch=3, eval_steps=2, batch_size=8,
                  verbose=0, model_dir=str(model_dir))
  settings.update(overrides)
  return common.make_config(example, **settings)


def check_summary(summary, model_dir, kinds):
  """The summary has every field, per-kind ratios, and was written as JSON."""
  assert SUMMARY_FIELDS <= set(summary), SUMMARY_FIELDS - set(summary)
  assert set(kinds) | {"total"} <= set(summary["compression"])
  for entry in summary["compression"].values():
    assert entry["sent_bytes_per_step"] > 0 and math.isfinite(entry["ratio"])
  assert 0.0 <= summary["test_accuracy"] <= 1.0
  with open(os.path.join(model_dir, "summary.json")) as f:
    written = json.load(f)
  assert json.dumps(written, sort_keys=True) == json.dumps(summary, sort_keys=True)
