"""The default ``CompressedOptimizer`` against Keras' dense step, paired in one process.

Where communication is free (``MirroredStrategy`` over N logical CPU devices of one
host) the default (``dense_when_faster``) should choose dense and then cost what Keras'
own step costs. The gap is a few percent, below what separate processes can tell apart
on a shared machine (``step_time.py``'s runs of one setting differ by more). So here
both models live in one process and train in alternating blocks of steps, and the
ratio is taken between the medians of their step times: a drift of the machine's speed
falls on both alike.

The model is the Fashion-MNIST CNN of ``examples/fashion_mnist.py`` (0.42M parameters)
on random images of its shape (the step's time does not depend on the values), global
batch 128, SGD 0.05 with momentum 0.9; the default optimizer is
``CompressedOptimizer(SGD(...), compressor=--compressor)`` with nothing else set
(``--dense_when_faster=float32``: that setting, float32 the only dense candidate). Both
first train ``--warmup_steps`` untimed (compilation; the default's probes, 20
exchanges), then ``--blocks`` blocks of ``--block_steps`` each, in turn. A step is
timed from batch begin to batch end.

With ``--local_steps H`` the wrapper is ``CompressedOptimizer(SGD(...), local_steps=H)``
instead: its steps inside a round (which send nothing) and its rounds' ends are reported
apart, each against Keras' step (its median; H must divide ``--warmup_steps`` and
``--block_steps``, so that every block holds whole rounds). ``--model mlp`` trains
``network.py``'s wide MLP (5.8M parameters) instead of the CNN.

    python benchmarks/paired_step.py                  # 2 replicas, 12 blocks of 20
    python benchmarks/paired_step.py --replicas 4 --json out/paired_step.json
    python benchmarks/paired_step.py --model mlp --local_steps 8 --warmup_steps 48 \
        --block_steps 16
"""

import argparse
import json
import os
import platform
import statistics
import time


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--replicas", type=int, default=2, help="logical CPU devices")
  parser.add_argument("--compressor", default="adacomp")
  parser.add_argument("--dense_when_faster", default=None, choices=("float32",),
                      help="the wrapper's dense_when_faster (default: the library's)")
  parser.add_argument("--model", default="cnn", choices=("cnn", "mlp"))
  parser.add_argument("--local_steps", type=int, default=None,
                      help="the wrapper with rounds of this many steps (None: the default)")
  parser.add_argument("--warmup_steps", type=int, default=40)
  parser.add_argument("--blocks", type=int, default=12)
  parser.add_argument("--block_steps", type=int, default=20)
  parser.add_argument("--json", default="out/paired_step.json")
  args = parser.parse_args(argv)
  for name in ("replicas", "warmup_steps", "blocks", "block_steps"):
    value = getattr(args, name)
    if value < 1:
      parser.error(f"--{name} must be at least 1. Received: {name}={value}")
  h = args.local_steps
  if h is not None and (h < 2 or args.warmup_steps % h or args.block_steps % h):
    parser.error(f"--local_steps must be at least 2 and divide --warmup_steps "
                 f"({args.warmup_steps}) and --block_steps ({args.block_steps}). "
                 f"Received: local_steps={h}")
  return args


def main(argv=None):
  args = parse_args(argv)  # before TensorFlow: a bad flag fails in a fraction of a second
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
  import keras  # pylint: disable=g-import-not-at-top

  import tf_adacomp  # pylint: disable=g-import-not-at-top
  from tf_adacomp.examples import fashion_mnist  # pylint: disable=g-import-not-at-top
  import network_worker  # pylint: disable=g-import-not-at-top  (benchmarks/, beside this)

  strategy = tf.distribute.MirroredStrategy([f"/cpu:{k}" for k in range(args.replicas)])
  rng = np.random.default_rng(0)
  images = rng.normal(size=(128 * 8, 28, 28, 1)).astype("float32")
  labels = rng.integers(0, 10, 128 * 8)
  data = tf.data.Dataset.from_tensor_slices((images, labels)).batch(128).repeat()

  def compiled(make_optimizer):
    with strategy.scope():  # the optimizer too: its variables are the strategy's
      model = (fashion_mnist.build_model(None, None) if args.model == "cnn"
               else network_worker.build_mlp(2048))
      model.compile(optimizer=make_optimizer(),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    jit_compile=False)
    return model

  class StepTimes(keras.callbacks.Callback):

    def __init__(self):
      super().__init__()
      self.times, self.round_ends, self._start = [], [], None

    def on_train_batch_begin(self, batch, logs=None):
      self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
      self.times.append(time.perf_counter() - self._start)
      if args.local_steps:  # read after the clock stopped
        self.round_ends.append(int(self.model.optimizer.iterations.numpy()) % args.local_steps == 0)

  sgd = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
  models = {"dense": compiled(sgd),
            "default": compiled(lambda: tf_adacomp.CompressedOptimizer(
                sgd(), compressor=args.compressor,
                **({"local_steps": args.local_steps} if args.local_steps else {}),
                **({"dense_when_faster": args.dense_when_faster}
                   if args.dense_when_faster else {})))}
  times = {name: StepTimes() for name in models}
  for model in models.values():
    model.fit(data, steps_per_epoch=args.warmup_steps, epochs=1, verbose=0)
  for _ in range(args.blocks):
    for name, model in models.items():
      model.fit(data, steps_per_epoch=args.block_steps, epochs=1, verbose=0,
                callbacks=[times[name]])
  medians = {name: statistics.median(t.times) for name, t in times.items()}
  ratio = medians["default"] / medians["dense"]
  choice = models["default"].optimizer.exchange_choice()
  print(f"{args.model}, {args.replicas} replicas, {args.blocks} blocks of "
        f"{args.block_steps} steps: dense (Keras) {medians['dense'] * 1e3:.2f} ms, the "
        f"default {medians['default'] * 1e3:.2f} ms, {ratio:.3f}x Keras' step; it chose "
        f"{choice['exchange'] if choice else 'nothing'}")
  rounds = {}
  if args.local_steps:
    t = times["default"]
    for part, at_end in (("inside", False), ("round_end", True)):
      median = statistics.median(x for x, end in zip(t.times, t.round_ends) if end == at_end)
      rounds[part] = {"median_step_seconds": median, "over_dense": median / medians["dense"]}
    print(f"local_steps={args.local_steps}: a step inside a round "
          f"{rounds['inside']['median_step_seconds'] * 1e3:.2f} ms "
          f"({rounds['inside']['over_dense']:.3f}x Keras' step), a round's end "
          f"{rounds['round_end']['median_step_seconds'] * 1e3:.2f} ms "
          f"({rounds['round_end']['over_dense']:.3f}x)")
  out = {"model": args.model, "replicas": args.replicas, "compressor": args.compressor,
         "local_steps": args.local_steps,
         "warmup_steps": args.warmup_steps, "blocks": args.blocks,
         "block_steps": args.block_steps,
         "median_step_seconds": medians, "default_over_dense": ratio,
         "local_rounds": rounds, "round_ends": times["default"].round_ends,
         "exchange_choice": choice,
         "step_seconds": {name: t.times for name, t in times.items()},
         "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                     "tensorflow": tf.__version__}}
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
