"""benchmarks/network.py with two devices per worker, end to end: 2 workers x 2 logical
CPUs in namespaces, hierarchical and flat AdaComp, and the link's counters.
(Real namespaces and worker processes, root only: slow tier.)"""

import json
import os

import pytest

import benchmark_scripts
import netns

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")


@pytest.mark.slow
@pytest.mark.skipif(not netns.available(), reason="needs root and iproute2 (ip netns, tc)")
def test_two_devices_per_worker_hierarchical_flat_and_the_link_counters(tmp_path):
  # D = 2 only: the D = 1 runs (two more cluster runs, ~35 s) are the other network test's
  # (tests/benchmarks/test_benchmark_runs.py checks their link counters against
  # bytes_sent), and the ratios to D = 1 and the targets' lines are arithmetic on rows,
  # tests/benchmarks/test_network_arithmetic.py's (summarize_devices, device_ratios).
  result, pid = benchmark_scripts.run_script(
      "network.py", "--models=mlp", "--rates=100mbit", "--compressors=adacomp,adacomp+flat",
      "--devices_per_worker=2", "--width=64", "--max_steps=4", "--eval_every=2",
      "--target_accuracy=0.01", "--synthetic", f"--json={tmp_path / 'n.json'}", "--plot=",
      env=ENV, timeout=900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "time_to_target_with_devices_no_worse_than_one_at_100mbit" in result.stdout
  out = json.loads((tmp_path / "n.json").read_text())
  assert out["devices_per_worker"] == [2]
  rows = {(r["compressor"], r["devices_per_worker"]): r for r in out["rows"]}
  assert len(rows) == 2 and not any(r.get("failed") for r in rows.values())
  runs = out["runs"]
  assert set(runs) == {"mlp/100mbit/adacomp/D2", "mlp/100mbit/adacomp+flat/D2"}
  for run in runs.values():
    assert run["devices_per_worker"] == 2 and run["replicas"] == 4
    assert run["workers"] == 2 and run["batch_size_per_worker"] == 64
    for link in run["link_bytes_per_step_workers"]:
      assert link["tx_bytes"] > 0 and link["rx_bytes"] > 0
  assert runs["mlp/100mbit/adacomp+flat/D2"]["flat"]
  assert runs["mlp/100mbit/adacomp+flat/D2"]["hierarchical_argument"] is False
  assert runs["mlp/100mbit/adacomp/D2"]["hierarchy"] == {"workers": 2,
                                                         "devices_per_worker": 2}
  assert runs["mlp/100mbit/adacomp+flat/D2"]["hierarchy"] is None
  # What a worker sends crosses its link: the link carries at least that.
  for key in (("adacomp", 2), ("adacomp+flat", 2)):
    assert rows[key]["link_tx_bytes_per_step"] >= rows[key]["bytes_sent_per_step"] > 0
  # Hierarchical: one payload per worker crosses the link; flat: each replica's.
  assert (rows["adacomp", 2]["link_tx_bytes_per_step"]
          < rows["adacomp+flat", 2]["link_tx_bytes_per_step"])
  # The ratios' fields are there (with no D = 1 run, no ratio to it).
  assert rows["adacomp", 2]["time_to_target_over_one_device"] is None
  assert "accuracy_at_equal_step_over_flat" in rows["adacomp", 2]
  assert rows["adacomp", 2]["flat_variant"] == "adacomp+flat"
  assert benchmark_scripts.namespaces_of(pid) == []
