"""Worker: ``model.fit`` with ``CompressedOptimizer`` under MultiWorkerMirroredStrategy.

Usage: ``compressed_fit.py COMPRESSOR [REDUCTION [ADASUM_MODE]]`` (a registered name,
e.g. ``none`` or ``adacomp``; "sum" or "adasum"; "gradient" or "delta"). The same model, data and steps as ``keras_fit.py``, with the SGD optimizer
wrapped in ``tf_adacomp.CompressedOptimizer``. Writes to ``$MULTI_WORKER_OUT_DIR``:
``worker{i}.npz`` (final weights and this worker's residues) and ``worker{i}.json``
(history, evaluation, compression statistics of the last step).
"""

import json
import sys

import keras
import numpy as np

import keras_fit  # the plain multi-worker run: same model, data and steps


def main():
  from multi_worker import worker_index, worker_out_dir  # pylint: disable=g-import-not-at-top
  import tf_adacomp  # pylint: disable=g-import-not-at-top
  from tf_adacomp.distribute import multi_worker_strategy  # pylint: disable=g-import-not-at-top

  compressor = sys.argv[1]
  reduction = sys.argv[2] if len(sys.argv) > 2 else "sum"
  adasum_mode = sys.argv[3] if len(sys.argv) > 3 else "gradient"
  strategy = multi_worker_strategy()
  keras.utils.set_random_seed(0)
  x, y = keras_fit.load_digits()
  with strategy.scope():
    model = keras_fit.make_model()
    model.compile(
        optimizer=tf_adacomp.CompressedOptimizer(
            keras.optimizers.SGD(keras_fit.LEARNING_RATE), compressor, reduction=reduction,
            adasum_mode=adasum_mode),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
  history, evaluation = keras_fit.fit(model, x, y)
  index = worker_index()
  residues = [r.value.values[0].numpy() if hasattr(r.value, "values") else r.numpy()
              for state in model.optimizer.residues for r in state]
  out = worker_out_dir()
  np.savez(out / f"worker{index}.npz",
           **{f"final_{i}": w for i, w in enumerate(model.get_weights())},
           **{f"residue_{i}": r for i, r in enumerate(residues)})
  with open(out / f"worker{index}.json", "w") as f:
    json.dump({"history": history, "evaluation": evaluation,
               "replicas": strategy.num_replicas_in_sync,
               "stats": model.optimizer.compression_stats()}, f)


if __name__ == "__main__":
  main()
