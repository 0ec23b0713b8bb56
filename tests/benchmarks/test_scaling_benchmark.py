"""benchmarks/scaling.py: its model on made-up measurements (fast tier: no training, no
processes), and one short real run of every stage (slow tier).

(Named apart from tests/test_scaling.py: the test folders have no packages, so two test
modules of one basename cannot be collected together.)"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import benchmark_scripts  # noqa: F401  (benchmarks/ on sys.path)
import scaling as scaling_benchmark  # benchmarks/scaling.py
from tf_adacomp import scaling

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
# Made-up measurements, in the fields measure_decode writes: the MLP's and the CNN's sizes;
# the MLP's payload puts the crossover at 65 (2d/p = 64.5), just past a row of the grid.
MEASURED = {
    "mlp": {"parameters": 5_824_522, "dense_bytes": 23_298_088,
            "payload_bytes": 2 * 23_298_088 / 64.5,
            "payload_bytes_min": 90_000, "payload_bytes_max": 101_000,
            "padded_payload_bytes": {"1": 97_000.0, "2": 101_000.0},
            "decode_seconds": {"1": 0.012, "2": 0.020},
            "decode_fit": {"c0_seconds": 0.004, "c_row_seconds": 0.008}},
    "cnn": {"parameters": 421_642, "dense_bytes": 1_686_568, "payload_bytes": 6_801.0,
            "payload_bytes_min": 6_000, "payload_bytes_max": 7_500,
            "padded_payload_bytes": {"1": 6_801.0, "2": 7_500.0},
            "decode_seconds": {"1": 0.0021, "2": 0.0024},
            "decode_fit": {"c0_seconds": 0.0018, "c_row_seconds": 0.0003}},
}
PROCESSES = [{"model": "cnn", "workers": 2, "sent_bytes_per_step": 7_000.0,
              "received_bytes_per_step": 7_000.0, "dense_bytes": 1_686_568,
              "dense_ring_received_bytes_per_step": 1_686_568.0,
              "median_step_seconds": 0.05}]


def _first(predicate):
  return next(n for n in range(2, 10**6) if predicate(n))


@pytest.mark.parametrize("devices", [1, 8])
def test_the_model_from_measurements(tmp_path, devices):
  path = tmp_path / "measured.json"
  path.write_text(json.dumps({"machine": {"cpus": 2}, "measured": MEASURED,
                              "processes": PROCESSES}))
  out, png = tmp_path / "scaling.json", tmp_path / "scaling.png"
  scaling_benchmark.main([f"--measurements={path}", f"--json={out}", f"--plot={png}",
                          f"--devices_per_worker={devices}", "--rates=10gbit,100gbit"])
  result = json.loads(out.read_text())
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert result["processes"] == PROCESSES and result["settings"]["devices_per_worker"] == devices
  for name, m in MEASURED.items():
    model = result["model"][name]
    p, d = m["payload_bytes"], m["dense_bytes"]
    c0, c_row = m["decode_fit"]["c0_seconds"], m["decode_fit"]["c_row_seconds"]
    assert (model["payload_bytes"], model["dense_bytes"]) == (p, d)
    assert model["compression"] == pytest.approx(d / p)
    # The rows: N = 2, 4, ..., 1024, each exchange's closed form in NumPy.
    n = np.array([row["workers"] for row in model["rows"]], float)
    np.testing.assert_array_equal(n, 2.0 ** np.arange(1, 11))
    expected = {"flat": (n * devices - 1) * p, "hierarchical": (n - 1) * p,
                "dense_ring": 2 * (n - 1) / n * d, "bf16_ring": (n - 1) / n * d}
    for kind, values in expected.items():
      np.testing.assert_allclose([row["bytes"][kind] for row in model["rows"]], values,
                                 rtol=1e-12)
    np.testing.assert_allclose([row["decode_seconds"]["flat"] for row in model["rows"]],
                               c0 + c_row * n * devices, rtol=1e-12)
    np.testing.assert_allclose([row["decode_seconds"]["hierarchical"] for row in model["rows"]],
                               c0 + c_row * n, rtol=1e-12)
    # The crossovers: the hierarchical one is scaling.crossover_senders itself; the flat
    # one the first N whose N x devices senders receive more than the ring of N workers.
    c = model["crossovers"]
    assert c["bytes"]["hierarchical_vs_dense"] == scaling.crossover_senders(d, p)
    assert c["bytes"]["hierarchical_vs_dense"] == int(2 * d // p) + 1
    if name == "mlp":
      assert c["bytes"]["hierarchical_vs_dense"] == 65
    assert c["bytes"]["hierarchical_vs_bf16"] == scaling.crossover_senders(d / 2, p)
    assert c["bytes"]["flat_vs_dense"] == _first(
        lambda k: (k * devices - 1) * p > 2 * (k - 1) / k * d)
    assert c["bytes"]["flat_vs_bf16"] == _first(
        lambda k: (k * devices - 1) * p > (k - 1) / k * d)
    if devices == 1:
      assert c["bytes"]["flat_vs_dense"] == scaling.crossover_senders(d, p)
    for rate_name, rate in (("10gbit", 10e9), ("100gbit", 100e9)):
      times = c["time"][rate_name]
      assert times["hierarchical_vs_dense"] == _first(
          lambda k: 8 * (k - 1) * p / rate + c0 + c_row * k > 8 * 2 * (k - 1) / k * d / rate)
      assert times["flat_vs_dense"] == _first(
          lambda k: (8 * (k * devices - 1) * p / rate + c0 + c_row * k * devices
                     > 8 * 2 * (k - 1) / k * d / rate))
      # A decode term only brings the loss sooner.
      assert times["hierarchical_vs_dense"] <= c["bytes"]["hierarchical_vs_dense"]
    # What the package does: check_allgather warns exactly past the crossover.
    for row in model["rows"]:
      k = row["workers"]
      assert row["warns"]["hierarchical"] == (k >= scaling.crossover_senders(d, p))
      assert row["warns"]["flat"] == (k * devices >= scaling.crossover_senders(d, p))


def test_bad_flags_are_refused(capsys):
  for flags in (["--models=resnet"], ["--rates=3gbit"], ["--rows=1,x"], ["--workers=0"],
                ["--devices_per_worker=0"], ["--max_workers=1"]):
    with pytest.raises(SystemExit):
      scaling_benchmark.parse(flags)
  assert "Received" in capsys.readouterr().err


@pytest.mark.slow  # trains, times decodes and starts two worker processes (~1 min)
def test_a_short_run_measures_every_stage(tmp_path):
  # The benchmark's MLP at width 64 (55,050 parameters), not the CNN: every stage runs the
  # same code for either model (build, train, decode, worker processes), and the small
  # MLP's XLA programs compile in a fraction of the CNN's time (~30% of the run's CPU).
  out = tmp_path / "s.json"
  result = subprocess.run(
      [sys.executable, os.path.join(benchmark_scripts.BENCHMARKS_DIR, "scaling.py"),
       "--models=mlp", "--width=64", "--rows=1,2,4", "--repeats=1", "--warmup_steps=2",
       "--workers=2", "--process_steps=4", "--max_workers=64", f"--json={out}", "--plot="],
      capture_output=True, text=True, env=ENV, timeout=600, check=False)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  data = json.loads(out.read_text())
  m = data["measured"]["mlp"]
  parameters = (784 * 64 + 64) + (64 * 64 + 64) + (64 * 10 + 10)  # 784-64-64-10
  assert m["parameters"] == parameters and m["dense_bytes"] == 4 * parameters
  assert set(m["decode_seconds"]) == {"1", "2", "4"}
  assert all(s > 0 for s in m["decode_seconds"].values())
  assert len(m["payload_bytes_per_step"]) == 4  # the last max(--rows) steps
  assert 0 < m["payload_bytes_min"] <= m["payload_bytes"] <= m["payload_bytes_max"]
  assert m["payload_bytes"] < m["dense_bytes"] / 10
  # Padded to the longest: one row pays its own bytes, more rows at least the largest.
  assert m["padded_payload_bytes"]["1"] == m["payload_bytes_per_step"][-1]
  assert m["padded_payload_bytes"]["4"] == max(m["payload_bytes_per_step"])
  (run,) = data["processes"]
  assert (run["model"], run["workers"]) == ("mlp", 2)
  assert run["received_bytes_per_step"] == scaling.allgather_bytes_received(
      2, run["sent_bytes_per_step"])
  assert 0 < run["sent_bytes_per_step"] < run["dense_bytes"] == m["dense_bytes"]
  assert data["model"]["mlp"]["crossovers"]["bytes"]["hierarchical_vs_dense"] == (
      scaling.crossover_senders(m["dense_bytes"], m["payload_bytes"]))
