"""Times benchmarks/gpu.py's exported XLA programs with JAX, on a machine without TensorFlow.

``python benchmarks/gpu.py --export DIR`` writes each program as TensorFlow hands it to
XLA (serialized HLO). This script compiles those very programs with the XLA inside JAX
for JAX's first device (a GPU where there is one), feeds them the inputs their specs
describe, times them as gpu.py does and writes the same tables: it measures on a GPU
what TensorFlow would run there, on a machine where only JAX is installed. Two things
differ from TensorFlow's own run: the XLA version is JAX's, and a program's first call
is XLA's compilation alone (no TensorFlow tracing).

At the smallest exported size each kernel's outputs are compared with TensorFlow's
(``identical``: the same bits; ``outputs_differing``: which outputs are not).

    python benchmarks/gpu_xla.py DIR --json out/gpu.json --markdown out/gpu.md

Needs jax and jaxlib, no TensorFlow; it relies on three of JAX's private names
(``xla_client._xla.mlir.hlo_to_stablehlo``, ``xla_bridge.get_backend`` and the
backend's ``compile_and_load``): a benchmark's, not the package's, dependency.
"""

import argparse
import json
import lzma
import os
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_report  # pylint: disable=g-import-not-at-top,wrong-import-position


def _jax():
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  from jax._src.lib import xla_client  # pylint: disable=g-import-not-at-top
  return jax, xla_bridge, xla_client


class Runner:
  """Compiles HLO programs for one device and runs them."""

  def __init__(self):
    self.jax, xla_bridge, self.xla_client = _jax()
    self.backend = xla_bridge.get_backend()
    self.device = self.backend.local_devices()[0]

  def compile(self, hlo_module_proto):
    stablehlo = self.xla_client._xla.mlir.hlo_to_stablehlo(hlo_module_proto)  # pylint: disable=protected-access
    return self.backend.compile_and_load(
        stablehlo, self.xla_client.DeviceList((self.device,)),
        self.xla_client.CompileOptions())

  def put(self, array, dtype):
    import ml_dtypes  # pylint: disable=g-import-not-at-top  (installed with jax)
    if dtype == "bfloat16":
      array = array.astype(ml_dtypes.bfloat16)
    return self.jax.device_put(np.asarray(array, dtype=array.dtype), self.device)

  def inputs(self, entry, outputs):
    flat = []

    def one(spec):
      if isinstance(spec, list):
        for s in spec:
          one(s)
      elif spec["init"] == "output":
        payload = outputs[spec["of"]][spec["index"]]
        flat.append(self.jax.numpy.stack([payload] * spec["rows"]))
      else:
        flat.append(self.put(gpu_report.make_array(spec), spec["dtype"]))

    for spec in entry["specs"]:
      one(spec)
    return flat

  @staticmethod
  def sync(outputs):
    for out in outputs:
      out.block_until_ready()

  def time(self, executable, args, repeats):
    """Median seconds per call and calls per round (``gpu_report.time_calls``)."""
    return gpu_report.time_calls(lambda: executable.execute(args), self.sync, repeats)


def compare(outputs, reference):
  """``identical`` to TensorFlow's outputs (digests, ``gpu_report.digest``), and which
  outputs differ."""
  differing = [i for i, (out, want) in enumerate(zip(outputs, reference, strict=True))
               if gpu_report.digest(np.asarray(out)) != want]
  return not differing, differing


def measure(runner, entry, outputs, args):
  """One program: compiled, run (its outputs kept in ``outputs``), then timed and
  compared with TensorFlow's outputs; with ``--profile`` run once more, untimed, and
  its optimised HLO written (returns None)."""
  name = entry["name"]
  with open(os.path.join(args.directory, name + ".hlo.xz"), "rb") as f:
    proto = lzma.decompress(f.read())
  start = time.perf_counter()
  executable = runner.compile(proto)
  inputs = runner.inputs(entry, outputs)
  result = executable.execute(inputs)
  runner.sync(result)
  compile_s = time.perf_counter() - start
  outputs[name] = result
  if args.profile:
    folder = os.path.dirname(args.json) or "."
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name + ".optimised.hlo.txt")
    with open(path, "w") as f:
      f.write(executable.hlo_modules()[0].to_string())
    runner.sync(executable.execute(inputs))  # once more, compiled and loaded
    print(f"{name}: ran; its optimised HLO is in {path}", flush=True)
    return None
  seconds, calls = runner.time(executable, inputs, args.repeats)
  stats = executable.get_compiled_memory_stats()
  timing = {"seconds": seconds, "compile_s": compile_s, "calls": calls,
            "peak_bytes": int(stats.argument_size_in_bytes + stats.output_size_in_bytes
                              + stats.temp_size_in_bytes - stats.alias_size_in_bytes)}
  if entry.get("reference"):
    timing["identical"], timing["outputs_differing"] = compare(result, entry["reference"])
  print(f"{name}: {1e3 * seconds:.3f} ms, first call {compile_s:.2f} s"
        + (f", identical {timing['identical']}" if "identical" in timing else ""),
        flush=True)
  return timing


def machine_info(runner):
  info = {"device": getattr(runner.device, "device_kind", str(runner.device)),
          "runtime": f"XLA of JAX {runner.jax.__version__} on {runner.device.platform}, "
                     "programs exported from TensorFlow",
          "platform": platform.platform(), "jax": runner.jax.__version__}
  try:
    info["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=30,
        check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    pass
  return info


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("directory", help="what gpu.py --export wrote")
  parser.add_argument("--repeats", type=int, default=10, help="timed rounds per program")
  parser.add_argument("--only", default="", help="comma-separated program name prefixes")
  parser.add_argument("--budget_s", type=float, default=0,
                      help="start no program after this many seconds (0: no limit)")
  parser.add_argument("--profile", action="store_true",
                      help="run each selected program, untimed, and write its optimised "
                      "HLO beside --json (for a profiler; see --trace)")
  parser.add_argument("--trace", metavar="DIR",
                      help="a profiler trace of the whole run in DIR (JAX's: xplane.pb and "
                      "trace.json.gz)")
  parser.add_argument("--json", default="out/gpu.json")
  parser.add_argument("--markdown", default="out/gpu.md")
  args = parser.parse_args()
  if args.repeats < 1:
    parser.error(f"`--repeats` must be >= 1. Received: {args.repeats}")
  if args.budget_s < 0:
    parser.error(f"`--budget_s` must be >= 0. Received: {args.budget_s}")
  manifest_path = os.path.join(args.directory, "manifest.json")
  if not os.path.exists(manifest_path):
    parser.error(f"`directory` must hold gpu.py --export's manifest.json. Received: "
                 f"directory={args.directory!r}")
  with open(manifest_path) as f:
    manifest = json.load(f)
  runner = Runner()
  prefixes = tuple(filter(None, args.only.split(",")))
  timings, outputs = {}, {}
  selected = [e for e in manifest["programs"]
              if not prefixes or e["name"].startswith(prefixes)]
  # A decode program's input is its compress program's output: that one runs too.
  needed = {s["of"] for e in selected for s in e["specs"] if isinstance(s, dict)
            and s.get("of")}
  machine = dict(machine_info(runner), exported_from=f"TensorFlow {manifest['tensorflow']}")
  started = time.perf_counter()
  if args.trace:
    runner.jax.profiler.start_trace(args.trace)
  for entry in manifest["programs"]:
    name = entry["name"]
    if entry not in selected and name not in needed:
      continue
    if args.budget_s and time.perf_counter() - started > args.budget_s:
      timings[name] = {"error": f"not run: past --budget_s={args.budget_s}"}
      continue
    try:
      timing = measure(runner, entry, outputs, args)
      if timing:
        timings[name] = timing
    except Exception as e:  # pylint: disable=broad-except
      # One program that XLA refuses on this device is a finding, not the end of the run.
      timings[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
      print(f"{name}: FAILED {timings[name]['error'][:300]}", flush=True)
    if not args.profile:  # what is measured so far, in case the run is cut short
      _write(manifest, timings, machine, args, quiet=True)
  if args.trace:
    runner.jax.profiler.stop_trace()
  if not args.profile:
    _write(manifest, timings, machine, args, quiet=False)


def _write(manifest, timings, machine, args, quiet):
  ok = {k: v for k, v in timings.items() if "seconds" in v}
  result = gpu_report.summarise(manifest["programs"], ok, machine)
  result["failed"] = {k: v["error"] for k, v in timings.items() if "error" in v}
  gpu_report.write(result, args.json, args.markdown, quiet=quiet)


if __name__ == "__main__":
  main()
