"""What the benchmarks share: example runs, JSON and PNG output, AdaComp's bytes read back,
checks."""

import json
import math
import os
import shutil
import subprocess
import sys


def write_json(path, result):
  """Writes ``result`` to ``path`` (creating its folder) and prints where it went."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {path}")


def adacomp_elements_sent(variables):
  """Elements AdaComp sent per step (all variables), from its bytes per variable.

  ``variables`` is ``CompressionStats.variable_totals()`` or an example summary's
  ``variables`` (which has ``sent_bytes_per_step``). Each variable's bytes are turned
  back into elements by ``stats.adacomp_elements`` (the inverse of the byte model).
  """
  from tf_adacomp import stats  # pylint: disable=g-import-not-at-top

  total = 0.0
  for v in variables.values():
    sent = (v["sent_bytes_per_step"] if "sent_bytes_per_step" in v
            else v["sent_bytes"] / v["steps"])
    total += stats.adacomp_elements(math.prod(v["shape"]), sent)
  return total


def pyplot():
  """matplotlib's pyplot, drawing to files only (no display needed)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def save_figure(fig, path):
  """Writes ``fig`` as a PNG to ``path`` (creating its folder) and says where."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  print(f"wrote {path}")


def topk_order_error(compressors):
  """Why ``compressors`` cannot run (TopK runs at AdaComp's measured density), or None."""
  if "topk" in compressors and ("adacomp" not in compressors
                                or compressors.index("topk") < compressors.index("adacomp")):
    return ("topk runs at AdaComp's measured density: list adacomp before it. "
            f"Received: compressors={','.join(compressors)!r}")
  return None


def run_example(example, flags, model_dir):
  """Runs the example in its own process; returns its summary.json."""
  shutil.rmtree(model_dir, ignore_errors=True)  # a leftover checkpoint would resume
  command = [sys.executable, "-m", f"tf_adacomp.examples.{example}", *flags,
             f"--model_dir={model_dir}"]
  print("$ " + " ".join(command[1:]), flush=True)
  result = subprocess.run(command, capture_output=True, text=True, check=False)
  if result.returncode:
    raise RuntimeError(f"{example} failed (rc {result.returncode}):\n{result.stderr[-3000:]}")
  with open(os.path.join(model_dir, "summary.json")) as f:
    return json.load(f)
