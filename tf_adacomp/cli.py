"""The ``tf-adacomp`` command: run the examples by name, or the side-by-side demo.

    tf-adacomp demo                       # Fashion-MNIST, 4 CPU replicas, AdaComp vs dense
    tf-adacomp train fashion_mnist --compressor=adacomp --replicas=4
    tf-adacomp train cifar10_resnet --help

``train`` runs ``tf_adacomp.examples.<name>`` with the flags that follow it. ``demo``
runs the Fashion-MNIST example once per compressor, each in its own process (one
TensorFlow, one set of devices, per run), then prints their summaries side by side and
draws them (``demo.png``).

Both are quiet: TensorFlow's C++ start-up lines (cuda stubs, cuInit, oneDNN,
cpu_feature_guard, XLA service) are hidden, unless ``TF_CPP_MIN_LOG_LEVEL`` is set or
``tf-adacomp --verbose ...`` is given; Keras' progress bar and every Python warning
and error stay. The runs are child processes whose stderr passes through a line filter
(``_is_start_up_noise``): some of these lines come from absl's C++ logging, which
``TF_CPP_MIN_LOG_LEVEL`` does not reach. This module imports nothing heavy, because
``tf_adacomp/__init__.py`` asks it (``quiet_tensorflow_import``) before TensorFlow loads.
"""

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading

EXAMPLES = ("fashion_mnist", "cifar10_resnet", "cifar10_resist", "imagenet_resnet50",
            "shakespeare_lstm")


# --- Quiet start-up ------------------------------------------------------------------

# TensorFlow's C++ log lines ("I0000 00:00:1795426589.056564    3750 file.cc:31] ...") and
# absl's notice before its first one; the W and E lines kept are those not listed below.
_LOG_LINE = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ ([\w.-]+):\d+\] ")
_NOISY_SOURCES = {  # W and E lines that every CPU-only or GPU start prints, harmless
    "cuda_platform.cc", "cuda_dnn.cc", "cuda_fft.cc", "cuda_blas.cc", "dataset.cc",
    "cuda_executor.cc", "gpu_device.cc", "cudart_stub.cc",
}
_NOISY_LINES = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "To enable the following instructions:",  # cpu_feature_guard's second line
    "oneDNN custom operations are on.",
)


def _is_start_up_noise(line: str) -> bool:
  """Whether a stderr line is TensorFlow start-up noise (hidden unless --verbose)."""
  match = _LOG_LINE.match(line)
  if match:
    return match.group(1) == "I" or match.group(2) in _NOISY_SOURCES
  return line.startswith(_NOISY_LINES)


def _wants_verbose(argv) -> bool:
  """``--verbose`` before the command, or a TF_CPP_MIN_LOG_LEVEL the user chose."""
  options = []
  for arg in argv:
    if not arg.startswith("-"):
      break
    options.append(arg)
  return "--verbose" in options or "TF_CPP_MIN_LOG_LEVEL" in os.environ


def _is_this_command() -> bool:
  """Whether this process is the ``tf-adacomp`` command (script or ``-m tf_adacomp.cli``)."""
  if os.path.basename(sys.argv[0]).startswith("tf-adacomp"):
    return True
  orig = getattr(sys, "orig_argv", [])
  return any(a == "-m" and b == "tf_adacomp.cli" for a, b in zip(orig, orig[1:]))


@contextlib.contextmanager
def quiet_tensorflow_import():
  """Around the package's ``import tensorflow``: in the quiet command, stderr (fd 2) is
  sent to /dev/null for the import alone (only start-up lines are printed there; an
  import error is raised, and printed, after it). Elsewhere: nothing."""
  if not _is_this_command() or _wants_verbose(sys.argv[1:]):
    yield
    return
  sys.stderr.flush()
  saved = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  try:
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(devnull)


def _run(command, quiet) -> int:
  """Runs ``command``; when ``quiet``, its stderr passes through the start-up filter."""
  if not quiet:
    return subprocess.run(command, check=False).returncode
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True,
                             errors="replace", bufsize=1)

  def forward():
    for line in process.stderr:
      if not _is_start_up_noise(line):
        sys.stderr.write(line)
        sys.stderr.flush()

  thread = threading.Thread(target=forward, daemon=True)
  thread.start()
  try:
    code = process.wait()
  except KeyboardInterrupt:  # the child got the signal too; let it finish
    code = process.wait()
  thread.join()
  return code


# --- Commands ------------------------------------------------------------------------


def _train(name, flags, quiet) -> int:
  # Exactly `python -m tf_adacomp.examples.<name> <flags>`: absl then shows that
  # example's docstring and flags in --help.
  return _run([sys.executable, "-m", f"tf_adacomp.examples.{name}", *flags], quiet)


def _demo(args, extra_flags, quiet) -> int:
  from tf_adacomp.examples import common

  root = args.model_dir or tempfile.mkdtemp(prefix="tf_adacomp_demo_")
  summaries = []
  for compressor in args.compressors.split(","):
    model_dir = os.path.join(root, compressor)
    command = [sys.executable, "-m", "tf_adacomp.examples.fashion_mnist",
               f"--compressor={compressor}", f"--replicas={args.replicas}",
               f"--model_dir={model_dir}", *extra_flags]
    print(f"\n$ {' '.join(command[1:])}", flush=True)
    if _run(command, quiet):
      print(f"tf-adacomp demo: the {compressor} run failed (its output is above).",
            file=sys.stderr)
      return 1
    with open(os.path.join(model_dir, "summary.json")) as f:
      summaries.append(json.load(f))
  print("\n" + common.format_summary(*summaries))
  print(f"\nSummaries (JSON), checkpoints and TensorBoard logs: {root}")
  try:
    figure = common.plot_summaries(summaries, os.path.join(root, "demo.png"))
    print(f"Test accuracy and bytes per step, side by side: {figure}")
  except ImportError:  # matplotlib comes with the [examples] extra
    print("(no figure: matplotlib is not installed; pip install 'tf_adacomp[examples]')")
  return 0


def main(argv=None):
  """Entry point of the ``tf-adacomp`` console script; returns the exit status."""
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = argparse.ArgumentParser(prog="tf-adacomp", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--verbose", action="store_true",
                      help="show TensorFlow's C++ start-up log lines (hidden by default)")
  sub = parser.add_subparsers(dest="command", required=True)
  train = sub.add_parser("train", help="run an example; its flags follow the name",
                         add_help=False)
  train.add_argument("name", choices=EXAMPLES)
  demo = sub.add_parser(
      "demo", help="Fashion-MNIST with each compressor, summaries side by side; other "
      "flags go to the example (e.g. --epochs=2)")
  demo.add_argument("--compressors", default="adacomp,none",
                    help="comma-separated compressors, one run each (adacomp,none)")
  demo.add_argument("--replicas", type=int, default=4, help="CPU/GPU replicas (4)")
  demo.add_argument("--model_dir", default=None,
                    help="where each run keeps <compressor>/summary.json, checkpoints and "
                    "logs (a new temporary directory; an existing one resumes)")
  args, rest = parser.parse_known_args(argv)
  if args.command == "demo":
    from tf_adacomp.examples import common
    unknown = [c for c in args.compressors.split(",") if c not in common.COMPRESSORS]
    if unknown:
      parser.error(f"--compressors takes names from {', '.join(common.COMPRESSORS)}. "
                   f"Received: compressors={args.compressors!r}")
  quiet = not _wants_verbose(argv)
  if args.command == "train":
    return _train(args.name, rest, quiet)  # absl parses (and checks) the example's flags
  return _demo(args, rest, quiet)


if __name__ == "__main__":
  sys.exit(main())
