"""Accuracy and bytes per step: dense vs compressed exchange on 4 logical CPU devices.

Trains the same 64-64-10 MLP on scikit-learn's digits (real data, bundled) with
MirroredStrategy over 4 logical CPU devices, through CompressedOptimizer and through
CompressedAllReduce, for each compressor; prints test accuracy, bytes one replica sends
per step (everything counted) and the compression ratio, and writes JSON.

    python benchmarks/distributed_digits.py --epochs 20 --json out/distributed_digits.json
"""

import argparse
import json
import os
import subprocess
import sys
import time

import tensorflow as tf

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration() for _ in range(4)])

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import digits_data  # noqa: E402  (the tests' data and model, shared on purpose)
import report  # noqa: E402  (benchmarks/report.py, beside this script)
import tf_adacomp  # noqa: E402

DEVICES = [f"/cpu:{i}" for i in range(4)]


def run(path, compressor, epochs, batch_size):
  (x, y), (x_test, y_test) = digits_data.flat()
  sgd = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
  if path == "optimizer":
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    with strategy.scope():
      model = digits_data.mlp(0, tf_adacomp.CompressedOptimizer(sgd(), compressor))
  else:
    strategy = tf.distribute.MirroredStrategy(
        DEVICES, cross_device_ops=tf_adacomp.CompressedAllReduce(compressor))
    with strategy.scope():
      model = digits_data.mlp(0, sgd())
  stats = tf_adacomp.CompressionStats()
  start = time.perf_counter()
  model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, callbacks=[stats])
  wall = time.perf_counter() - start
  history = model.history.history
  accuracy = float(np.mean(np.argmax(model.predict(x_test, verbose=0), -1) == y_test))
  return {"path": path, "compressor": compressor, "epochs": epochs,
          "steps": epochs * -(-len(x) // batch_size), "test_accuracy": accuracy,
          "bytes_sent_per_step": float(np.mean(history["bytes_sent"])),
          "dense_bytes_per_step": 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables),
          "compression_ratio": float(np.mean(history["compression_ratio"])),
          "wall_seconds": wall}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--epochs", type=int, default=20)
  parser.add_argument("--batch_size", type=int, default=64)
  parser.add_argument("--compressors", default="none,adacomp,topk,fp16")
  parser.add_argument("--paths", default="optimizer,cross_device_ops")
  parser.add_argument("--json", default="out/distributed_digits.json")
  parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # path:compressor
  args = parser.parse_args()
  if args.one:
    path, compressor = args.one.split(":")
    print(json.dumps(run(path, compressor, args.epochs, args.batch_size)))
    return
  rows = []
  print(f"{'path':<17}{'compressor':<11}{'steps':>6}{'accuracy':>10}{'bytes/step':>12}"
        f"{'ratio':>9}{'wall s':>8}")
  for path in args.paths.split(","):
    for compressor in args.compressors.split(","):
      # One process per run: several MirroredStrategy objects in one process can clash
      # on collective instance keys (seen with float16 all-reduces after float32 ones).
      out = subprocess.run(
          [sys.executable, __file__, "--one", f"{path}:{compressor}",
           "--epochs", str(args.epochs), "--batch_size", str(args.batch_size)],
          check=True, capture_output=True, text=True).stdout
      r = json.loads(out.strip().splitlines()[-1])
      rows.append(r)
      print(f"{path:<17}{compressor:<11}{r['steps']:>6}{r['test_accuracy']:>10.4f}"
            f"{r['bytes_sent_per_step']:>12.0f}{r['compression_ratio']:>8.1f}x"
            f"{r['wall_seconds']:>8.1f}", flush=True)
  report.write_json(args.json, rows)


if __name__ == "__main__":
  main()
