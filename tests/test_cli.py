"""The tf-adacomp console script: examples by name, and the side-by-side demo."""

import json
import os
import subprocess
import sys

SMOKE = ["--synthetic", "--epochs=1", "--steps_per_epoch=3", "--eval_steps=1",
         "--batch_size=8"]


def _cli(*args, timeout=300):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  return subprocess.run([sys.executable, "-m", "tf_adacomp.cli", *args], env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)


def test_train_runs_an_example_by_name(tmp_path):
  result = _cli("train", "fashion_mnist", "--compressor=topk", "--replicas=2",
                f"--model_dir={tmp_path}", *SMOKE)
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert (summary["example"], summary["compressor"], summary["replicas"]) == (
      "fashion_mnist", "topk", 2)
  assert "compression ratio, all" in result.stdout


def test_a_bad_flag_value_is_named():
  result = _cli("train", "fashion_mnist", "--batch_size=7", "--replicas=2", "--synthetic")
  assert result.returncode != 0
  assert "batch_size=7" in result.stderr


def test_an_unknown_example_is_refused():
  result = _cli("train", "mnist_gan")
  assert result.returncode != 0 and "invalid choice: 'mnist_gan'" in result.stderr


def test_demo_refuses_an_unknown_compressor():
  result = _cli("demo", "--compressors=adacomp,zip")
  assert result.returncode != 0 and "compressors='adacomp,zip'" in result.stderr


def test_demo_prints_both_summaries_side_by_side(tmp_path):
  result = _cli("demo", "--replicas=2", f"--model_dir={tmp_path}", *SMOKE)
  assert result.returncode == 0, result.stderr[-3000:]
  table = result.stdout[result.stdout.rindex("== fashion_mnist"):]
  assert table.splitlines()[1].split() == ["compressor", "adacomp", "none"]
  for name in ("adacomp", "none"):
    assert json.loads((tmp_path / name / "summary.json").read_text())["compressor"] == name
