"""Worker: ResIST in ``model.fit`` under MultiWorkerMirroredStrategy (run by run_workers).

Every worker builds the same depth-14 pre-activation ResNet (width 4) on scikit-learn's
digits as 8x8x1 images and trains it with ``tf_adacomp.resist.ResIST`` (5 local steps
per round, 3 epochs of one round each, global batch 32: each worker trains on its own
shard). Writes to ``$MULTI_WORKER_OUT_DIR``: ``worker{i}.npz`` (every weight after each
exchange, ``round{r}_{n}``, and the stem's kernel just before it, ``before{r}_stem``) and
``worker{i}.json`` (history, partitions, communication, gates after fit).
"""

import json

import keras
import numpy as np
import tensorflow as tf

LOCAL_STEPS, EPOCHS, GLOBAL_BATCH = 5, 3, 32


def main():
  from multi_worker import worker_index, worker_out_dir  # pylint: disable=g-import-not-at-top
  import digits_data  # pylint: disable=g-import-not-at-top
  from tf_adacomp import resist  # pylint: disable=g-import-not-at-top
  from tf_adacomp.distribute import multi_worker_strategy  # pylint: disable=g-import-not-at-top

  strategy = multi_worker_strategy()
  (x, y), _ = digits_data.images()
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
  train = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0).repeat()
           .batch(GLOBAL_BATCH, drop_remainder=True).with_options(options))
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = resist.resnet(14, input_shape=(8, 8, 1), width=4)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

  rounds, drifted = [], []

  class Recorder(resist.ResIST):
    def _end_round(self):
      drifted.append(model.get_layer("stem").kernel.numpy())  # this worker's own copy
      super()._end_round()
      rounds.append([w.numpy() for w in model.weights if not w.path.endswith("/gate")])

  trainer = Recorder(local_steps=LOCAL_STEPS, seed=3)
  history = model.fit(train, epochs=EPOCHS, steps_per_epoch=LOCAL_STEPS, verbose=0,
                      shuffle=False, callbacks=[trainer])
  index = worker_index()
  out = worker_out_dir()
  np.savez(out / f"worker{index}.npz",
           **{f"round{r}_{n}": w for r, weights in enumerate(rounds)
              for n, w in enumerate(weights)},
           **{f"before{r}_stem": w for r, w in enumerate(drifted)})
  with open(out / f"worker{index}.json", "w") as f:
    json.dump({"replicas": strategy.num_replicas_in_sync, "history": history.history,
               "partitions": [trainer.partition_of(r).astype(int).tolist()
                              for r in range(trainer.rounds)],
               "communication": trainer.communication(),
               "gates": resist.get_gates(model).tolist()}, f)


if __name__ == "__main__":
  main()
