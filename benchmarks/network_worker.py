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

With --devices_per_worker=D > 1 the worker's strategy has D local replicas (D logical
CPUs split before TensorFlow starts, or the first D GPUs), each on --batch_size / D
examples: the worker's batch stays --batch_size whatever D. CompressedOptimizer then
sums the worker's replicas locally and sends one payload per worker (the hierarchical
exchange), or with --flat every replica's own (``hierarchical=False``).

--auto gives CompressedOptimizer ``dense_when_faster=True``: it measures the compressed
exchange against the dense all-reduces (float32, bf16) in the run itself and uses the
fastest (``tf_adacomp.steps.choice``); the JSON keeps what it chose
(``exchange_choice``). --auto=float32 gives ``dense_when_faster="float32"``.

--log_reduction=per_value averages the step's logs across workers with one all-reduce
per logged value, as the library did before it packed them into one
(``compat.keras_multi_worker.mean_over_replicas``): the baseline of that change;
--log_reduction=every_step packs them, but on every step even with local steps, as the
library did before it averaged them at rounds' ends only (``tf_adacomp.step_logs``).

With --netns the worker reads its link's counters (``ip -n NETNS -s -j link show
--link_device``; benchmarks/netns.py) before training, after step 1 (which may move
one-off traffic: variables made at the first step are broadcast) and at the end: the
bytes that really crossed its link per step (``link_bytes_per_step``: after step 1 to
the end, divided by the steps), beside CompressedOptimizer's own ``bytes_sent``.
"""

import argparse
import json
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
  parser.add_argument("--devices_per_worker", type=int, default=1,
                      help="local replicas per worker (logical CPUs, or the first GPUs); "
                      "each trains on batch_size / devices_per_worker examples")
  parser.add_argument("--flat", action="store_true",
                      help="CompressedOptimizer(hierarchical=False): every replica sends "
                      "its own payload (default: the library's, hierarchical with D > 1)")
  parser.add_argument("--netns", default=None,
                      help="the network namespace this worker runs in: read its link's "
                      "counters (`ip -n NETNS -s -j link show LINK_DEVICE`)")
  parser.add_argument("--link_device", default="eth0", help="the link's device in --netns")
  parser.add_argument("--topk_density", type=float, default=0.01)
  parser.add_argument("--auto", nargs="?", const="true", default=None,
                      choices=("true", "float32"),
                      help="CompressedOptimizer(dense_when_faster=True): the fastest of the "
                      "compressed exchange and the dense all-reduces (float32, bf16), "
                      "measured; --auto=float32: dense_when_faster='float32', the float32 "
                      "all-reduce the only dense candidate")
  parser.add_argument("--log_reduction", default="packed",
                      choices=("packed", "per_value", "every_step"),
                      help="multi-worker logs: one all-reduce, with local steps at round "
                      "ends only (the library's); one per logged value; or one every "
                      "step (the baselines)")
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
  if args.devices_per_worker < 1 or args.batch_size % args.devices_per_worker:
    parser.error(f"--devices_per_worker must be >= 1 and divide --batch_size (the "
                 f"worker's batch). Received: devices_per_worker={args.devices_per_worker}, "
                 f"batch_size={args.batch_size}")
  return args


def link_per_step(begin, after_first, end, steps):
  """Counters per step (benchmarks/netns.py's ``COUNTERS``): after the first step to the
  end over the steps after the first (one-off traffic of step 1 left out); with one step,
  the whole run's."""
  import netns  # pylint: disable=g-import-not-at-top
  if steps > 1 and after_first is not None:
    delta, count = netns.counter_deltas(after_first, end), steps - 1
  else:
    delta, count = netns.counter_deltas(begin, end), max(steps, 1)
  return {name: value / count for name, value in delta.items()}


def with_options(tf_adacomp, options, build):
  """``build()`` with every ``tf_adacomp.CompressedOptimizer`` it makes given the keyword
  arguments ``options`` (``hierarchical``, ``dense_when_faster``; empty: ``build()`` as it
  is). The examples' ``make_optimizer`` has no such settings: its constructor is wrapped
  for the call only."""
  if not options:
    return build()
  real = tf_adacomp.CompressedOptimizer

  def make(*args, **kwargs):
    return real(*args, **dict(kwargs, **options))

  tf_adacomp.CompressedOptimizer = make
  try:
    return build()
  finally:
    tf_adacomp.CompressedOptimizer = real


def per_value_mean(values, strategy):
  """The baseline of --log_reduction=per_value: one all-reduce per logged value."""
  import keras  # pylint: disable=g-import-not-at-top
  return keras.tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)


def eval_interval(eval_every, local_steps):
  """Steps between evaluations: --eval_every rounded down to a multiple of the round,
  at least one round.

  With local steps each replica holds its own weights inside a round; only at a round
  end (a step that is a multiple of H) do all replicas hold the same averaged weights.
  An evaluation there measures the model the workers share, and a decision to stop
  taken there is the same on every worker (a worker that stopped alone would leave
  the other waiting in a collective forever). H * max(1, eval_every // H) evaluates
  at least as often as asked where a round allows it (8 steps for 10 and H = 8), so
  that the steps to the target are read at least as finely as the others' (rounded up,
  16 steps, they were read up to 15 steps late, against 9 for every 10); a round longer
  than --eval_every is evaluated at each of its ends (32 steps for 10 and H = 32).
  """
  return local_steps * max(1, eval_every // local_steps)


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
  import netns  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import timing  # pylint: disable=g-import-not-at-top
  import tf_adacomp  # pylint: disable=g-import-not-at-top
  from tf_adacomp.examples import cifar10_resnet  # pylint: disable=g-import-not-at-top
  from tf_adacomp.examples import flags_and_config  # pylint: disable=g-import-not-at-top
  from tf_adacomp.examples import input_data  # pylint: disable=g-import-not-at-top
  from tf_adacomp.examples import optimizers  # pylint: disable=g-import-not-at-top
  from tf_adacomp.examples import fashion_mnist  # pylint: disable=g-import-not-at-top

  devices = 1 if args.alone else args.devices_per_worker
  if args.alone:
    strategy, workers, index = tf.distribute.get_strategy(), 1, 0
  else:
    # At 10 Mbit/s one weight's initial broadcast (16 MB) holds the workers' connection
    # longer than TensorFlow's 10 s heartbeat timeout, which then declares them dead.
    options = {}
    if devices > 1:  # D local replicas: logical CPUs, made before TensorFlow starts
      if not tf.config.list_physical_devices("GPU"):
        tf_adacomp.distribute.split_logical_devices(devices)
      options["devices_per_worker"] = devices
    strategy = tf_adacomp.distribute.multi_worker_strategy(heartbeat_timeout=HEARTBEAT_S,
                                                           **options)
    if strategy.num_replicas_in_sync % devices:
      raise RuntimeError(f"{strategy.num_replicas_in_sync} replicas are not "
                         f"devices_per_worker={devices} per worker")
    workers = strategy.num_replicas_in_sync // devices  # the global batch: per worker x this
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

  if args.log_reduction == "per_value":
    from tf_adacomp.compat import keras_multi_worker  # pylint: disable=g-import-not-at-top
    keras_multi_worker.mean_over_replicas = per_value_mean
  if args.log_reduction in ("per_value", "every_step"):  # every step, local steps or not
    from tf_adacomp import step_logs  # pylint: disable=g-import-not-at-top
    step_logs.average_only_when = lambda condition, holder: None
  with strategy.scope():
    model = (build_mlp(args.width) if args.model == "mlp"
             else example.build_model(config, data))
    options = {} if args.alone else dict(
        [("hierarchical", False)] * args.flat
        + [("dense_when_faster", True if args.auto == "true" else args.auto)] * bool(args.auto))
    optimizer = with_options(tf_adacomp, options,
                             lambda: optimizers.make_optimizer(config, args.max_steps))
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

  link = {}  # counters: "begin", "after_first_step", "end"

  class LinkCounters(keras.callbacks.Callback):
    """The link's counters before training, after step 1 (after the timer, which waits
    for the step) and at the end (--netns only)."""

    def _read(self, when):
      link[when] = netns.link_counters(args.link_device, args.netns)

    def on_train_begin(self, logs=None):
      self._read("begin")

    def on_train_batch_end(self, batch, logs=None):
      if batch == 0:
        self._read("after_first_step")

    def on_train_end(self, logs=None):
      self._read("end")

  dense_bytes = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
  callbacks = [timer, StepBytes(), Evaluate()]
  if args.netns and not args.alone:
    callbacks.insert(1, LinkCounters())
  if compressed:
    callbacks.append(stats)
  model.fit(train, epochs=1, steps_per_epoch=args.max_steps, callbacks=callbacks,
            verbose=0, shuffle=False)
  hierarchy = getattr(optimizer, "hierarchy", None) if compressed else None
  with open(args.out, "w") as f:
    json.dump({"worker": index, "workers": workers, "model": args.model,
               "devices_per_worker": devices, "replicas": strategy.num_replicas_in_sync,
               "flat": bool(args.flat), "hierarchical_argument": (
                   getattr(optimizer, "hierarchical", None) if compressed else None),
               # The optimizer's resolved hierarchy (None: the flat exchange).
               "hierarchy": None if hierarchy is None else {
                   "workers": getattr(hierarchy, "workers", None),
                   "devices_per_worker": getattr(hierarchy, "devices_per_worker", None)},
               "link_counters": link or None,
               "link_bytes_per_step": link_per_step(
                   link["begin"], link.get("after_first_step"), link["end"],
                   len(timer.times)) if link else None,
               "compressor": args.compressor, "alone": args.alone,
               "local_steps": local_steps, "log_reduction": args.log_reduction,
               "exchange_choice": (optimizer.exchange_choice() if compressed else None),
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
