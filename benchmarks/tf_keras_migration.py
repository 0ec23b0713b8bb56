"""The migrated Horovod script (examples/tf_keras_fashion_mnist.py) on a slow link, per variant.

Runs the script's 2 (--workers) tf_keras workers under MultiWorkerMirroredStrategy, each
in its own network namespace joined at --rate (benchmarks/netns.py; "none": 127.0.0.1,
no limit), once per --variants entry, with the same seed, steps and data. A variant is
the script with its one line of compression replaced: "dense" (no wrapper: the
strategy's own float32 all-reduce), or COMPRESSOR[+EXCHANGE]: "fp16+gradients" is what
Horovod's ``compression=hvd.Compression.fp16`` sent, "adacomp" the script as it is (the
update exchange). Each run reports the chief's test accuracy after --epochs x
--steps_per_epoch steps (equal steps for every run), the mean step time of the epochs
after the first (the first traces and compiles), the wall time of the whole job, and
the bytes one worker sent in the last step (the optimizer's ``bytes_sent``, read from
the chief's last checkpoint; 4 per parameter for dense). The test accuracy after each
epoch comes from the chief's checkpoint of that epoch (evaluated here): the first
epoch at --target gives the steps to the target, timed at the mean step time.

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

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import netns  # noqa: E402  pylint: disable=wrong-import-position

SCRIPT = os.path.join(ROOT, "examples", "tf_keras_fashion_mnist.py")
# The script's one line of compression, which each variant replaces.
WRAPPER_LINE = "  opt = adacomp.CompressedOptimizer(opt)\n"
PORT = 2222
EPOCH_LINE = re.compile(r"(\d+)/\1 - \S+ - .*?- (\d+)(m?s)/step")


def variant_script(variant, work):
  """A copy of the example whose wrapper line is ``variant``'s: "dense" (no wrapper: the
  strategy's own float32 all-reduce), or "COMPRESSOR[+EXCHANGE]" (the wrapper with that
  compressor and exchange; without one, the wrapper's default)."""
  with open(SCRIPT) as f:
    text = f.read()
  if text.count(WRAPPER_LINE) != 1:
    raise RuntimeError(f"{SCRIPT} no longer has the line {WRAPPER_LINE.strip()!r} to vary")
  if variant == "dense":
    line = "  pass  # dense: the strategy's own all-reduce\n"
  else:
    compressor, _, exchange = variant.partition("+")
    extra = f", exchange={exchange!r}" if exchange else ""
    line = f"  opt = adacomp.CompressedOptimizer(opt, compressor={compressor!r}{extra})\n"
  path = os.path.join(work, f"{variant}.py")
  with open(path, "w") as f:
    f.write(text.replace(WRAPPER_LINE, line))
  return path


def run(args, variant, net, work):
  """One job of ``args.workers`` workers with ``variant``: its figures."""
  from tf_adacomp import distribute  # pylint: disable=import-outside-toplevel
  hosts = ([f"{net.address(i)}:{PORT}" for i in range(args.workers)] if net else
           [f"127.0.0.1:{PORT + i}" for i in range(args.workers)])
  script = variant_script(variant, work)
  checkpoints = os.path.join(work, variant)
  processes, logs = [], []
  start = time.perf_counter()
  for i in range(args.workers):
    env = dict(os.environ, TF_CONFIG=distribute.tf_config(hosts, i),
               EPOCHS=str(args.epochs), STEPS_PER_EPOCH=str(args.steps_per_epoch),
               CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    argv = [sys.executable, script, checkpoints]
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
    raise RuntimeError(f"{variant}: return codes {codes}")
  step_ms = [int(value) * (1 if unit == "ms" else 1000)
             for _, value, unit in EPOCH_LINE.findall(chief)]
  accuracy = float(re.search(r"test accuracy (\S+)", chief).group(1))
  result = {"variant": variant, "test_accuracy": accuracy,
            "steps": args.epochs * args.steps_per_epoch,
            "step_ms_per_epoch": step_ms,
            "step_ms": sum(step_ms[1:]) / max(1, len(step_ms) - 1),
            "wall_seconds": wall,
            "bytes_per_step": last_step_bytes(os.path.join(checkpoints,
                                                           f"checkpoint-{args.epochs}")),
            "epoch_accuracy": [checkpoint_accuracy(os.path.join(checkpoints,
                                                                f"checkpoint-{e}"))
                               for e in range(1, args.epochs + 1)]}
  # The first epoch at the target, timed at the mean step time of the later epochs
  # (the first epoch's traces and compiles are one-off).
  reached = [e for e, a in enumerate(result["epoch_accuracy"], 1) if a >= args.target]
  result["steps_to_target"] = reached[0] * args.steps_per_epoch if reached else None
  result["seconds_to_target"] = (result["steps_to_target"] * result["step_ms"] / 1000
                                 if reached else None)
  return result


def checkpoint_accuracy(checkpoint):
  """The test accuracy of the weights in ``checkpoint``, computed here with the example's
  architecture (conv 3x3x32, max-pool, dense 128, dense 10; a changed model fails on
  the shapes)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  reader = tf.train.load_checkpoint(checkpoint)
  w = [reader.get_tensor(f"layer_with_weights-{i}/{name}/.ATTRIBUTES/VARIABLE_VALUE")
       for i in range(3) for name in ("kernel", "bias")]
  images, labels = test_set()
  x = tf.nn.relu(tf.nn.conv2d(images, w[0], 1, "VALID") + w[1])
  x = tf.reshape(tf.nn.max_pool2d(x, 2, 2, "VALID"), [len(images), -1])
  logits = tf.nn.relu(x @ w[2] + w[3]) @ w[4] + w[5]
  return float(np.mean(np.argmax(logits, axis=1) == labels))


def test_set():
  """Fashion-MNIST's 10,000 test images (as the example reads them) and labels."""
  from tf_adacomp.examples import fashion_mnist  # pylint: disable=import-outside-toplevel
  folder = os.environ.get("FASHION_MNIST_DIR", fashion_mnist.DEBIAN_DIR)
  images, labels = (fashion_mnist.read_idx(os.path.join(folder, name))
                    for name in fashion_mnist.FILES["test"])
  return images[..., None].astype("float32") / 255.0, labels.astype("int64")


def last_step_bytes(checkpoint):
  """The bytes one worker sent in the last step: the sum of the optimizer's
  ``bytes_sent`` (one entry per variable) in ``checkpoint``, or with no wrapper 4 bytes
  per weight."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  reader = tf.train.load_checkpoint(checkpoint)
  shapes = reader.get_variable_to_shape_map()
  sent = [k for k in shapes if "optimizer/bytes_sent" in k]
  if sent:
    return int(reader.get_tensor(sent[0]).sum())
  # No wrapper (dense): every weight's float32 gradient.
  return sum(4 * int(np.prod(shape)) for k, shape in shapes.items()
             if k.startswith("layer_with_weights-") and "OPTIMIZER_SLOT" not in k)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--variants", default="dense,fp16+gradients,bf16+gradients,adacomp",
                      help='comma-separated: "dense", or COMPRESSOR[+EXCHANGE] ("fp16+gradients" '
                      'is what Horovod sent)')
  parser.add_argument("--rate", default="100mbit", help='a tc rate, or "none" (127.0.0.1)')
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--steps_per_epoch", type=int, default=100)
  parser.add_argument("--target", type=float, default=0.80,
                      help="test accuracy to time, at the end of an epoch")
  parser.add_argument("--timeout", type=float, default=1800, help="seconds per job")
  parser.add_argument("--out", default="tf_keras_migration.json")
  args = parser.parse_args(argv)
  runs = []
  with tempfile.TemporaryDirectory() as work:
    if args.rate == "none":
      runs = [run(args, v, None, work) for v in args.variants.split(",")]
    else:
      with netns.LimitedNetwork(hosts=args.workers, rate=args.rate) as net:
        runs = [run(args, v, net, work) for v in args.variants.split(",")]
  dense = next((r for r in runs if r["variant"] == "dense"), None)
  print(f"{args.workers} workers, {args.rate}, {runs[0]['steps']} steps each")
  print(f"{'variant':<18}{'test acc':>10}{'ms/step':>10}{'vs dense':>10}"
        f"{'B/step':>12}{'steps to':>10}{'s to':>8}{'wall s':>9}")
  print(f"{'':<58}{args.target:>10.0%}{args.target:>8.0%}")
  for r in runs:
    speed = f"{dense['step_ms'] / r['step_ms']:.2f}x" if dense and r["step_ms"] else "-"
    steps = r["steps_to_target"] or "-"
    seconds = f"{r['seconds_to_target']:.1f}" if r["seconds_to_target"] else "-"
    print(f"{r['variant']:<18}{r['test_accuracy']:>10.4f}{r['step_ms']:>10.1f}"
          f"{speed:>10}{r['bytes_per_step']:>12,}{steps:>10}{seconds:>8}"
          f"{r['wall_seconds']:>9.1f}")
    print(f"{'':<18}accuracy after each epoch: "
          + " ".join(f"{a:.3f}" for a in r["epoch_accuracy"]))
  with open(args.out, "w") as f:
    json.dump({"rate": args.rate, "workers": args.workers, "runs": runs}, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
