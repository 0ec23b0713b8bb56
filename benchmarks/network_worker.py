"""One worker of benchmarks/network.py: ``model.fit`` under MultiWorkerMirroredStrategy.

Run by network.py inside a host namespace with ``TF_CONFIG`` set (or with ``--alone``:
no cluster and no exchange, the compute-only floor). Trains the Fashion-MNIST data
(the real IDX files; synthetic of the same shape with --synthetic) with the wide MLP,
the Fashion-MNIST CNN (examples/fashion_mnist.py) or ResNet-20, timing every step
(benchmarks/timing.py) and the bytes it sent, and measuring test accuracy (its time not
counted) every --eval_every steps, until --target_accuracy, --max_steps or
--max_run_seconds of training. Writes its figures as JSON to --out.

With --local_steps=H the replicas hold weights of their own inside a round of H steps:
accuracy is measured, and training stops, only at round ends (see ``eval_interval``).
"""

import argparse
import json
import math
import os
import sys
import time

HEARTBEAT_S = 300
MODELS = ("mlp", "cnn", "resnet20")
OUTER_OPTIMIZERS = ("average", "nesterov")  # flags_and_config's; a copy: parsed before TF loads


def parse(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--model", default="mlp", choices=MODELS)
  parser.add_argument("--compressor", default="adacomp")
  parser.add_argument("--optimizer_exchange", default=None, choices=("gradients", "updates"),
                      help="CompressedOptimizer's exchange (default: the library's)")
  parser.add_argument("--local_steps", type=int, default=None,
                      help="steps per round (CompressedOptimizer's local_steps; default 1)")
  parser.add_argument("--outer_optimizer", default=None, choices=OUTER_OPTIMIZERS,
                      help="how a round's pseudo-update moves the weights (with "
                      "--local_steps; default: the library's)")
  parser.add_argument("--topk_density", type=float, default=0.01)
  parser.add_argument("--width", type=int, default=2048, help="MLP hidden width")
  parser.add_argument("--batch_size", type=int, default=64, help="per worker")
  parser.add_argument("--learning_rate", type=float, default=0.05)
  parser.add_argument("--max_steps", type=int, default=300)
  parser.add_argument("--target_accuracy", type=float, default=0.0, help="0: no target")
  parser.add_argument("--eval_every", type=int, default=10)
  parser.add_argument("--eval_size", type=int, default=2000, help="test images evaluated")
  parser.add_argument("--max_run_seconds", type=float, default=0,
                      help="stop at the first round end after this many seconds of "
                      "training (0: no limit); not a failure")
  parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads per pool")
  parser.add_argument("--alone", action="store_true", help="no cluster: compute only")
  parser.add_argument("--synthetic", action="store_true")
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  if args.local_steps is not None and args.local_steps < 1:
    parser.error(f"--local_steps must be >= 1. Received: local_steps={args.local_steps}")
  if args.eval_every < 1:
    parser.error(f"--eval_every must be >= 1. Received: eval_every={args.eval_every}")
  return args


def eval_interval(eval_every, local_steps):
  """Steps between evaluations: --eval_every rounded up to a multiple of the round.

  With local steps each replica holds its own weights inside a round; only at a round
  end (a step that is a multiple of H) do all replicas hold the same averaged weights.
  An evaluation there measures the model the workers share, and a decision to stop
  taken there is the same on every worker (a worker that stopped alone would leave
  the other waiting in a collective forever). H * ceil(eval_every / H), the smallest
  multiple of H that is at least --eval_every, keeps evaluations about as frequent as
  asked (lcm(eval_every, H) would be coarser: 160 steps for 10 and 32).
  """
  return local_steps * math.ceil(eval_every / local_steps)


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
    # At 10 Mbit/s one weight's initial broadcast (16 MB) holds the workers' connection
    # longer than TensorFlow's 10 s heartbeat timeout, which then declares them dead.
    strategy = tf_adacomp.distribute.multi_worker_strategy(heartbeat_timeout=HEARTBEAT_S)
    workers = strategy.num_replicas_in_sync
    index = strategy.cluster_resolver.task_id
  # The MLP and the CNN train on the Fashion-MNIST example's data and settings; the CNN
  # and ResNet-20 are their examples' own build_model.
  example = cifar10_resnet if args.model == "resnet20" else fashion_mnist
  options = {"dataset": "fashion_mnist", "depth": 20} if args.model == "resnet20" else {}
  # The floor (--alone) is the plain Keras step: no CompressedOptimizer, no rounds.
  config = flags_and_config.make_config(
      example, strategy="multi_worker" if not args.alone else "one_device",
      compressor="none" if args.alone else args.compressor, topk_density=args.topk_density,
      optimizer_exchange=None if args.alone else args.optimizer_exchange,
      optimizer_local_steps=None if args.alone else args.local_steps,
      outer_optimizer=None if args.alone else args.outer_optimizer,
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
    optimizer = optimizers.make_optimizer(config, args.max_steps)
    # jit_compile=False: the floor and every cluster run are the same Keras program
    # (on a CPU-only host Keras' "auto" is False anyway; said here so it stays so).
    model.compile(optimizer=optimizer, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

  local_steps = 1 if args.alone else (args.local_steps or 1)
  interval = eval_interval(args.eval_every, local_steps)
  timer = timing.StepTimer(skip=1)
  evaluations = []
  stopped = {"reason": "max_steps"}

  def any_worker(flag):
    """Whether ``flag`` holds on some worker: one all-reduce (a sum: tf.distribute has no
    max) of a scalar, so that every worker takes the same decision (a clock is not the
    same on two workers)."""
    if args.alone:
      return flag
    values = strategy.experimental_distribute_values_from_function(
        lambda _: tf.constant(float(flag)))
    return bool(strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None).numpy() > 0)

  class Evaluate(keras.callbacks.Callback):
    """Test accuracy every ``interval`` steps (round ends only, see ``eval_interval``);
    stops at the target (the same on all workers: at a round end their weights are
    identical, so is the decision) or after --max_run_seconds of training."""

    def on_train_batch_end(self, batch, logs=None):
      step = batch + 1
      if step % local_steps:
        return  # inside a round (the last step too, if one): the replicas' weights differ
      # The time limit, checked at every round end (outside the timed step: the timer's
      # callback runs first); the first worker past it stops them all.
      out_of_time = bool(args.max_run_seconds) and any_worker(
          sum(timer.times) >= args.max_run_seconds)
      if step % interval and step != args.max_steps and not out_of_time:
        return
      start = time.perf_counter()
      logits = np.concatenate([model(x_test[i:i + 500], training=False).numpy()
                               for i in range(0, len(x_test), 500)])
      accuracy = float(np.mean(np.argmax(logits, -1) == y_test))
      evaluations.append({"step": step, "accuracy": accuracy,
                          "seconds": time.perf_counter() - start})
      if args.target_accuracy and accuracy >= args.target_accuracy:
        model.stop_training = True
        stopped["reason"] = "target"
      elif out_of_time:
        model.stop_training = True
        stopped["reason"] = "max_run_seconds"

  compressed = isinstance(optimizer, tf_adacomp.CompressedOptimizer)
  stats = tf_adacomp.CompressionStats()
  step_bytes = []

  class StepBytes(keras.callbacks.Callback):
    """The bytes this worker sent in each step: CompressedOptimizer's count (0 in a
    round's local steps), 4 per parameter for the dense all-reduce, 0 alone. Kept per
    step so that network.py sums them exactly up to the step that reached the target."""

    def on_train_batch_end(self, batch, logs=None):
      if compressed:
        step_bytes.append(stats.step_values().get("bytes_sent", 0.0))
      else:
        step_bytes.append(0.0 if args.alone else float(dense_bytes))

  dense_bytes = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
  callbacks = [timer, StepBytes(), Evaluate()]
  if compressed:
    callbacks.append(stats)
  model.fit(train, epochs=1, steps_per_epoch=args.max_steps, callbacks=callbacks,
            verbose=0, shuffle=False)
  with open(args.out, "w") as f:
    json.dump({"worker": index, "workers": workers, "model": args.model,
               "compressor": args.compressor, "alone": args.alone,
               "local_steps": local_steps,
               "outer_optimizer": None if args.alone else args.outer_optimizer,
               "parameters": dense_bytes // 4, "batch_size_per_worker": args.batch_size,
               "step_seconds": timer.times, "median_step_seconds": timer.median(),
               "eval_interval": interval, "evaluations": evaluations,
               "stopped": stopped["reason"], "max_run_seconds": args.max_run_seconds,
               "step_bytes_sent": step_bytes,
               "bytes_sent_per_step": sum(step_bytes) / len(step_bytes),
               "dense_bytes_per_step": dense_bytes,
               "variables": stats.variable_totals() if compressed else {}}, f)


if __name__ == "__main__":
  main()
