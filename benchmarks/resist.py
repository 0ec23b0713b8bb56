"""Evidence for ResIST: accuracy and bytes per round against data-parallel and local SGD.

Each run is the cifar10_resist example in its own process (its summary.json holds the
test accuracy and the bytes one replica sent per round): the same pre-activation ResNet,
data (Fashion-MNIST padded to 32x32x3, offline; or --dataset=cifar10 where tfds has it),
global batch, learning rate schedule, epochs and steps, for every method and replica
count (MirroredStrategy over logical CPU devices):

- data_parallel: a gradient all-reduce every step (every trainable parameter, float32);
- local_sgd: every replica trains the whole network on its own data, all variables are
  averaged every --local_steps steps;
- resist: every replica trains its sub-ResNet, each variable is averaged over the
  replicas that held it every --local_steps steps (only what a replica trained is sent).

A round is --local_steps steps; "bytes/replica/round" is what one replica sends in it
(data-parallel: --local_steps gradient all-reduces).

    python benchmarks/resist.py                      # 2 and 4 replicas, every method
    python benchmarks/resist.py --replicas 2 --epochs 1 --steps_per_epoch 50

Prints the table and writes out/resist.json.
"""

import argparse
import os
import platform
import sys

import report  # benchmarks/report.py, beside this script

EXAMPLE = "cifar10_resist"
METHODS = ("data_parallel", "local_sgd", "resist")


def row(summary):
  figures = summary["resist"]
  per_round = summary["bytes_per_round"]
  return {
      "method": summary["method"],
      "replicas": summary["replicas"],
      "test_accuracy": summary["test_accuracy"],
      "bytes_per_round": per_round,
      "padded_bytes_per_round": figures.get("padded_bytes_per_round", per_round),
      "vs_data_parallel": figures["data_parallel_bytes_per_round"] / per_round,
      "vs_local_sgd": figures["local_sgd_bytes_per_round"] / per_round,
      "rounds": figures.get("rounds"),
      "steps": summary["steps"],
      "batch_size": summary["batch_size"],
      "parameters": summary["parameters"],
      "train_seconds": summary["train_seconds"],
      "config": summary["config"],
  }


def print_table(title, rows):
  print(f"\n{title}")
  print(f"{'method':<14} {'replicas':>8} {'test acc':>9} {'bytes/replica/round':>20} "
        f"{'DP/this':>8} {'LSGD/this':>10} {'steps':>6} {'train s':>8}")
  for r in rows:
    print(f"{r['method']:<14} {r['replicas']:>8} {r['test_accuracy']:>9.4f} "
          f"{r['bytes_per_round']:>20,.0f} {r['vs_data_parallel']:>7.1f}x "
          f"{r['vs_local_sgd']:>9.2f}x {r['steps']:>6} {r['train_seconds']:>8.1f}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--methods", default=",".join(METHODS), help=f"some of {METHODS}")
  parser.add_argument("--replicas", default="2,4", help="comma-separated replica counts")
  parser.add_argument("--dataset", default="fashion_mnist", choices=("fashion_mnist", "cifar10"))
  parser.add_argument("--depth", type=int, default=20)
  parser.add_argument("--width", type=int, default=16)
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--steps_per_epoch", type=int, default=200)
  parser.add_argument("--local_steps", type=int, default=50)
  parser.add_argument("--min_blocks", type=int, default=0)
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--learning_rate", type=float, default=0.1)
  parser.add_argument("--lr_schedule", default="cosine")
  parser.add_argument("--eval_steps", type=int, default=None, help="default: the test set")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--synthetic", action="store_true", help="random data (smoke runs)")
  parser.add_argument("--work_dir", default="out/resist")
  parser.add_argument("--json", default="out/resist.json")
  args = parser.parse_args(argv)
  methods = args.methods.split(",")
  unknown = sorted(set(methods) - set(METHODS))
  if unknown:
    parser.error(f"--methods must be some of {METHODS}. Received: {unknown}")
  try:
    replica_counts = [int(r) for r in args.replicas.split(",")]
  except ValueError:
    parser.error(f"--replicas must be comma-separated ints. Received: {args.replicas!r}")

  shared = [f"--dataset={args.dataset}", f"--depth={args.depth}", f"--width={args.width}",
            f"--epochs={args.epochs}", f"--steps_per_epoch={args.steps_per_epoch}",
            f"--local_steps={args.local_steps}", f"--min_blocks={args.min_blocks}",
            f"--batch_size={args.batch_size}", f"--learning_rate={args.learning_rate}",
            f"--lr_schedule={args.lr_schedule}", f"--seed={args.seed}", "--verbose=0"]
  if args.eval_steps:
    shared.append(f"--eval_steps={args.eval_steps}")
  if args.synthetic:
    shared.append("--synthetic")

  result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": sys.version.split()[0]},
            "example": EXAMPLE, "args": vars(args), "rows": []}
  for replicas in replica_counts:
    for method in methods:
      directory = os.path.join(args.work_dir, f"{method}_{replicas}")
      summary = report.run_example(
          EXAMPLE, shared + [f"--method={method}", f"--replicas={replicas}"], directory)
      result["rows"].append(row(summary))
      report.write_json(args.json, result)  # after every run: a partial table survives
  print_table(f"{EXAMPLE}: {args.dataset}, pre-activation ResNet-{args.depth} (width "
              f"{args.width}), {args.epochs} x {args.steps_per_epoch} steps of global batch "
              f"{args.batch_size}, rounds of {args.local_steps} steps", result["rows"])


if __name__ == "__main__":
  main()
