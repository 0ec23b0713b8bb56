"""Quick convergence check of CompressedOptimizer's exchanges (issue 15).

Fashion-MNIST MLP (784-256-256-10, ReLU), 4 replicas (MirroredStrategy over logical CPU
devices), global batch 128, the same steps, data order and hyper-parameters for every
variant: dense (the inner optimizer alone), AdaComp with exchange="gradients",
exchange="updates", and exchange="updates" with momentum_masking. SGD 0.05 with momentum
0.9 and Adam 0.001. Test accuracy on 2,000 test images every --eval_every steps (steps to
the target accuracy) and on all 10,000 at the end.

    .venv/bin/python benchmarks/convergence_quick.py    # 16 runs, ~30 min on 2 cores
    .venv/bin/python benchmarks/convergence_quick.py --optimizers adam --seeds 0

AdaComp with its default bins (500 for dense kernels) and ``min_size=1000`` (the biases
go dense: half the XLA programs to compile). The figures and what they decided (the
default of ``CompressedOptimizer``'s ``exchange``) are in docs/distributed.md.

Each run is its own process; prints the table and writes out/convergence_quick.json.
"""

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time

DATA = "/usr/share/datasets/fashion-mnist"
VARIANTS = {
    "dense": None,
    "adacomp gradients": dict(exchange="gradients"),
    "adacomp updates": dict(exchange="updates"),
    "adacomp updates+masking": dict(exchange="updates", momentum_masking=True),
}
REPLICAS, BATCH = 4, 128


def read_idx(path):
  import numpy as np
  with gzip.open(path) as f:
    raw = f.read()
  dims = raw[3]
  shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
  return np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape)


def one_run(args):
  """One variant, optimizer and seed; prints a JSON line."""
  import tensorflow as tf
  cpus = tf.config.list_physical_devices("CPU")
  tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(REPLICAS)])
  import keras
  import numpy as np
  import tf_adacomp

  x = read_idx(f"{args.data}/train-images-idx3-ubyte.gz").reshape(-1, 784) / np.float32(255)
  y = read_idx(f"{args.data}/train-labels-idx1-ubyte.gz").astype(np.int32)
  xt = read_idx(f"{args.data}/t10k-images-idx3-ubyte.gz").reshape(-1, 784) / np.float32(255)
  yt = read_idx(f"{args.data}/t10k-labels-idx1-ubyte.gz").astype(np.int32)
  order = np.random.default_rng(args.seed).permutation(len(x))[:args.steps * BATCH]
  x, y = x[order].astype(np.float32), y[order]
  strategy = tf_adacomp.distribute.mirrored_strategy(
      devices=[f"/cpu:{i}" for i in range(REPLICAS)])
  with strategy.scope():
    keras.utils.set_random_seed(args.seed)
    model = keras.Sequential([keras.Input([784]), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    inner = (keras.optimizers.SGD(0.05, momentum=0.9) if args.optimizer == "sgd"
             else keras.optimizers.Adam(0.001))
    options = VARIANTS[args.variant]
    optimizer = inner if options is None else tf_adacomp.CompressedOptimizer(
        inner, tf_adacomp.AdaComp(min_size=1000), **options)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
  start = time.time()
  times = []
  timer = keras.callbacks.LambdaCallback(
      on_epoch_end=lambda epoch, logs: times.append(time.time() - start))
  history = model.fit(x, y, batch_size=BATCH, callbacks=[timer],
                      epochs=args.steps // args.eval_every, steps_per_epoch=args.eval_every,
                      shuffle=False, verbose=0,
                      validation_data=(xt[:2000], yt[:2000].astype(np.int32)))
  _, final = model.evaluate(xt, yt, batch_size=1000, verbose=0)
  stats = optimizer.compression_stats() if options is not None else {}
  print(json.dumps({
      "variant": args.variant, "optimizer": args.optimizer, "seed": args.seed,
      "curve": [round(a, 4) for a in history.history["val_accuracy"]],
      "final_accuracy": final, "seconds": time.time() - start,
      "epoch_seconds": [round(t, 1) for t in times],
      "ratio": stats.get("total", {}).get("ratio")}))


def steps_to(curve, target, every):
  for i, accuracy in enumerate(curve):
    if accuracy >= target:
      return (i + 1) * every
  return None


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--optimizers", default="sgd,adam")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--seeds", default="0,1")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--eval_every", type=int, default=25)
  parser.add_argument("--target", type=float, default=0.80)
  parser.add_argument("--data", default=DATA)
  parser.add_argument("--out", default="out/convergence_quick.json")
  parser.add_argument("--one", nargs=3, metavar=("VARIANT", "OPTIMIZER", "SEED"),
                      help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.one:
    args.variant, args.optimizer, args.seed = args.one[0], args.one[1], int(args.one[2])
    one_run(args)
    return
  runs = []
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
  for optimizer in args.optimizers.split(","):
    for variant in args.variants.split(","):
      for seed in (int(s) for s in args.seeds.split(",")):
        out = subprocess.run(
            [sys.executable, __file__, "--one", variant, optimizer, str(seed),
             f"--steps={args.steps}", f"--eval_every={args.eval_every}", f"--data={args.data}"],
            env=env, capture_output=True, text=True, check=True)
        run = json.loads(out.stdout.strip().splitlines()[-1])
        run["steps_to_target"] = steps_to(run["curve"], args.target, args.eval_every)
        runs.append(run)
        print(json.dumps(run), flush=True)
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"target": args.target, "steps": args.steps, "runs": runs}, f, indent=1)
  print(f"\n| optimizer | variant | steps to {args.target:.0%} (per seed) | final accuracy "
        "mean [min, max] | ratio |")
  print("|---|---|---|---|---|")
  for optimizer in args.optimizers.split(","):
    for variant in args.variants.split(","):
      mine = [r for r in runs if r["optimizer"] == optimizer and r["variant"] == variant]
      finals = [r["final_accuracy"] for r in mine]
      ratio = mine[0]["ratio"]
      print(f"| {optimizer} | {variant} | {', '.join(str(r['steps_to_target']) for r in mine)} "
            f"| {statistics.mean(finals):.4f} [{min(finals):.4f}, {max(finals):.4f}] | "
            f"{'-' if ratio is None else f'{ratio:.0f}x'} |")


if __name__ == "__main__":
  main()
