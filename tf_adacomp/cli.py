"""The ``tf-adacomp`` command: ``tf-adacomp demo`` trains with and without AdaComp.

The demo trains a small CNN on scikit-learn's bundled handwritten digits (real data,
no download) as 4 simulated learners, once with dense exchange and once with AdaComp,
and prints test accuracy and bytes sent per step side by side.
"""

import argparse
import json
import sys
import time


def _digits(seed: int):
  import numpy as np
  from sklearn.datasets import load_digits

  data = load_digits()
  x = (data.images / 16.0).astype("float32")[..., None]
  y = data.target.astype("int32")
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order]
  split = int(0.8 * len(x))
  return (x[:split], y[:split]), (x[split:], y[split:])


def _model(seed: int):
  import keras

  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input([8, 8, 1]),
      keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
      keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
      keras.layers.MaxPooling2D(),
      keras.layers.Flatten(),
      keras.layers.Dense(256, activation="relu"),
      keras.layers.Dense(10),
  ])


def run_demo(compressor: str, steps: int, learners: int, batch_size: int, seed: int = 0):
  """Trains the demo model; returns a summary dict (accuracy, bytes, ratios, time)."""
  import keras
  import numpy as np
  import tensorflow as tf

  from tf_adacomp import simulate

  (x_train, y_train), (x_test, y_test) = _digits(seed)
  model = _model(seed)
  trainer = simulate.SimulatedLearners(
      model, keras.optimizers.SGD(0.05, momentum=0.9),
      keras.losses.SparseCategoricalCrossentropy(from_logits=True), compressor, learners)
  rng = np.random.default_rng(seed)
  sent_steps, start = [], time.perf_counter()
  for _ in range(steps):
    idx = rng.choice(len(x_train), batch_size, replace=False)
    loss, sent = trainer.train_step(tf.constant(x_train[idx]), tf.constant(y_train[idx]))
    sent_steps.append({k: int(v) for k, v in sent.items()})
  wall = time.perf_counter() - start
  accuracy = float(np.mean(np.argmax(model.predict(x_test, verbose=0), -1) == y_test))
  return {"compressor": compressor, "learners": learners, "steps": steps,
          "batch_size": batch_size, "test_accuracy": accuracy, "final_loss": float(loss),
          "wall_seconds": wall,
          "compression": simulate.compression_report(trainer.plans, sent_steps)}


def _print_side_by_side(summaries):
  names = [s["compressor"] for s in summaries]
  print("\n" + " " * 34 + "".join(f"{n:>16}" for n in names))
  rows = [("test accuracy", lambda s: f"{s['test_accuracy']:.4f}"),
          ("bytes sent / learner / step", lambda s: f"{s['compression']['total']['sent_bytes']:.0f}"),
          ("dense float32 bytes", lambda s: f"{s['compression']['total']['dense_bytes']:.0f}"),
          ("compression ratio (total)", lambda s: f"{s['compression']['total']['ratio']:.1f}x")]
  kinds = sorted(k for k in summaries[0]["compression"] if k != "total")
  rows += [(f"  ratio, {k} layers", (lambda k: lambda s: f"{s['compression'][k]['ratio']:.1f}x")(k))
           for k in kinds]
  rows.append(("wall time (s)", lambda s: f"{s['wall_seconds']:.1f}"))
  for label, fmt in rows:
    print(f"{label:<34}" + "".join(f"{fmt(s):>16}" for s in summaries))


def main(argv=None):
  parser = argparse.ArgumentParser(prog="tf-adacomp", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  demo = sub.add_parser("demo", help="train digits with dense exchange and with AdaComp")
  demo.add_argument("--steps", type=int, default=300)
  demo.add_argument("--learners", type=int, default=4)
  demo.add_argument("--batch_size", type=int, default=128)
  demo.add_argument("--compressors", default="none,adacomp",
                    help="comma-separated compressor names to compare")
  demo.add_argument("--json", default="", help="also write the summaries to this file")
  args = parser.parse_args(argv)
  if args.steps < 1 or args.learners < 1 or args.batch_size % args.learners:
    parser.error(f"need --steps >= 1, --learners >= 1 and --batch_size divisible by "
                 f"--learners. Received: steps={args.steps}, learners={args.learners}, "
                 f"batch_size={args.batch_size}")
  summaries = [run_demo(name.strip(), args.steps, args.learners, args.batch_size)
               for name in args.compressors.split(",")]
  _print_side_by_side(summaries)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(summaries, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
