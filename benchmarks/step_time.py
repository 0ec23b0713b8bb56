"""Step time of each compressor against the dense all-reduce, where communication is free.

MirroredStrategy over N = 2 and 4 logical CPU devices of one host, the same model
(an example's: the Fashion-MNIST CNN by default, or ResNet-20) and the same global
batch for every compressor; each configuration trains in its own process on the real
Fashion-MNIST files (synthetic data of the same shape when they are absent). A step is
timed from batch begin to batch end (its result waited for), the first --skip steps
(XLA compilation) left out, and the median taken. Figures are ratios to the dense step
of the same N, measured in the same run (these machines are noisy; --rounds repeats
the whole sweep, interleaved, and takes the median ratio).

    python benchmarks/step_time.py                      # CNN, N = 2 and 4
    python benchmarks/step_time.py --model resnet20 --replicas 4 --steps 20
    python benchmarks/step_time.py --compressors adacomp,adacomp+auto --steps 120

A compressor with ``+auto`` runs with ``dense_when_faster=True`` (CompressedOptimizer
measures its compressed exchange against the dense all-reduce during the run, 20
exchanges of probes, and uses the faster): give it enough --steps that the median is a
step of its choice.

Target: AdaComp costs at most 1.3x the dense step. Writes out/step_time.json.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

import report  # benchmarks/report.py, beside this script

TARGET = 1.3
MODELS = {  # the example and its settings for this benchmark
    "cnn": ("fashion_mnist", {}),
    "resnet20": ("cifar10_resnet", {"depth": 20, "dataset": "fashion_mnist"}),
}


def time_one(model, compressor, replicas, args):
  """In a fresh process: trains --steps steps; returns the step times and bytes."""
  import importlib  # pylint: disable=g-import-not-at-top

  from tf_adacomp.examples import flags_and_config  # pylint: disable=g-import-not-at-top
  from tf_adacomp.examples import training  # pylint: disable=g-import-not-at-top
  import timing  # pylint: disable=g-import-not-at-top

  name, options = MODELS[model]
  example = importlib.import_module(f"tf_adacomp.examples.{name}")
  base, auto = split_auto(compressor)
  config = flags_and_config.make_config(
      example, compressor=base, dense_when_faster=auto, replicas=replicas, epochs=1,
      steps_per_epoch=args.skip + args.steps, eval_steps=1, batch_size=args.batch_size,
      learning_rate=args.learning_rate, lr_schedule="constant", verbose=0,
      synthetic=args.synthetic or None, **options)
  timer = timing.StepTimer(skip=args.skip)
  summary = training.train(example, config, callbacks=[timer])
  return {"model": model, "compressor": compressor, "replicas": replicas,
          "median_step_seconds": timer.median(), "step_seconds": timer.times,
          "bytes_sent_per_step": summary["bytes_sent_per_step"],
          "compression_ratio": summary["compression_ratio"],
          "parameters": summary["parameters"], "synthetic": summary["synthetic"]}


def split_auto(compressor):
  """``"adacomp+auto"`` -> ``("adacomp", True)``; ``"adacomp"`` -> ``("adacomp", False)``.

  Raises:
    ValueError: another suffix, naming the compressor.
  """
  base, plus, suffix = compressor.partition("+")
  if plus and suffix != "auto":
    raise ValueError(f"A compressor's one suffix is +auto (dense_when_faster=True). "
                     f"Received: compressor={compressor!r}")
  return base, bool(plus)


def run_one(model, compressor, replicas, args):
  """``time_one`` in its own process (one TensorFlow, one set of logical devices)."""
  command = [sys.executable, os.path.abspath(__file__), f"--one={compressor}:{replicas}",
             f"--model={model}", f"--steps={args.steps}", f"--skip={args.skip}",
             f"--batch_size={args.batch_size}", f"--learning_rate={args.learning_rate}"]
  if args.synthetic:
    command.append("--synthetic")
  result = subprocess.run(command, capture_output=True, text=True, check=False)
  if result.returncode:
    raise RuntimeError(f"{compressor} on {replicas} replicas failed "
                       f"(rc {result.returncode}):\n{result.stderr[-3000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="cnn", choices=tuple(MODELS))
  parser.add_argument("--replicas", default="2,4", help="comma-separated device counts")
  parser.add_argument("--compressors", default="none,adacomp,topk,fp16",
                      help="comma-separated; 'none' (the dense all-reduce) is always run")
  parser.add_argument("--steps", type=int, default=40, help="timed steps per run")
  parser.add_argument("--skip", type=int, default=3, help="untimed first steps (compiling)")
  parser.add_argument("--rounds", type=int, default=1, help="sweeps, interleaved")
  parser.add_argument("--batch_size", type=int, default=128, help="global batch")
  parser.add_argument("--learning_rate", type=float, default=0.05)
  parser.add_argument("--synthetic", action="store_true", help="random data (smoke runs)")
  parser.add_argument("--json", default="out/step_time.json")
  parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # compressor:replicas
  args = parser.parse_args(argv)
  for name in ("steps", "skip", "rounds", "batch_size"):
    if getattr(args, name) < (0 if name == "skip" else 1):
      parser.error(f"--{name} must be >= {0 if name == 'skip' else 1}. "
                   f"Received: {name}={getattr(args, name)}")
  if args.one:
    compressor, replicas = args.one.split(":")
    print(json.dumps(time_one(args.model, compressor, int(replicas), args)))
    return

  replica_counts = [int(n) for n in args.replicas.split(",")]
  compressors = ["none"] + [c for c in args.compressors.split(",") if c != "none"]
  for compressor in compressors:
    try:
      split_auto(compressor)
    except ValueError as error:
      parser.error(str(error))
  runs = []
  for round_index in range(args.rounds):
    for replicas in replica_counts:
      for compressor in compressors:
        run = run_one(args.model, compressor, replicas, args)
        run["round"] = round_index
        runs.append(run)
        print(f"round {round_index} N={replicas} {compressor:<8} "
              f"{1e3 * run['median_step_seconds']:8.1f} ms/step, first step "
              f"{run['step_seconds'][0]:.1f} s", flush=True)

  rows = []
  print(f"\n{args.model}, global batch {args.batch_size}, median of {args.steps} steps, "
        f"{args.rounds} round(s)")
  print(f"{'N':>3}{'compressor':>12}{'ms/step':>10}{'x dense':>10}{'bytes/step':>13}"
        f"{'ratio':>9}{'first step s':>14}")
  for replicas in replica_counts:
    for compressor in compressors:
      mine = [r for r in runs if r["replicas"] == replicas and r["compressor"] == compressor]
      ratios = [r["median_step_seconds"] / d["median_step_seconds"] for r in mine
                for d in runs if d["replicas"] == replicas and d["compressor"] == "none"
                and d["round"] == r["round"]]
      row = {"replicas": replicas, "compressor": compressor,
             "median_step_seconds": statistics.median(r["median_step_seconds"] for r in mine),
             # The first step traces the training step and compiles its programs.
             "first_step_seconds": statistics.median(r["step_seconds"][0] for r in mine),
             "step_ratio_to_dense": statistics.median(ratios),
             "bytes_sent_per_step": mine[0]["bytes_sent_per_step"],
             "compression_ratio": mine[0]["compression_ratio"]}
      rows.append(row)
      print(f"{replicas:>3}{compressor:>12}{1e3 * row['median_step_seconds']:>10.1f}"
            f"{row['step_ratio_to_dense']:>9.2f}x{row['bytes_sent_per_step']:>13,.0f}"
            f"{row['compression_ratio']:>8.1f}x{row['first_step_seconds']:>14.1f}")
  for row in rows:
    if row["compressor"] == "adacomp":
      verdict = "met" if row["step_ratio_to_dense"] <= TARGET else "NOT met"
      print(f"target (AdaComp <= {TARGET}x dense) at N={row['replicas']}: {verdict}")
  report.write_json(args.json, {
      "benchmark": "step_time", "model": args.model, "batch_size": args.batch_size,
      "steps": args.steps, "skip": args.skip, "rounds": args.rounds, "target": TARGET,
      "machine": platform.platform(), "cpus": os.cpu_count(),
      "processor": platform.processor() or platform.machine(), "rows": rows, "runs": runs})


if __name__ == "__main__":
  main()
