"""The ``tf-adacomp`` command: run the examples by name, or the side-by-side demo.

    tf-adacomp demo                       # Fashion-MNIST, 4 CPU replicas, AdaComp vs dense
    tf-adacomp train fashion_mnist --compressor=adacomp --replicas=4
    tf-adacomp train cifar10_resnet --help

``train`` runs ``tf_adacomp.examples.<name>`` with the flags that follow it. ``demo``
runs the Fashion-MNIST example once per compressor, each in its own process (one
TensorFlow, one set of devices, per run), then prints their summaries side by side and
draws them (``demo.png``).

Both are quiet: TensorFlow's C++ start-up lines are hidden unless
``TF_CPP_MIN_LOG_LEVEL`` is set or ``tf-adacomp --verbose ...`` is given
(``tf_adacomp.quiet`` says how); Keras' progress bar and every Python warning and
error stay.
"""

import argparse
import json
import os
import shlex
import sys
import tempfile

from tf_adacomp import quiet as quiet_start_up

EXAMPLES = ("fashion_mnist", "cifar10_resnet", "cifar10_resist", "imagenet_resnet50",
            "shakespeare_lstm", "shakespeare_transformer")
_HELP_FLAGS = {"--help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml"}  # absl's


def _train(name, flags, quiet) -> int:
  # Exactly `python -m tf_adacomp.examples.<name> <flags>`: absl then shows that
  # example's docstring and flags in --help.
  command = [sys.executable, "-m", f"tf_adacomp.examples.{name}", *flags]
  code = quiet_start_up.run(command, quiet)
  if code == 1 and _HELP_FLAGS.intersection(flags):
    return 0  # absl exits 1 after printing help; asking for help is not a failure
  return code


def _progress_flags(flags):
  """One line per epoch where the output is not a terminal (a log file, CI): Keras'
  progress bar redraws itself on every step, hundreds of kilobytes in a file."""
  if sys.stdout.isatty() or any(f.split("=")[0] == "--verbose" for f in flags):
    return []
  return ["--verbose=2"]


def _as_typed(args) -> str:
  """The ``tf-adacomp`` command line that runs ``args``, as a user can paste it: the
  console script beside this Python (``.venv/bin/tf-adacomp``), relative to the
  working directory when it lies below it."""
  script = os.path.join(os.path.dirname(sys.executable), "tf-adacomp")
  if not os.path.exists(script):  # not installed as a script: the module runs it
    return shlex.join([sys.executable, "-m", "tf_adacomp.cli", *args])
  relative = os.path.relpath(script)
  return shlex.join([script if relative.startswith("..") else relative, *args])


def _demo(args, extra_flags, quiet) -> int:
  from tf_adacomp.examples import report

  root = args.model_dir or tempfile.mkdtemp(prefix="tf_adacomp_demo_")
  summaries = []
  for compressor in args.compressors.split(","):
    model_dir = os.path.join(root, compressor)
    command = [sys.executable, "-m", "tf_adacomp.examples.fashion_mnist",
               f"--compressor={compressor}", f"--replicas={args.replicas}",
               f"--model_dir={model_dir}", *_progress_flags(extra_flags), *extra_flags]
    print(f"\n$ {_as_typed(['train', 'fashion_mnist', *command[3:]])}", flush=True)
    if quiet_start_up.run(command, quiet):
      print(f"tf-adacomp demo: the {compressor} run failed (its output is above).",
            file=sys.stderr)
      return 1
    with open(os.path.join(model_dir, "summary.json")) as f:
      summaries.append(json.load(f))
  print("\n" + report.format_summary(*summaries))
  print(f"\nSummaries (JSON), checkpoints and TensorBoard logs: {root}")
  try:
    figure = report.plot_summaries(summaries, os.path.join(root, "demo.png"))
    print(f"Test accuracy and compression ratio, side by side: {figure}")
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
    from tf_adacomp.examples import flags_and_config
    unknown = [c for c in args.compressors.split(",") if c not in flags_and_config.COMPRESSORS]
    if unknown:
      parser.error(f"--compressors takes names from {', '.join(flags_and_config.COMPRESSORS)}. "
                   f"Received: compressors={args.compressors!r}")
  quiet = not quiet_start_up.wants_verbose(argv)
  if args.command == "train":
    return _train(args.name, rest, quiet)  # absl parses (and checks) the example's flags
  return _demo(args, rest, quiet)


if __name__ == "__main__":
  sys.exit(main())
