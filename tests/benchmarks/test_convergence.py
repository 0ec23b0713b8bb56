"""benchmarks/convergence.py runs end to end (tiny, synthetic) and writes what it says."""

import json
import os
import subprocess
import sys

import pytest

import benchmark_scripts

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
SCRIPT = os.path.join(benchmark_scripts.BENCHMARKS_DIR, "convergence.py")


def _run(*flags, timeout=600):
  return subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True,
                        env=ENV, timeout=timeout, check=False)


@pytest.mark.slow
def test_smoke_dense_and_per_bin_adacomp(tmp_path):
  # 2 replicas, not the benchmark's 4: each program compiles once per replica device.
  result = _run("--smoke", "--synthetic", "--models=mlp", "--variants=none,adacomp-bin",
                "--seeds=0", "--optimizers=mlp=adam", "--learning_rates=mlp=0.001",
                "--replicas=2",
                f"--json={tmp_path / 'c.json'}", f"--plot={tmp_path / 'c.png'}")
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "gap pts" in result.stdout and "targets, adacomp-bin" in result.stdout
  out = json.loads((tmp_path / "c.json").read_text())
  assert out["replicas"] == 2
  assert out["models"]["mlp"]["settings"]["optimizer"] == "adam"
  assert out["models"]["mlp"]["settings"]["lr"] == 0.001
  rows = out["models"]["mlp"]["rows"]
  assert set(rows) == {"none", "adacomp-bin"}
  assert rows["none"]["gap_points"] == 0.0 and rows["none"]["seeds"] == [0]
  assert rows["adacomp-bin"]["compression"]["dense"] > 5  # scales counted, still compact
  runs = out["models"]["mlp"]["runs"]["adacomp-bin"]
  assert [point[0] for point in runs[0]["curve"]] == [2, 4]
  assert (tmp_path / "c.png").stat().st_size > 0


@pytest.mark.slow
def test_smoke_transformer_with_adamw_and_the_global_second_moment(tmp_path):
  # One replica: the replica count is the mlp smoke's (above); here the transformer,
  # AdamW and the global second moment, each kernel compiled once, not once per device.
  result = _run("--smoke", "--synthetic", "--models=transformer",
                "--variants=none,adacomp+updates+global+after", "--seeds=0", "--replicas=1",
                f"--json={tmp_path / 'c.json'}", f"--plot={tmp_path / 'c.png'}")
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "loss gap" in result.stdout
  model = json.loads((tmp_path / "c.json").read_text())["models"]["transformer"]
  assert model["settings"]["optimizer"] == "adamw"
  row = model["rows"]["adacomp+updates+global+after"]
  assert "loss_gap_percent" in row and row["final_loss"] > 0
  assert row["compression"]["dense"] > 1  # the attention kernels are dense


@pytest.mark.parametrize("flags,named", [
    (["--models=vgg"], "models='vgg'"),
    (["--variants=adacomp,topk"], "variants='adacomp,topk'"),
    (["--steps=mlp=0"], "steps={'mlp': 0}"),
    (["--optimizers=mlp=rmsprop"], "optimizers={'mlp': 'rmsprop'}"),
    (["--learning_rates=vgg=0.1"], "learning_rates={'vgg': 0.1}"),
    (["--replicas=0"], "replicas=0"),
])
def test_bad_arguments_are_named(flags, named):
  """The script stops at its argument checks, before it imports TensorFlow: a fraction
  of a second, fast tier."""
  result = _run(*flags, timeout=120)
  assert result.returncode == 2 and named in result.stderr, result.stderr


@pytest.mark.parametrize("variant,learning_rate", [("adacomp+updates+H8+nesterov", 0.7),
                                                   ("none+updates+H8+nesterov0.1", 0.1)])
def test_a_nesterov_variant_takes_diloco_at_its_outer_learning_rate(variant, learning_rate):
  import convergence  # pylint: disable=import-outside-toplevel  (benchmarks/, on sys.path)

  settings = dict(convergence.MODELS["mlp"], optimizer="sgd")
  outer = convergence.make_optimizer(variant, settings).outer_optimizer
  assert float(outer.learning_rate) == pytest.approx(learning_rate)
  assert outer.nesterov and float(outer.momentum) == pytest.approx(0.9)


@pytest.mark.parametrize("variant,momentum", [
    ("adacomp+updates+H8+global+predictive", 0.7),
    ("adacomp-L150+updates+H8+global+predictive0.3", 0.3),
    ("adacomp+updates+H8+global", None),  # the average, as the rows before it were run
])
def test_a_predictive_variant_takes_its_momentum(variant, momentum):
  import convergence  # pylint: disable=import-outside-toplevel  (benchmarks/, on sys.path)
  from tf_adacomp import local_steps  # pylint: disable=import-outside-toplevel

  settings = dict(convergence.MODELS["transformer"])
  outer = convergence.make_optimizer(variant, settings).outer_optimizer
  if momentum is None:
    assert outer == "average"
  else:
    assert isinstance(outer, local_steps.Predictive) and outer.momentum == momentum
