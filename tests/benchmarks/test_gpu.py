"""benchmarks/gpu.py works before a GPU is there: its smoke mode on CPU, its export of
XLA programs and benchmarks/gpu_xla.py's run of them (JAX's XLA reproduces
TensorFlow's outputs bit for bit, in both kernel forms), and the tables' arithmetic."""

import argparse
import json
import os
import subprocess
import sys

import pytest

import benchmark_scripts
import gpu
import gpu_report

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
           JAX_PLATFORMS="cpu")


def _run(script, *flags):
  result = subprocess.run(
      [sys.executable, os.path.join(benchmark_scripts.BENCHMARKS_DIR, script), *flags],
      capture_output=True, text=True, env=ENV, timeout=900, check=False)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result.stdout


def test_the_tables_divide_floor_bytes_by_time_and_by_the_copy():
  n = 1 << 20
  programs = [
      dict(group="kernel", name="copy", kernel="copy", elements=n, dtype="float32",
           floor_bytes=8 * n, form="auto"),
      dict(group="kernel", name="c", kernel="compress", elements=n, dtype="float32",
           floor_bytes=12 * n, form="gpu"),
      dict(group="step", name="d", model="cnn", variant="dense", batch=8, parameters=10,
           form="auto"),
      dict(group="step", name="a", model="cnn", variant="adacomp", batch=8, parameters=10,
           form="gpu"),
  ]
  timings = {"copy": {"seconds": 1e-3}, "c": {"seconds": 6e-3, "identical": True},
             "d": {"seconds": 2.0, "compile_s": 1.0, "peak_bytes": 100},
             "a": {"seconds": 3.0, "compile_s": 4.0, "peak_bytes": 150}}
  result = gpu_report.summarise(programs, timings, {"device": "d", "runtime": "r"})
  (row,) = result["kernel_rows"]
  assert row["form"] == "gpu" and row["copy_GBps"] == pytest.approx(8 * n / 1e-3 / 1e9)
  # 12n bytes in 6 ms against 8n bytes in 1 ms: a quarter of the copy bandwidth.
  assert row["compress"]["copy_fraction"] == pytest.approx(0.25)
  assert row["compress"]["identical"] is True
  (step,) = result["step_rows"]
  assert step["step_over_dense"] == pytest.approx(1.5)
  assert step["memory_over_dense"] == pytest.approx(1.5)
  text = gpu_report.markdown(result)
  assert "| 1M | float32 | GPU form |" in text and "(25%)" in text and "| 1.50x |" in text


@pytest.mark.parametrize("change,named", [
    (dict(forms="cpu,tpu"), "'tpu'"),
    (dict(dtypes="float16"), "'float16'"),
    (dict(sizes="1M,0"), "'0'"),
    (dict(models="vgg"), "'vgg'"),
])
def test_bad_arguments_are_named(change, named):
  args = argparse.Namespace(**dict(dict(forms="auto", dtypes="float32", sizes="1K",
                                        models="", batch_scale=1.0), **change))
  with pytest.raises(ValueError, match=named):
    gpu.all_programs(args)


@pytest.mark.parametrize("flags,named", [
    ([], "directory="), (["--repeats=0"], "repeats` must be >= 1. Received: 0"),
    (["--budget_s=-1"], "budget_s` must be >= 0. Received: -1")])
def test_the_xla_runner_names_a_bad_argument(tmp_path, flags, named):
  """Before JAX loads: a fraction of a second."""
  result = subprocess.run(
      [sys.executable, os.path.join(benchmark_scripts.BENCHMARKS_DIR, "gpu_xla.py"),
       str(tmp_path), *flags], capture_output=True, text=True, env=ENV, timeout=120,
      check=False)
  assert result.returncode == 2 and named in result.stderr, result.stderr


@pytest.mark.slow  # a benchmark's run (tests/conftest.py)
def test_smoke_mode_times_every_program_on_cpu(tmp_path):
  _run("gpu.py", "--smoke", f"--json={tmp_path}/g.json", f"--markdown={tmp_path}/g.md")
  result = json.loads((tmp_path / "g.json").read_text())
  assert [(r["elements"], r["dtype"]) for r in result["kernel_rows"]] == [
      (65536, "bfloat16"), (65536, "float32"), (262144, "bfloat16"), (262144, "float32")]
  for row in result["kernel_rows"]:
    for kernel in ("copy", "fused", "compress", "decode_1", "decode_8"):
      assert row[kernel]["seconds"] > 0 and row[kernel]["copy_fraction"] > 0
  assert {r["model"] for r in result["step_rows"]} == {"cnn", "transformer"}
  for row in result["step_rows"]:
    assert row["step_over_dense"] > 0 and row["adacomp"]["compile_s"] > 0
  assert "| cnn | the device's |" in (tmp_path / "g.md").read_text()


@pytest.mark.slow  # a benchmark's run (tests/conftest.py)
def test_exported_programs_run_under_jax_with_tensorflows_outputs(tmp_path):
  pytest.importorskip("jax")  # installed by the test extra; a hint where it is not
  _run("gpu.py", "--smoke", "--sizes=64K", "--models=cnn", "--forms=cpu,gpu",
       f"--export={tmp_path}/export")
  manifest = json.loads((tmp_path / "export" / "manifest.json").read_text())
  assert {p["form"] for p in manifest["programs"]} == {"auto", "cpu", "gpu"}
  _run("gpu_xla.py", f"{tmp_path}/export", "--repeats=2", f"--json={tmp_path}/x.json",
       f"--markdown={tmp_path}/x.md")
  result = json.loads((tmp_path / "x.json").read_text())
  assert result["failed"] == {}
  checked = [(name, t) for name, t in result["timings"].items() if "identical" in t]
  # compress, decode 1 and 8 rows, in 2 forms and 2 dtypes: TensorFlow's outputs exactly.
  assert len(checked) == 12
  assert all(t["identical"] and t["outputs_differing"] == [] for _, t in checked), checked
  assert {(r["model"], r["form"]) for r in result["step_rows"]} == {("cnn", "cpu"),
                                                                    ("cnn", "gpu")}


def test_the_trace_summary_counts_gpu_kernels_per_run(tmp_path):
  import gzip  # pylint: disable=g-import-not-at-top

  import gpu_trace  # pylint: disable=g-import-not-at-top
  meta = [dict(ph="M", pid=1, name="process_name", args=dict(name="/host:CPU")),
          dict(ph="M", pid=2, name="process_name", args=dict(name="/device:GPU:0"))]

  def kernel(pid, op, dur, name=None, run=0):
    return dict(ph="X", pid=pid, name=name or op, dur=dur,
                args=dict(hlo_module="m.1", hlo_op=op, run_id=str(run)))

  # Two runs of module m.1: op a launches one kernel per run, op b two; one copy per
  # run; the host's events of the same module are not device time.
  events = meta + [kernel(2, "a", 10.0), kernel(2, "b", 3.0), kernel(2, "b", 5.0),
                   kernel(2, "a", 30.0, run=1), kernel(2, "b", 1.0, run=1),
                   kernel(2, "b", 1.0, run=1), kernel(2, "x", 4.0, name="MemcpyD2H"),
                   kernel(2, "x", 4.0, name="MemcpyD2H", run=1), kernel(1, "a", 1000.0)]
  (tmp_path / "t" / "run").mkdir(parents=True)
  with gzip.open(tmp_path / "t" / "run" / "h.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  (tmp_path / "kernel-compress-1.optimised.hlo.txt").write_text("HloModule m.1, x=y\n")
  summary = gpu_trace.summarise(gpu_trace.load_events(str(tmp_path / "t")), top=1,
                                names=gpu_trace.program_names(str(tmp_path)))
  (name, s), = summary.items()
  assert name == "kernel-compress-1"
  assert s["runs"] == 2 and s["copies_per_run"] == 1.0
  assert s["device_us_per_run"] == pytest.approx(25.0)  # (40 + 10) / 2
  assert s["ops"] == [["a", 20.0, 1.0]]
  with pytest.raises(FileNotFoundError, match="directory"):
    gpu_trace.load_events(str(tmp_path / "t" / "none"))
