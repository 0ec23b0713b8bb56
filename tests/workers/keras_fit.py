"""Worker: Keras ``model.fit`` under ``MultiWorkerMirroredStrategy`` (run by run_workers).

Usage: ``keras_fit.py MODE`` with MODE one of
  - ``fix``: the strategy from ``tf_adacomp.distribute.multi_worker_strategy()``, which
    applies ``tf_adacomp.compat.keras_multi_worker.apply_keras_multi_worker_fix()``;
  - ``none``: a plain ``tf.distribute.MultiWorkerMirroredStrategy()``, upstream Keras;
  - ``symbolic-build-only``: only the first of the two patches.

A small MLP learns scikit-learn's handwritten digits (global batch 64, SGD, 2 epochs of
5 steps), then evaluates. Writes to ``$MULTI_WORKER_OUT_DIR``: ``worker{i}.npz`` (initial
and final weights) and ``worker{i}.json`` (patches, history, evaluation, and what the
private names of ``tf_adacomp.compat`` that only a cluster exercises gave). The test
imports ``make_model`` / ``make_dataset`` / ``fit`` to train the same model in one process
as a reference.
"""

import json
import sys

import numpy as np
import tensorflow as tf
import keras

GLOBAL_BATCH = 64
EPOCHS = 2
STEPS_PER_EPOCH = 5
LEARNING_RATE = 0.5


def load_digits():
  from sklearn.datasets import load_digits as sklearn_digits  # pylint: disable=g-import-not-at-top
  x, y = sklearn_digits(return_X_y=True)
  return (x / 16.0).astype(np.float32), y.astype(np.int32)


def make_dataset(x, y, repeat=True):
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)
  if repeat:
    dataset = dataset.repeat()
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
  return dataset.with_options(options)


def make_model():
  model = keras.Sequential([
      keras.Input((64,)),
      keras.layers.Dense(32, activation="relu"),
      keras.layers.Dense(10),
  ])
  model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
  return model


def fit(model, x, y, callbacks=()):
  history = model.fit(make_dataset(x, y), epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH,
                      shuffle=False, verbose=0, callbacks=list(callbacks))
  evaluation = model.evaluate(make_dataset(x, y, repeat=False), verbose=0, return_dict=True)
  return history.history, evaluation


def main():
  from multi_worker import worker_index, worker_out_dir  # pylint: disable=g-import-not-at-top
  from tf_adacomp.compat import internals  # pylint: disable=g-import-not-at-top
  from tf_adacomp.compat import keras_multi_worker  # pylint: disable=g-import-not-at-top
  from tf_adacomp.compat import patches as compat_patches  # pylint: disable=g-import-not-at-top
  from tf_adacomp.distribute import multi_worker_strategy  # pylint: disable=g-import-not-at-top

  mode = sys.argv[1]
  if mode == "fix":
    strategy = multi_worker_strategy()
  elif mode == "none":
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
  elif mode == "symbolic-build-only":
    compat_patches.install(keras_multi_worker.SYMBOLIC_BUILD)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
  else:
    raise SystemExit(f"unknown mode {mode!r}")
  index = worker_index()
  patches = [name for name in keras_multi_worker.PATCHES if compat_patches.applied(name)]
  trainer = internals.keras_tensorflow_trainer()
  private = {  # the canaries of tests/compat/test_keras_multi_worker.py read these
      "in_multi_worker_mode": internals.in_multi_worker_mode(strategy),
      "collective_all_reduce_multi_worker":
          trainer._collective_all_reduce_multi_worker(strategy),  # pylint: disable=protected-access
  }
  print(f"worker {index}: {strategy.num_replicas_in_sync} replicas, patches {patches}", flush=True)

  keras.utils.set_random_seed(0)
  x, y = load_digits()
  with strategy.scope():
    model = make_model()
  private["own_distribute_strategy"] = internals.own_distribute_strategy(model) is strategy
  initial = [w.copy() for w in model.get_weights()]
  history, evaluation = fit(model, x, y)
  out = worker_out_dir()
  np.savez(out / f"worker{index}.npz",
           **{f"initial_{i}": w for i, w in enumerate(initial)},
           **{f"final_{i}": w for i, w in enumerate(model.get_weights())})
  with open(out / f"worker{index}.json", "w") as f:
    json.dump({"patches": patches, "replicas": strategy.num_replicas_in_sync,
               "history": history, "evaluation": evaluation, "private": private}, f)
  print(f"worker {index}: history {history}, evaluation {evaluation}", flush=True)


if __name__ == "__main__":
  main()
