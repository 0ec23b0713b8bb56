"""Worker: the standard TensorFlow code, with nothing of tf_adacomp but the optimizer.

``tf.distribute.MultiWorkerMirroredStrategy()`` from its own constructor (no
``tf_adacomp.distribute`` helper, no explicit Keras fix), ``CompressedOptimizer(SGD)``
with AdaComp, ``model.fit`` and ``evaluate`` on ``keras_fit``'s digits. Writes to
``$MULTI_WORKER_OUT_DIR``: ``worker{i}.npz`` (final weights) and ``worker{i}.json``
(the Keras patches installed before and after the optimizer was created, the history).
"""

import json
import warnings

import keras
import numpy as np
import tensorflow as tf

import keras_fit  # the same model, data and steps as the other multi-worker runs


def main():
  from multi_worker import worker_index, worker_out_dir  # pylint: disable=g-import-not-at-top
  import tf_adacomp  # pylint: disable=g-import-not-at-top
  from tf_adacomp.compat import keras_multi_worker  # pylint: disable=g-import-not-at-top

  # Built under the strategy, the optimizer must not warn that the worker trains alone
  # (issue 42): as an error, a false alarm fails the job.
  warnings.simplefilter("error", tf_adacomp.UnsynchronizedWorkersWarning)
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  before = keras_multi_worker.keras_multi_worker_fix_applied()
  keras.utils.set_random_seed(0)
  x, y = keras_fit.load_digits()
  with strategy.scope():
    model = keras_fit.make_model()
    model.compile(optimizer=tf_adacomp.CompressedOptimizer(
                      keras.optimizers.SGD(keras_fit.LEARNING_RATE)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
  history, evaluation = keras_fit.fit(model, x, y)
  index = worker_index()
  out = worker_out_dir()
  np.savez(out / f"worker{index}.npz", *model.get_weights())
  with open(out / f"worker{index}.json", "w") as f:
    json.dump({"fix_applied_before": before,
               "fix_applied_after": keras_multi_worker.keras_multi_worker_fix_applied(),
               "history": history, "evaluation": evaluation,
               "steps": int(model.optimizer.iterations.numpy())}, f)


if __name__ == "__main__":
  main()
