"""Helpers for the example tests: small configs and what every summary must hold."""

import gzip
import json
import math
import os

import numpy as np

from tf_adacomp.examples import fashion_mnist
from tf_adacomp.examples import flags_and_config

SUMMARY_FIELDS = {
    "example", "compressor", "strategy", "replicas", "steps", "batch_size", "test_accuracy",
    "test_loss", "compression", "bytes_sent_per_step", "dense_bytes_per_step",
    "compression_ratio", "train_seconds", "wall_seconds", "config"}


def small_config(example, model_dir, **overrides):
  """Two replicas, a few steps of a small batch, quiet: a smoke run of ``example``."""
  settings = dict(replicas=2, epochs=1, steps_per_epoch=3, eval_steps=2, batch_size=8,
                  verbose=0, model_dir=str(model_dir))
  settings.update(overrides)
  return flags_and_config.make_config(example, **settings)


def check_summary(summary, model_dir, kinds):
  """The summary has every field, per-kind ratios, and was written as JSON."""
  assert SUMMARY_FIELDS <= set(summary), SUMMARY_FIELDS - set(summary)
  assert set(kinds) | {"total"} <= set(summary["compression"])
  for entry in summary["compression"].values():
    assert entry["sent_bytes_per_step"] > 0 and math.isfinite(entry["ratio"])
  assert 0.0 <= summary["test_accuracy"] <= 1.0
  if summary["compressor"] != "none":  # per variable, adding up to the per-kind figures
    variables = summary["variables"]
    assert {v["kind"] for v in variables.values()} == set(summary["compression"]) - {"total"}
    assert math.isclose(sum(v["sent_bytes_per_step"] for v in variables.values()),
                        summary["bytes_sent_per_step"], rel_tol=1e-9)
  with open(os.path.join(model_dir, "summary.json")) as f:
    written = json.load(f)
  assert json.dumps(written, sort_keys=True) == json.dumps(summary, sort_keys=True)


def write_idx(path, array, compress=True):
  """Writes ``array`` as an unsigned-byte IDX file (gzipped unless ``compress`` is False)."""
  header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
      int(n).to_bytes(4, "big") for n in array.shape)
  opener = gzip.open if compress else open
  with opener(path, "wb") as f:
    f.write(header + array.astype(np.uint8).tobytes())


def write_fashion_mnist(directory, n_train=64, n_test=16):
  """Random images and labels under Fashion-MNIST's four IDX file names."""
  rng = np.random.default_rng(0)
  for split, n in (("train", n_train), ("test", n_test)):
    images, labels = fashion_mnist.FILES[split]
    write_idx(os.path.join(directory, images), rng.integers(0, 256, (n, 28, 28)))
    write_idx(os.path.join(directory, labels), rng.integers(0, 10, (n,)))
