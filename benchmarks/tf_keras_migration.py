"""The migrated Horovod script (examples/tf_keras_fashion_mnist.py) on a slow link, per compressor.

Runs the script's 2 (--workers) tf_keras workers under MultiWorkerMirroredStrategy, each
in its own network namespace joined at --rate (benchmarks/netns.py; "none": 127.0.0.1,
no limit), once per --compressors entry, with the same seed, steps and data: "none" is
the dense float32 all-reduce (the wrapper sends every gradient whole, which trains as
the plain optimizer: tests/test_tf_keras.py), "fp16" is what Horovod's
``compression=hvd.Compression.fp16`` sent, "adacomp" the library's default. Each run
reports the chief's test accuracy after --epochs x --steps_per_epoch steps (equal steps
for every run), the mean step time of the epochs after the first (the first traces and
compiles), the wall time of the whole job, and the bytes one worker sent in the last
step (the optimizer's ``bytes_sent``, read from the chief's last checkpoint).

    sudo .venv/bin/python benchmarks/tf_keras_migration.py --rate 100mbit

Prints a table and writes --out (JSON). Needs root for the namespaces (not with
``--rate none``).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import netns  # noqa: E402  pylint: disable=wrong-import-position

SCRIPT = os.path.join(ROOT, "examples", "tf_keras_fashion_mnist.py")
PORT = 2222
EPOCH_LINE = re.compile(r"(\d+)/\1 - \S+ - .*?- (\d+)(m?s)/step")


def run(args, compressor, net, work):
  """One job of ``args.workers`` workers with ``compressor``: its figures."""
  from tf_adacomp import distribute  # pylint: disable=import-outside-toplevel
  hosts = ([f"{net.address(i)}:{PORT}" for i in range(args.workers)] if net else
           [f"127.0.0.1:{PORT + i}" for i in range(args.workers)])
  checkpoints = os.path.join(work, compressor)
  processes, logs = [], []
  start = time.perf_counter()
  for i in range(args.workers):
    env = dict(os.environ, TF_CONFIG=distribute.tf_config(hosts, i), COMPRESSOR=compressor,
               EPOCHS=str(args.epochs), STEPS_PER_EPOCH=str(args.steps_per_epoch),
               CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    argv = [sys.executable, SCRIPT, checkpoints]
    log = tempfile.TemporaryFile(mode="w+")
    logs.append(log)
    processes.append(subprocess.Popen(net.command(i, argv) if net else argv, env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
  codes = [p.wait(timeout=args.timeout) for p in processes]
  wall = time.perf_counter() - start
  logs[0].seek(0)
  chief = logs[0].read()
  if any(codes):
    for i, log in enumerate(logs):
      log.seek(0)
      print(f"--- worker {i} (rc {codes[i]}) ---\n{log.read()[-3000:]}", file=sys.stderr)
    raise RuntimeError(f"{compressor}: return codes {codes}")
  step_ms = [int(value) * (1 if unit == "ms" else 1000)
             for _, value, unit in EPOCH_LINE.findall(chief)]
  accuracy = float(re.search(r"test accuracy (\S+)", chief).group(1))
  return {"compressor": compressor, "test_accuracy": accuracy,
          "steps": args.epochs * args.steps_per_epoch,
          "step_ms_per_epoch": step_ms,
          "step_ms": sum(step_ms[1:]) / max(1, len(step_ms) - 1),
          "wall_seconds": wall,
          "bytes_per_step": last_step_bytes(os.path.join(checkpoints,
                                                         f"checkpoint-{args.epochs}"))}


def last_step_bytes(checkpoint):
  """The bytes one worker sent in the last step: the sum of the optimizer's
  ``bytes_sent`` (one entry per variable) in ``checkpoint``."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  reader = tf.train.load_checkpoint(checkpoint)
  (key,) = [k for k in reader.get_variable_to_shape_map() if "optimizer/bytes_sent" in k]
  return int(reader.get_tensor(key).sum())


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--compressors", default="none,fp16,adacomp")
  parser.add_argument("--rate", default="100mbit", help='a tc rate, or "none" (127.0.0.1)')
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--steps_per_epoch", type=int, default=100)
  parser.add_argument("--timeout", type=float, default=1800, help="seconds per job")
  parser.add_argument("--out", default="tf_keras_migration.json")
  args = parser.parse_args(argv)
  runs = []
  with tempfile.TemporaryDirectory() as work:
    if args.rate == "none":
      runs = [run(args, c, None, work) for c in args.compressors.split(",")]
    else:
      with netns.LimitedNetwork(hosts=args.workers, rate=args.rate) as net:
        runs = [run(args, c, net, work) for c in args.compressors.split(",")]
  dense = next((r for r in runs if r["compressor"] == "none"), None)
  print(f"{args.workers} workers, {args.rate}, {runs[0]['steps']} steps each")
  print(f"{'compressor':<12}{'test acc':>10}{'ms/step':>10}{'vs dense':>10}"
        f"{'B/step':>12}{'wall s':>9}")
  for r in runs:
    speed = f"{dense['step_ms'] / r['step_ms']:.2f}x" if dense and r["step_ms"] else "-"
    print(f"{r['compressor']:<12}{r['test_accuracy']:>10.4f}{r['step_ms']:>10.1f}"
          f"{speed:>10}{r['bytes_per_step']:>12,}{r['wall_seconds']:>9.1f}")
  with open(args.out, "w") as f:
    json.dump({"rate": args.rate, "workers": args.workers, "runs": runs}, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
