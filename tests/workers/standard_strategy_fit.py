"""Worker: the standard TensorFlow code, with nothing of tf_adacomp but the optimizer.

``tf.distribute.MultiWorkerMirroredStrategy()`` from its own constructor (no
``tf_adacomp.distribute`` helper, no explicit Keras fix), ``CompressedOptimizer(SGD)``
with AdaComp, ``model.fit`` and ``evaluate`` on ``keras_fit``'s digits. Writes to
``$MULTI_WORKER_OUT_DIR``: ``worker{i}.npz`` (final weights) and ``worker{i}.json``
(the Keras patches installed before and after the optimizer was created, the history).

Usage: ``standard_strategy_fit.py [CONTROL ...]``. Each CONTROL (``none`` or
``symbolic-build-only``, the modes of ``keras_fit.py``) first runs ``keras_fit``'s plain
``model.fit`` under the same strategy, before the optimizer above is created: upstream
Keras (``none``), or with only ``tf_adacomp``'s symbolic-build patch installed (reverted
once that fit has run). These are the control runs of
tests/compat/test_keras_multi_worker.py, which fail on a Keras with the upstream bug:
one cluster start-up for them and the run above. Each control's outcome goes to
``worker{i}.controls.json``: ``{control: {"patches", "error" (the traceback, when the
fit raised), "history" (when it trained)}}``. Both fail while ``fit`` traces its first
step, on every worker alike, before any collective runs.
"""

import json
import sys
import traceback
import warnings

import keras
import numpy as np
import tensorflow as tf

import keras_fit  # the same model, data and steps as the other multi-worker runs

CONTROLS = ("none", "symbolic-build-only")


def run_control(strategy, control, x, y):
  """``keras_fit``'s plain ``model.fit`` as the control ``control`` runs it: its record."""
  from tf_adacomp.compat import keras_multi_worker  # pylint: disable=g-import-not-at-top
  from tf_adacomp.compat import patches as compat_patches  # pylint: disable=g-import-not-at-top

  if control not in CONTROLS:
    raise SystemExit(f"unknown control {control!r}; known: {', '.join(CONTROLS)}")
  installed = (control == "symbolic-build-only"
               and compat_patches.install(keras_multi_worker.SYMBOLIC_BUILD))
  record = {"patches": [name for name in keras_multi_worker.PATCHES
                        if compat_patches.applied(name)]}
  try:
    keras.utils.set_random_seed(0)
    with strategy.scope():
      model = keras_fit.make_model()
    record["history"], record["evaluation"] = keras_fit.fit(model, x, y)
  except Exception:  # pylint: disable=broad-except
    record["error"] = traceback.format_exc()
  finally:
    if installed:
      compat_patches.revert(keras_multi_worker.SYMBOLIC_BUILD)
  return record


def main():
  from multi_worker import worker_index, worker_out_dir  # pylint: disable=g-import-not-at-top
  import tf_adacomp  # pylint: disable=g-import-not-at-top
  from tf_adacomp.compat import keras_multi_worker  # pylint: disable=g-import-not-at-top

  # Built under the strategy, the optimizer must not warn that the worker trains alone
  # (issue 42): as an error, a false alarm fails the job.
  warnings.simplefilter("error", tf_adacomp.UnsynchronizedWorkersWarning)
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  index = worker_index()
  out = worker_out_dir()
  x, y = keras_fit.load_digits()
  controls = sys.argv[1:]
  if controls:
    found = {control: run_control(strategy, control, x, y) for control in controls}
    with open(out / f"worker{index}.controls.json", "w") as f:
      json.dump(found, f)
  before = keras_multi_worker.keras_multi_worker_fix_applied()
  keras.utils.set_random_seed(0)
  with strategy.scope():
    model = keras_fit.make_model()
    model.compile(optimizer=tf_adacomp.CompressedOptimizer(
                      keras.optimizers.SGD(keras_fit.LEARNING_RATE)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
  history, evaluation = keras_fit.fit(model, x, y)
  np.savez(out / f"worker{index}.npz", *model.get_weights())
  with open(out / f"worker{index}.json", "w") as f:
    json.dump({"fix_applied_before": before,
               "fix_applied_after": keras_multi_worker.keras_multi_worker_fix_applied(),
               "history": history, "evaluation": evaluation,
               "steps": int(model.optimizer.iterations.numpy())}, f)


if __name__ == "__main__":
  main()
