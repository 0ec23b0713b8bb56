"""What benchmarks/gpu.py and gpu_xla.py share, without TensorFlow: inputs, digests, tables.

Both ways of measuring, ``gpu.py`` with TensorFlow and ``gpu_xla.py`` with the
exported XLA programs, make the same inputs from the same specs (``make_array``), time
the same list of programs (``gpu.py``'s manifest) and hand their timings here, so that
the two write the same JSON and Markdown.

A kernel's figure is its floor bytes (what it must read and write at least: for
compress, the gradient and the residue read and the residue written) over its time, as
a fraction of the copy bandwidth measured in the same run at the same size and dtype
(``-x``: n elements read, n written). A step's figure is its ratio to the dense step of
the same model in the same run.
"""

import hashlib
import json
import os
import statistics
import time

import numpy as np

# How the tables name a kernel form (tf_adacomp.ops.variant).
FORM_NAMES = {"auto": "the device's", "cpu": "CPU form", "gpu": "GPU form"}


def make_array(spec):
  """The NumPy array an input spec describes: ``init="integers"`` below ``high``, or
  ``"normal"`` with ``mean`` and ``std`` (float32, cast by the caller)."""
  rng = np.random.default_rng(spec["seed"])
  if spec["init"] == "integers":
    return rng.integers(0, spec["high"], size=spec["shape"], dtype=np.int32)
  array = rng.standard_normal(size=spec["shape"], dtype=np.float32)
  return (spec["mean"] + spec["std"] * array).astype(np.float32)


def time_calls(call, sync, repeats):
  """Median seconds per ``call()``, and the calls per round: rounds of calls back to
  back (about 20 ms of work each, so that a fast kernel is not timed by the host's
  launch latency alone), each ended by ``sync(last result)``."""
  start = time.perf_counter()
  sync(call())
  calls = max(1, min(200, int(0.02 / max(time.perf_counter() - start, 1e-6))))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = call()
    sync(out)
    times.append((time.perf_counter() - start) / calls)
  return statistics.median(times), calls


def digest(array):
  """An output's shape, dtype size and SHA-256 of its bytes: equal digests, equal bits."""
  return {"shape": list(array.shape), "itemsize": array.dtype.itemsize,
          "sha256": hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()}


def _form(program):
  return program.get("form", "auto")


def kernel_rows(programs, timings):
  """One row per (elements, dtype, form): each kernel's time, bandwidth, copy fraction.

  The copy and the fused pass do not depend on the form: every form's row shows them.
  """
  shared, by_key = {}, {}
  for p in programs:
    if p["group"] != "kernel" or p["name"] not in timings:
      continue
    if p["kernel"] in ("copy", "fused"):
      shared.setdefault((p["elements"], p["dtype"]), {})[p["kernel"]] = p
    else:
      by_key.setdefault((p["elements"], p["dtype"], _form(p)), {})[p["kernel"]] = p
  rows = []
  for (elements, dtype, form), kernels in sorted(by_key.items()):
    kernels = dict(shared.get((elements, dtype), {}), **kernels)
    row = {"elements": elements, "dtype": dtype, "form": form}
    copy = kernels.get("copy")
    copy_bw = (copy["floor_bytes"] / timings[copy["name"]]["seconds"]) if copy else None
    row["copy_GBps"] = copy_bw and copy_bw / 1e9
    for kernel, p in sorted(kernels.items()):
      t = timings[p["name"]]
      bandwidth = p["floor_bytes"] / t["seconds"]
      row[kernel] = {"seconds": t["seconds"], "floor_bytes": p["floor_bytes"],
                     "GBps": bandwidth / 1e9,
                     "copy_fraction": copy_bw and bandwidth / copy_bw,
                     "compile_s": t.get("compile_s")}
      for key in ("identical", "outputs_differing"):
        if key in t:
          row[kernel][key] = t[key]
    rows.append(row)
  return rows


def step_rows(programs, timings):
  """One row per (model, form): the AdaComp step against the dense step, time, memory."""
  dense, rows = {}, []
  for p in programs:
    if p["group"] == "step" and p["name"] in timings and p["variant"] == "dense":
      dense[p["model"]] = dict(timings[p["name"]], parameters=p["parameters"],
                               batch=p["batch"])
  for p in programs:
    if p["group"] != "step" or p["name"] not in timings or p["variant"] == "dense":
      continue
    adacomp = dict(timings[p["name"]], parameters=p["parameters"], batch=p["batch"])
    row = {"model": p["model"], "form": _form(p), "adacomp": adacomp}
    if p["model"] in dense:
      row["dense"] = dense[p["model"]]
      row["step_over_dense"] = adacomp["seconds"] / row["dense"]["seconds"]
      if row["dense"].get("peak_bytes") and adacomp.get("peak_bytes"):
        row["memory_over_dense"] = adacomp["peak_bytes"] / row["dense"]["peak_bytes"]
    rows.append(row)
  return rows


def _ms(seconds):
  return f"{1e3 * seconds:.3f}" if seconds < 0.01 else f"{1e3 * seconds:.1f}"


def _fraction(kernel):
  if kernel is None:
    return "-"
  fraction = kernel["copy_fraction"]
  share = f" ({100 * fraction:.0f}%)" if fraction is not None else ""
  return f"{_ms(kernel['seconds'])} ms, {kernel['GBps']:.0f} GB/s{share}"


def markdown(result):
  """The two tables of ``result`` (``summarise``'s), as Markdown."""
  machine = result["machine"]
  lines = [f"Device: {machine.get('device')}; {machine.get('runtime')}.", "",
           "Kernels: time, floor bytes per second, and that as a share of the copy "
           "bandwidth at the same size and dtype.", "",
           "| elements | dtype | kernels' form | copy | residue + grad | compress "
           "| decode, 1 row | decode, 8 rows |",
           "|---|---|---|---|---|---|---|---|"]
  for row in result["kernel_rows"]:
    cells = [_fraction(row.get(k)) for k in
             ("copy", "fused", "compress", "decode_1", "decode_8")]
    lines.append(f"| {row['elements'] / (1 << 20):g}M | {row['dtype']} | "
                 f"{FORM_NAMES.get(row['form'], row['form'])} | " + " | ".join(cells) + " |")
  lines += ["", "Steps: one replica, the gradient compressed and decoded (2 rows) "
            "inside the AdaComp step; the dense step applies the gradient as it is.", "",
            "| model | kernels' form | batch | parameters | dense step | AdaComp step "
            "| AdaComp / dense | first call (compile), dense / AdaComp "
            "| peak memory, AdaComp / dense |",
            "|---|---|---|---|---|---|---|---|---|"]
  for row in result["step_rows"]:
    dense, adacomp = row.get("dense", {}), row.get("adacomp", {})
    if not dense or not adacomp:
      continue
    memory = row.get("memory_over_dense")
    lines.append(
        f"| {row['model']} | {FORM_NAMES.get(row['form'], row['form'])} | "
        f"{dense['batch']} | {dense['parameters'] / 1e6:.2f}M | "
        f"{_ms(dense['seconds'])} ms | {_ms(adacomp['seconds'])} ms | "
        f"{row['step_over_dense']:.2f}x | {dense['compile_s']:.1f} s / "
        f"{adacomp['compile_s']:.1f} s | "
        + (f"{memory:.2f}x" if memory is not None else "-") + " |")
  return "\n".join(lines) + "\n"


def summarise(programs, timings, machine):
  """The result: the machine, the kernel and step rows, and every raw timing."""
  return {"machine": machine, "kernel_rows": kernel_rows(programs, timings),
          "step_rows": step_rows(programs, timings), "timings": timings}


def write(result, json_path, markdown_path, quiet=False):
  """Writes the JSON and the Markdown tables; prints them and where they went."""
  text = markdown(result)
  for path, content in ((json_path, json.dumps(result, indent=1)), (markdown_path, text)):
    if os.path.dirname(path):
      os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      f.write(content)
  if not quiet:
    print(text)
    print(f"wrote {json_path} and {markdown_path}")
