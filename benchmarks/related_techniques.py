"""Evidence for the related techniques: Adasum, FFT compression and LEGW on Fashion-MNIST.

Two tables, each run being the fashion_mnist example in its own process (its
summary.json holds the test accuracy and the bytes one replica sent per step):

1. Compression and reduction, 4 replicas (MirroredStrategy over logical CPU devices), the
   same model, data, batch (128), learning rate and epochs: dense (no compression),
   AdaComp, FFT, AdaComp + Adasum of gradients, AdaComp + Adasum of deltas (Horovod's).
2. A large batch (1024 = 8 x the example's 128) trained for the same epochs as its base
   batch, with the base batch's learning rate and warm-up scaled two ways: linear scaling
   (rate x 8, same warm-up epochs, cosine decay; Goyal et al. 2017), linear scaling with
   LEGW's longer warm-up, and LEGW (rate x sqrt(8), warm-up x 8 epochs, polynomial decay;
   You et al. 2019); the base batch run is the reference.

    python benchmarks/related_techniques.py                # both tables, seed 0
    python benchmarks/related_techniques.py --epochs 1 --tables compression
    python benchmarks/related_techniques.py --seeds 0,1,2   # each run with 3 seeds

Prints both tables (test accuracy: the mean over the seeds, and its range) and writes
out/related_techniques.json.
"""

import argparse
import os
import platform
import statistics
import sys

import report  # benchmarks/report.py, beside this script

EXAMPLE = "fashion_mnist"
# name -> the flags that make the run (beside the shared ones).
COMPRESSION_RUNS = {
    "dense": ["--compressor=none"],
    "adacomp": ["--compressor=adacomp"],
    "fft": ["--compressor=fft"],
    "adacomp+adasum": ["--compressor=adacomp", "--reduction=adasum"],
    "adacomp+adasum(delta)": ["--compressor=adacomp", "--reduction=adasum",
                              "--adasum_mode=delta"],
}
TABLES = ("compression", "large_batch")


def large_batch_runs(args):
  """Base batch, then 8x the batch with linear scaling and with LEGW."""
  k = args.large_batch // args.base_batch
  warmup = args.base_warmup_epochs
  return {
      f"base batch {args.base_batch}": [
          f"--batch_size={args.base_batch}", f"--learning_rate={args.base_learning_rate}",
          f"--warmup_epochs={warmup}", "--lr_schedule=cosine"],
      f"batch {args.large_batch}, linear scaling": [
          f"--batch_size={args.large_batch}",
          f"--learning_rate={k * args.base_learning_rate}", f"--warmup_epochs={warmup}",
          "--lr_schedule=cosine"],
      # LEGW's warm-up length with the linear peak: which of the two changes matters.
      f"batch {args.large_batch}, linear, warm-up x{k}": [
          f"--batch_size={args.large_batch}",
          f"--learning_rate={k * args.base_learning_rate}", f"--warmup_epochs={k * warmup}",
          "--lr_schedule=cosine"],
      f"batch {args.large_batch}, LEGW": [
          f"--batch_size={args.large_batch}", f"--learning_rate={args.base_learning_rate}",
          f"--warmup_epochs={warmup}", "--lr_schedule=legw",
          f"--base_batch_size={args.base_batch}"],
  }


def row(name, summaries):
  """One table row from the runs of every seed: accuracy mean and range, mean bytes."""
  accuracies = [s["test_accuracy"] for s in summaries]
  mean = lambda key: statistics.fmean(s[key] for s in summaries)  # noqa: E731
  return {
      "run": name,
      "test_accuracy": statistics.fmean(accuracies),
      "test_accuracy_min": min(accuracies),
      "test_accuracy_max": max(accuracies),
      "test_accuracies": accuracies,
      "seeds": [s["config"]["seed"] for s in summaries],
      "bytes_sent_per_step": mean("bytes_sent_per_step"),
      "dense_bytes_per_step": mean("dense_bytes_per_step"),
      "compression_ratio": mean("dense_bytes_per_step") / mean("bytes_sent_per_step"),
      "steps": summaries[0]["steps"],
      "batch_size": summaries[0]["batch_size"],
      "train_seconds": mean("train_seconds"),
      "configs": [s["config"] for s in summaries],
  }


def print_table(title, rows):
  print(f"\n{title}")
  print(f"{'run':<34} {'test acc (min-max)':>24} {'bytes/replica/step':>19} {'ratio':>7} "
        f"{'steps':>6} {'train s':>8}")
  for r in rows:
    accuracy = (f"{r['test_accuracy']:.4f} ({r['test_accuracy_min']:.4f}-"
                f"{r['test_accuracy_max']:.4f})")
    print(f"{r['run']:<34} {accuracy:>24} {r['bytes_sent_per_step']:>19,.0f} "
          f"{r['compression_ratio']:>6.1f}x {r['steps']:>6} {r['train_seconds']:>8.1f}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tables", default=",".join(TABLES),
                      help=f"comma-separated, of {TABLES}")
  parser.add_argument("--replicas", type=int, default=4)
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--steps_per_epoch", type=int, default=None,
                      help="default: one pass over the training set")
  parser.add_argument("--eval_steps", type=int, default=None)
  parser.add_argument("--base_batch", type=int, default=128)
  parser.add_argument("--large_batch", type=int, default=1024)
  parser.add_argument("--base_learning_rate", type=float, default=0.05)
  parser.add_argument("--base_warmup_epochs", type=float, default=0.1)
  parser.add_argument("--large_batch_compressor", default="none")
  parser.add_argument("--seeds", default="0",
                      help="comma-separated seeds; each run is repeated with each")
  parser.add_argument("--synthetic", action="store_true", help="random data (smoke runs)")
  parser.add_argument("--work_dir", default="out/related_techniques")
  parser.add_argument("--json", default="out/related_techniques.json")
  args = parser.parse_args(argv)
  tables = args.tables.split(",")
  unknown = sorted(set(tables) - set(TABLES))
  if unknown:
    parser.error(f"--tables must be some of {TABLES}. Received: {unknown}")
  if args.large_batch % args.base_batch:
    parser.error(f"--large_batch must be a multiple of --base_batch={args.base_batch}. "
                 f"Received: --large_batch={args.large_batch}")

  shared = [f"--replicas={args.replicas}", f"--epochs={args.epochs}", "--verbose=0"]
  if args.steps_per_epoch:
    shared.append(f"--steps_per_epoch={args.steps_per_epoch}")
  if args.eval_steps:
    shared.append(f"--eval_steps={args.eval_steps}")
  if args.synthetic:
    shared.append("--synthetic")

  seeds = [int(seed) for seed in args.seeds.split(",")]

  def run(table, name, flags):
    directory = os.path.join(args.work_dir, table, name.replace(" ", "_").replace(",", ""))
    return row(name, [report.run_example(EXAMPLE, shared + flags + [f"--seed={seed}"],
                                         f"{directory}_seed{seed}") for seed in seeds])

  result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": sys.version.split()[0]},
            "example": EXAMPLE, "args": vars(args), "tables": {}}
  if "compression" in tables:
    rows = [run("compression", name, flags) for name, flags in COMPRESSION_RUNS.items()]
    result["tables"]["compression"] = rows
    print_table(f"{EXAMPLE}, {args.replicas} replicas, {args.epochs} epochs, batch 128", rows)
  if "large_batch" in tables:
    rows = [run("large_batch", name, flags + [f"--compressor={args.large_batch_compressor}"])
            for name, flags in large_batch_runs(args).items()]
    result["tables"]["large_batch"] = rows
    print_table(f"{EXAMPLE}, {args.replicas} replicas, {args.epochs} epochs, "
                f"compressor {args.large_batch_compressor}", rows)
  report.write_json(args.json, result)


if __name__ == "__main__":
  main()
