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
``CompressedOptimizer(SGD(...), compressor=--compressor)`` with nothing else set. Both
first train ``--warmup_steps`` untimed (compilation; the default's probes, 20
exchanges), then ``--blocks`` blocks of ``--block_steps`` each, in turn. A step is
timed from batch begin to batch end.

    python benchmarks/paired_step.py                  # 2 replicas, 12 blocks of 20
    python benchmarks/paired_step.py --replicas 4 --json out/paired_step.json
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
  parser.add_argument("--warmup_steps", type=int, default=40)
  parser.add_argument("--blocks", type=int, default=12)
  parser.add_argument("--block_steps", type=int, default=20)
  parser.add_argument("--json", default="out/paired_step.json")
  args = parser.parse_args(argv)
  for name in ("replicas", "warmup_steps", "blocks", "block_steps"):
    value = getattr(args, name)
    if value < 1:
      parser.error(f"--{name} must be at least 1. Received: {name}={value}")
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

  strategy = tf.distribute.MirroredStrategy([f"/cpu:{k}" for k in range(args.replicas)])
  rng = np.random.default_rng(0)
  images = rng.normal(size=(128 * 8, 28, 28, 1)).astype("float32")
  labels = rng.integers(0, 10, 128 * 8)
  data = tf.data.Dataset.from_tensor_slices((images, labels)).batch(128).repeat()

  def compiled(make_optimizer):
    with strategy.scope():  # the optimizer too: its variables are the strategy's
      model = fashion_mnist.build_model(None, None)
      model.compile(optimizer=make_optimizer(),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    jit_compile=False)
    return model

  class StepTimes(keras.callbacks.Callback):

    def __init__(self):
      super().__init__()
      self.times, self._start = [], None

    def on_train_batch_begin(self, batch, logs=None):
      self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
      self.times.append(time.perf_counter() - self._start)

  sgd = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
  models = {"dense": compiled(sgd),
            "default": compiled(lambda: tf_adacomp.CompressedOptimizer(
                sgd(), compressor=args.compressor))}
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
  print(f"{args.replicas} replicas, {args.blocks} blocks of {args.block_steps} steps: "
        f"dense (Keras) {medians['dense'] * 1e3:.2f} ms, the default "
        f"{medians['default'] * 1e3:.2f} ms, {ratio:.3f}x Keras' step; it chose "
        f"{choice['exchange'] if choice else 'nothing'}")
  out = {"replicas": args.replicas, "compressor": args.compressor,
         "warmup_steps": args.warmup_steps, "blocks": args.blocks,
         "block_steps": args.block_steps,
         "median_step_seconds": medians, "default_over_dense": ratio,
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
