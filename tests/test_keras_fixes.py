"""The Keras multi-worker fix is applied by CompressedOptimizer, with no call from the user."""

import json
import logging

import keras
import numpy as np
import tensorflow as tf

import tf_adacomp
from multi_worker import WORKERS_DIR
from multi_worker import describe
from multi_worker import run_workers
from tf_adacomp import keras_fixes


def _bare_multi_worker_strategy():
  """An instance that is a MultiWorkerMirroredStrategy, without starting a cluster."""
  cls = tf.distribute.MultiWorkerMirroredStrategy
  return cls.__new__(cls)


def test_other_strategies_leave_keras_alone(unpatched_keras):
  assert keras_fixes.apply_keras_multi_worker_fix_for(tf.distribute.get_strategy()) == ()
  assert keras_fixes.apply_keras_multi_worker_fix_for(None) == ()
  tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1))
  assert not keras_fixes.keras_multi_worker_fix_applied()


def test_a_multi_worker_strategy_installs_the_fix_once_with_one_log_line(unpatched_keras, caplog):
  needed = keras_fixes.keras_multi_worker_fix_needed()
  strategy = _bare_multi_worker_strategy()
  with caplog.at_level(logging.INFO, logger="tf_adacomp"):
    assert keras_fixes.apply_keras_multi_worker_fix_for(strategy) == needed
    assert keras_fixes.apply_keras_multi_worker_fix_for(strategy) == ()  # idempotent
  lines = [r.getMessage() for r in caplog.records if r.name == "tf_adacomp"]
  assert len(lines) == (1 if needed else 0), lines
  if needed:
    assert "keras-team/keras#20585" in lines[0] and needed[0] in lines[0]
    assert keras_fixes.keras_multi_worker_fix_applied()


def test_plain_multi_worker_strategy_trains_with_model_fit(tmp_path):
  """The standard constructor, 2 worker processes over gRPC, no call to tf_adacomp's fix."""
  results = run_workers(WORKERS_DIR / "standard_strategy_fit.py", num_workers=2,
                        timeout=180, out_dir=tmp_path)
  assert all(r.returncode == 0 for r in results), describe(results)
  logs = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(2)]
  weights = [np.load(tmp_path / f"worker{i}.npz") for i in range(2)]
  needed = bool(keras_fixes.keras_multi_worker_fix_needed())
  for log, result in zip(logs, results):
    assert not log["fix_applied_before"]
    assert log["fix_applied_after"] == needed
    assert log["steps"] > 0 and np.isfinite(log["history"]["loss"]).all()
    assert result.stderr.count("keras-team/keras#20585") == (1 if needed else 0)
  for name in weights[0].files:  # the workers stay bit-identical
    np.testing.assert_array_equal(weights[0][name], weights[1][name])
