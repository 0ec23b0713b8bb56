"""Where a program's device time goes: a summary of a JAX profiler trace.

``gpu_xla.py --trace DIR`` writes JAX's trace (``DIR/**/*.trace.json.gz``, Chrome's trace
format); its files are too large to bring back from a lent GPU machine, so this script
runs there and writes what matters: for each XLA module (program), how many times it
ran, the device time of its kernels per run, its host-device copies per run, and its
costliest operations (device time per run, summed over each HLO op's kernels).

    python benchmarks/gpu_xla.py EXPORT --only kernel-compress --profile --trace DIR \\
        --json out/profile/gpu.json
    python benchmarks/gpu_trace.py DIR --hlo_dir out/profile --json out/trace.json

Standard library only: it runs where JAX is, without TensorFlow.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import sys


def load_events(directory):
  """The trace's events, from the newest ``*.trace.json.gz`` under ``directory``.

  Raises:
    FileNotFoundError: no trace file there, named.
  """
  paths = glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True)
  if not paths:
    raise FileNotFoundError(f"`directory` holds no *.trace.json.gz. Received: {directory!r}")
  with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
    return json.load(f)["traceEvents"]


def _device_pids(events):
  """Process ids whose name is a GPU's (the profiler names them /device:GPU:k); where
  there is none (a run on CPU), every process's."""
  named = {e["pid"]: str(e.get("args", {}).get("name", "")) for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpus = {pid for pid, name in named.items() if "GPU" in name}
  return gpus or {e.get("pid") for e in events}


def program_names(hlo_dir):
  """``{XLA module name: program name}`` from ``gpu_xla.py --profile``'s
  ``NAME.optimised.hlo.txt`` files (their first line names the module)."""
  names = {}
  for path in glob.glob(os.path.join(hlo_dir, "*.optimised.hlo.txt")):
    with open(path) as f:
      first = f.readline()
    if first.startswith("HloModule "):
      module = first[len("HloModule "):].split(",")[0].strip()
      names[module] = os.path.basename(path)[:-len(".optimised.hlo.txt")]
  return names


def summarise(events, top=12, names=None):
  """Per module: runs, device microseconds per run, copies per run, costliest ops.

  A kernel is a complete event (``ph == "X"``) on a GPU's process that names its
  ``hlo_module`` (shown by its program's name where ``names`` has it); a module's runs
  are its distinct ``run_id``s (without them, the fewest kernels any op launched).
  Copies are events on a GPU's process whose name starts with ``Memcpy`` and that name
  a module. Without a GPU's process (a trace of a CPU run), every process counts.

  Returns:
    ``{module: {"runs", "device_us_per_run", "copies_per_run", "ops": [[op, us per
    run, kernels per run], ...]}}``, the ops costliest first, at most ``top``.
  """
  gpus = _device_pids(events)
  per_op = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0]))
  copies = collections.Counter()
  run_ids = collections.defaultdict(set)
  for e in events:
    args = e.get("args") or {}
    module = args.get("hlo_module")
    module = (names or {}).get(module, module)
    if e.get("ph") != "X" or e.get("pid") not in gpus or not module:
      continue
    if "run_id" in args:
      run_ids[module].add(args["run_id"])
    if str(e.get("name", "")).startswith("Memcpy"):
      copies[module] += 1
      continue
    entry = per_op[module][args.get("hlo_op", e.get("name", "?"))]
    entry[0] += float(e.get("dur", 0.0))
    entry[1] += 1
  summary = {}
  for module, ops in per_op.items():
    runs = len(run_ids[module]) or min(count for _, count in ops.values())
    ranked = sorted(ops.items(), key=lambda item: -item[1][0])
    summary[module] = {
        "runs": runs,
        "device_us_per_run": sum(us for us, _ in ops.values()) / runs,
        "copies_per_run": copies[module] / runs,
        "ops": [[op, us / runs, count / runs] for op, (us, count) in ranked[:top]]}
  return summary


def text(summary):
  """The summary as lines for a terminal."""
  lines = []
  for module, s in sorted(summary.items()):
    lines.append(f"{module}: {s['runs']} runs, {s['device_us_per_run']:.1f} us of kernels "
                 f"and {s['copies_per_run']:.1f} copies per run")
    lines += [f"  {us:9.1f} us  {kernels:6.1f} kernels  {op}" for op, us, kernels in s["ops"]]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("directory", help="gpu_xla.py --trace's directory")
  parser.add_argument("--top", type=int, default=12, help="ops listed per module")
  parser.add_argument("--hlo_dir", help="where gpu_xla.py --profile wrote the optimised "
                      "HLO (its --json's folder): modules are shown by program name")
  parser.add_argument("--json", help="also write the summary here")
  args = parser.parse_args(argv)
  if args.top < 1:
    parser.error(f"`--top` must be >= 1. Received: {args.top}")
  try:
    events = load_events(args.directory)
  except FileNotFoundError as e:
    parser.error(str(e))
  summary = summarise(events, args.top,
                      program_names(args.hlo_dir) if args.hlo_dir else None)
  print(text(summary))
  if args.json:
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(summary, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
