"""The benchmarks run end to end (short, on synthetic data) and write what they say."""

import json
import math
import os
import statistics
import subprocess
import sys

import pytest

import benchmark_scripts
import netns
import report

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")


def _run(script, *flags, timeout=600):
  result = subprocess.run([sys.executable, os.path.join(benchmark_scripts.BENCHMARKS_DIR,
                                                        script), *flags],
                          capture_output=True, text=True, env=ENV, timeout=timeout,
                          check=False)
  return result


def _ok(result):
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result.stdout


@pytest.mark.slow
def test_compression_ratio_per_kind_and_layer_with_topk_at_adacomp_density(tmp_path):
  # A narrow LSTM over short windows: the same six variables, a fraction of the work.
  # One replica: the ratio is per replica (what one replica sends), and each kernel then
  # compiles once per run, not once per replica device (a third of each run's CPU time).
  out = _ok(_run("compression_ratio.py", "--models=lstm", "--compressors=adacomp,topk",
                 "--steps=2", "--eval_steps=1", "--replicas=1", "--synthetic",
                 "--example_flag=--lstm_units=32", "--example_flag=--seq_length=8",
                 "--example_flag=--embedding_dim=8",
                 f"--json={tmp_path / 'r.json'}", f"--plot={tmp_path / 'r.png'}",
                 f"--work_dir={tmp_path / 'runs'}"))
  assert "recurrent" in out and "lstm_cell/recurrent_kernel" in out
  result = json.loads((tmp_path / "r.json").read_text())
  adacomp, topk = result["models"]["lstm"]["adacomp"], result["models"]["lstm"]["topk"]
  assert {"dense", "recurrent", "vector", "total"} == set(adacomp["compression"])
  assert len(adacomp["variables"]) == 6  # embedding, LSTM kernel/recurrent/bias, output
  for variable in adacomp["variables"].values():
    assert variable["ratio"] > 1 and math.isfinite(variable["ratio"])
  density = report.adacomp_elements_sent(adacomp["variables"]) / adacomp["parameters"]
  assert topk["topk_density"] == pytest.approx(density, rel=1e-5)
  assert (tmp_path / "r.png").stat().st_size > 0


@pytest.mark.slow
def test_step_time_ratios_to_the_dense_step(tmp_path):
  # One replica (the script's every stage: a process per run, the dense step as the
  # ratio's base, the verdict): each kernel compiles once, not once per replica device.
  out = _ok(_run("step_time.py", "--replicas=1", "--compressors=adacomp", "--steps=2",
                 "--skip=1", "--batch_size=16", "--synthetic",
                 f"--json={tmp_path / 's.json'}"))
  assert "target (AdaComp <= 1.3x dense) at N=1" in out
  rows = json.loads((tmp_path / "s.json").read_text())["rows"]
  assert [(r["replicas"], r["compressor"]) for r in rows] == [(1, "none"), (1, "adacomp")]
  assert rows[0]["step_ratio_to_dense"] == 1.0 and rows[1]["step_ratio_to_dense"] > 0
  assert rows[1]["compression_ratio"] > 10


@pytest.mark.slow
def test_paired_step_times_the_default_against_keras_in_one_process(tmp_path):
  out = _ok(_run("paired_step.py", "--warmup_steps=2", "--blocks=2", "--block_steps=2",
                 f"--json={tmp_path / 'p.json'}"))
  assert "x Keras' step" in out
  result = json.loads((tmp_path / "p.json").read_text())
  assert {name: len(t) for name, t in result["step_seconds"].items()} == {"dense": 4,
                                                                         "default": 4}
  assert result["default_over_dense"] == pytest.approx(
      result["median_step_seconds"]["default"] / result["median_step_seconds"]["dense"])
  assert result["exchange_choice"]["phase"] == "probing compressed"  # 6 of its 20
  assert result["local_rounds"] == {}


@pytest.mark.slow
def test_paired_step_times_a_rounds_inside_and_end_apart(tmp_path):
  out = _ok(_run("paired_step.py", "--local_steps=2", "--warmup_steps=2", "--blocks=2",
                 "--block_steps=4", f"--json={tmp_path / 'p.json'}"))
  assert "a step inside a round" in out
  result = json.loads((tmp_path / "p.json").read_text())
  assert result["local_steps"] == 2 and len(result["step_seconds"]["default"]) == 8
  assert result["round_ends"] == [False, True] * 4  # every second step ends a round
  steps, rounds = result["step_seconds"]["default"], result["local_rounds"]
  for part, at in (("inside", 0), ("round_end", 1)):
    assert rounds[part]["median_step_seconds"] == pytest.approx(
        statistics.median(steps[at::2]))
    assert rounds[part]["over_dense"] == pytest.approx(
        rounds[part]["median_step_seconds"] / result["median_step_seconds"]["dense"])


@pytest.mark.slow
def test_fingerprints_times_both_forms_which_agree(tmp_path):
  out = _ok(_run("fingerprints.py", "--model=cnn", "--repeats=3",
                 f"--json={tmp_path / 'f.json'}"))
  assert "GPU form (XLA) / CPU form" in out
  result = json.loads((tmp_path / "f.json").read_text())
  assert result["elements"] == 421_642  # the CNN's weights
  assert {name: len(t) for name, t in result["seconds"].items()} == {"read": 3, "cpu": 3,
                                                                    "gpu": 3}
  assert result["xla_over_cpu_form"] == pytest.approx(
      result["median_seconds"]["gpu"] / result["median_seconds"]["cpu"])


@pytest.mark.slow
@pytest.mark.skipif(not netns.available(), reason="needs root and iproute2 (ip netns, tc)")
def test_network_runs_workers_across_limited_namespaces_and_cleans_up(tmp_path):
  result, pid = benchmark_scripts.run_script(
      "network.py", "--models=mlp", "--rates=100mbit",
      "--compressors=none,adacomp+gradients,adacomp+H2", "--width=64", "--max_steps=4",
      "--eval_every=2", "--target_accuracy=0.01", "--synthetic",
      f"--json={tmp_path / 'n.json'}", f"--plot={tmp_path / 'n.png'}", env=ENV)
  out = _ok(result)
  assert "measured link" in out and "targets, mlp:" in out
  result = json.loads((tmp_path / "n.json").read_text())
  assert 50e6 < result["measured_link_bits_per_second"]["100mbit"] < 130e6
  dense, adacomp, local = result["rows"]
  assert dense["speed_up_over_dense"] == 1.0 and dense["compression_ratio"] == 1.0
  assert adacomp["compressor"] == "adacomp+gradients"  # the exchange it was told to use
  assert adacomp["compression_ratio"] > 5 and adacomp["time_to_target_seconds"] > 0
  assert not adacomp["estimated"] and adacomp["bytes_to_target"] > 0
  # Dense float32 sends 4 bytes per parameter every step.
  dense_run = result["runs"]["mlp/100mbit/none"]
  assert dense["bytes_to_target"] == 4 * dense_run["parameters"] * dense["steps_to_target"]
  # Rounds of 2 local steps: only round ends send, and only they are evaluated.
  run = result["runs"]["mlp/100mbit/adacomp+H2"]
  assert run["local_steps"] == 2 and run["outer_optimizer"] == "average"
  sent = [b > 0 for b in run["step_bytes_sent"]]
  assert sent == [False, True] * (len(sent) // 2)
  assert all(e["step"] % 2 == 0 for e in run["evaluations"])
  assert local["bytes_to_target"] == sum(run["step_bytes_sent"][:local["steps_to_target"]])
  assert result["compute_only"]["mlp"]["median_step_seconds"] > 0
  # One device per worker (the default), every worker's link counters read: what a
  # worker sends crosses its link, so the link carries at least that.
  assert result["devices_per_worker"] == [1]
  for run in result["runs"].values():
    assert run["devices_per_worker"] == 1 and run["replicas"] == 2 and run["workers"] == 2
    assert run["hierarchy"] is None
    for link in run["link_bytes_per_step_workers"]:
      assert link["tx_bytes"] > 0 and link["rx_bytes"] > 0
  assert adacomp["link_tx_bytes_per_step"] >= adacomp["bytes_sent_per_step"] > 0
  assert (tmp_path / "n.png").stat().st_size > 0
  assert benchmark_scripts.namespaces_of(pid) == []


@pytest.mark.parametrize("script,flags,named", [
    ("compression_ratio.py", ["--models=vgg"], "models='vgg'"),
    ("compression_ratio.py", ["--steps=0"], "steps=0"),
    ("compression_ratio.py", ["--compressors=topk"], "compressors='topk'"),
    ("step_time.py", ["--steps=0"], "steps=0"),
    ("step_time.py", ["--compressors=adacomp+fast"], "compressor='adacomp+fast'"),
    ("paired_step.py", ["--blocks=0"], "blocks=0"),
    ("paired_step.py", ["--local_steps=3"], "local_steps=3"),
    ("paired_step.py", ["--model=resnet"], "'resnet'"),
    ("fingerprints.py", ["--repeats=0"], "repeats=0"),
    ("fingerprints.py", ["--model=vgg"], "'vgg'"),
    ("network.py", ["--compressors=topk,adacomp"], "compressors='topk,adacomp'"),
    ("network.py", ["--rates=fast"], "rate='fast'"),
    ("network.py", ["--workers=1"], "workers=1"),
    ("network.py", ["--compressors=adacomp+fast"], "compressor='adacomp+fast'"),
    ("network.py", ["--compressors=none,adacomp+H0"], "compressor='adacomp+H0'"),
    ("network.py", ["--compressors=adacomp+Hx"], "compressor='adacomp+Hx'"),
    ("network.py", ["--compressors=adacomp+nesterov"], "compressor='adacomp+nesterov'"),
    ("network.py", ["--max_run_seconds=100", "--run_timeout=50"], "run_timeout=50.0"),
])
def test_bad_arguments_are_named(script, flags, named):
  """The script stops at its argument checks, before it imports TensorFlow: a fraction
  of a second, fast tier."""
  result = _run(script, *flags, timeout=120)
  assert result.returncode == 2 and named in result.stderr, result.stderr


@pytest.mark.slow
def test_resume_drift_is_zero_for_sgd_and_adam(tmp_path):
  # Each replica's own state comes back (tf_adacomp.replica_state): the resumed run is
  # the uninterrupted one, bit for bit (with the replicas' mean, Adam ended 1e-2 off).
  _ok(_run("resume_drift.py", f"--json={tmp_path / 'r.json'}"))
  with open(tmp_path / "r.json") as f:
    drift = json.load(f)["max_abs_difference"]
  assert any(k.startswith("Adam") for k in drift) and "SGD(0.05, momentum=0.9)" in drift
  assert all(v == 0 for v in drift.values()), drift
