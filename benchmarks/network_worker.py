"""One worker of benchmarks/network.py: ``model.fit`` under MultiWorkerMirroredStrategy.

Run by network.py inside a host namespace with ``TF_CONFIG`` set (or with ``--alone``:
no cluster and no exchange, the compute-only floor). Trains the Fashion-MNIST data
(the real IDX files; synthetic of the same shape with --synthetic) with the wide MLP
or ResNet-20, timing every step (benchmarks/timing.py) and, every --eval_every steps,
measuring test accuracy (its time not counted) until --target_accuracy or --max_steps.
Writes its figures as JSON to --out.
"""

import argparse
import json
import os
import sys
import time

MODELS = ("mlp", "resnet20")


def parse(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--model", default="mlp", choices=MODELS)
  parser.add_argument("--compressor", default="adacomp")
  parser.add_argument("--optimizer_exchange", default=None, choices=("gradients", "updates"),
                      help="CompressedOptimizer's exchange (default: the library's)")
  parser.add_argument("--topk_density", type=float, default=0.01)
  parser.add_argument("--width", type=int, default=2048, help="MLP hidden width")
  parser.add_argument("--batch_size", type=int, default=64, help="per worker")
  parser.add_argument("--learning_rate", type=float, default=0.05)
  parser.add_argument("--max_steps", type=int, default=300)
  parser.add_argument("--target_accuracy", type=float, default=0.0, help="0: no target")
  parser.add_argument("--eval_every", type=int, default=10)
  parser.add_argument("--eval_size", type=int, default=2000, help="test images evaluated")
  parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads per pool")
  parser.add_argument("--alone", action="store_true", help="no cluster: compute only")
  parser.add_argument("--synthetic", action="store_true")
  parser.add_argument("--out", required=True)
  return parser.parse_args(argv)


def build_mlp(width):
  import keras  # pylint: disable=g-import-not-at-top
  return keras.Sequential([
      keras.Input([28, 28, 1]), keras.layers.Flatten(),
      keras.layers.Dense(width, activation="relu"),
      keras.layers.Dense(width, activation="relu"),
      keras.layers.Dense(10)], name="wide_mlp")


def main(argv=None):
  args = parse(argv)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # Threads first (before TensorFlow starts): workers share the host's cores.
  tf.config.threading.set_intra_op_parallelism_threads(args.threads)
  tf.config.threading.set_inter_op_parallelism_threads(args.threads)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import timing  # pylint: disable=g-import-not-at-top
  import tf_adacomp  # pylint: disable=g-import-not-at-top
  from tf_adacomp.examples import cifar10_resnet  # pylint: disable=g-import-not-at-top
  from tf_adacomp.examples import flags_and_config  # pylint: disable=g-import-not-at-top
  from tf_adacomp.examples import input_data  # pylint: disable=g-import-not-at-top
  from tf_adacomp.examples import optimizers  # pylint: disable=g-import-not-at-top
  from tf_adacomp.examples import fashion_mnist  # pylint: disable=g-import-not-at-top

  if args.alone:
    strategy, workers, index = tf.distribute.get_strategy(), 1, 0
  else:
    strategy = tf_adacomp.distribute.multi_worker_strategy()
    workers = strategy.num_replicas_in_sync
    index = strategy.cluster_resolver.task_id
  example = fashion_mnist if args.model == "mlp" else cifar10_resnet
  options = {"dataset": "fashion_mnist", "depth": 20} if args.model == "resnet20" else {}
  config = flags_and_config.make_config(
      example, strategy="multi_worker" if not args.alone else "one_device",
      compressor="none" if args.alone else args.compressor, topk_density=args.topk_density,
      optimizer_exchange=None if args.alone else args.optimizer_exchange,
      batch_size=args.batch_size * workers, learning_rate=args.learning_rate,
      lr_schedule="constant", epochs=1, steps_per_epoch=args.max_steps,
      synthetic=args.synthetic or None, verbose=0, **options)
  keras.utils.set_random_seed(config.seed)
  data = example.load_data(config)
  train, _ = input_data.pipelines(data, config)
  x_test, y_test = next(iter(data.test.batch(args.eval_size)))
  x_test, y_test = x_test.numpy(), y_test.numpy()

  with strategy.scope():
    model = (build_mlp(args.width) if args.model == "mlp"
             else example.build_model(config, data))
    model.compile(optimizer=optimizers.make_optimizer(config, args.max_steps),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

  timer = timing.StepTimer(skip=1)
  evaluations = []

  class Evaluate(keras.callbacks.Callback):
    """Test accuracy every --eval_every steps; stops at the target (same on all workers:
    their weights are identical, so is the decision)."""

    def on_train_batch_end(self, batch, logs=None):
      step = batch + 1
      if step % args.eval_every and step != args.max_steps:
        return
      start = time.perf_counter()
      logits = np.concatenate([model(x_test[i:i + 500], training=False).numpy()
                               for i in range(0, len(x_test), 500)])
      accuracy = float(np.mean(np.argmax(logits, -1) == y_test))
      evaluations.append({"step": step, "accuracy": accuracy,
                          "seconds": time.perf_counter() - start})
      if args.target_accuracy and accuracy >= args.target_accuracy:
        model.stop_training = True

  stats = tf_adacomp.CompressionStats()
  callbacks = [timer, Evaluate()]
  compressing = args.compressor != "none" and not args.alone
  if compressing:
    callbacks.append(stats)
  model.fit(train, epochs=1, steps_per_epoch=args.max_steps, callbacks=callbacks,
            verbose=0, shuffle=False)
  dense_bytes = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
  totals = stats.totals() if compressing else {}
  sent = (totals["total"]["sent_bytes"] / totals["total"]["steps"] if totals
          else 0 if args.alone else dense_bytes)
  with open(args.out, "w") as f:
    json.dump({"worker": index, "workers": workers, "model": args.model,
               "compressor": args.compressor, "alone": args.alone,
               "parameters": dense_bytes // 4, "batch_size_per_worker": args.batch_size,
               "step_seconds": timer.times, "median_step_seconds": timer.median(),
               "evaluations": evaluations, "bytes_sent_per_step": sent,
               "dense_bytes_per_step": dense_bytes,
               "variables": stats.variable_totals() if compressing else {}}, f)


if __name__ == "__main__":
  main()
