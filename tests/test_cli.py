"""The tf-adacomp console script: examples by name, and the side-by-side demo.

Every test that runs the command (a process) is in the slow tier; one run of the console
script, as a user runs it, serves the tests of ``train`` and of its quiet output.
"""

import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from tf_adacomp import quiet

SMOKE = ["--synthetic", "--epochs=1", "--steps_per_epoch=3", "--eval_steps=1",
         "--batch_size=8"]


@pytest.fixture(scope="module")
def console_train(tmp_path_factory):
  """``tf-adacomp train fashion_mnist`` run once, as a user runs it: the console script,
  no TF_CPP_MIN_LOG_LEVEL in the environment, Keras' progress bar on (--verbose=1)."""
  model_dir = tmp_path_factory.mktemp("console_train")
  script = pathlib.Path(sys.executable).parent / "tf-adacomp"
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  result = subprocess.run([script, "train", "fashion_mnist", "--compressor=topk",
                           "--replicas=2", "--verbose=1", f"--model_dir={model_dir}", *SMOKE],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
  return result, model_dir


@pytest.mark.slow
def test_train_runs_an_example_by_name(console_train):
  result, model_dir = console_train
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads((model_dir / "summary.json").read_text())
  assert (summary["example"], summary["compressor"], summary["replicas"]) == (
      "fashion_mnist", "topk", 2)
  assert "compression ratio, all" in result.stdout


def _cli(*args, timeout=300):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  return subprocess.run([sys.executable, "-m", "tf_adacomp.cli", *args], env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_a_bad_flag_value_is_named():
  result = _cli("train", "fashion_mnist", "--batch_size=7", "--replicas=2", "--synthetic")
  assert result.returncode != 0
  assert "batch_size=7" in result.stderr


@pytest.mark.slow
def test_an_unknown_example_is_refused():
  result = _cli("train", "mnist_gan")
  assert result.returncode != 0 and "invalid choice: 'mnist_gan'" in result.stderr


@pytest.mark.slow
def test_demo_refuses_an_unknown_compressor():
  result = _cli("demo", "--compressors=adacomp,zip")
  assert result.returncode != 0 and "compressors='adacomp,zip'" in result.stderr


@pytest.mark.slow
def test_demo_prints_both_summaries_side_by_side(tmp_path):
  result = _cli("demo", "--replicas=1", f"--model_dir={tmp_path}", *SMOKE)  # one compile
  assert result.returncode == 0, result.stderr[-3000:]
  table = result.stdout[result.stdout.rindex("== fashion_mnist"):]
  assert table.splitlines()[1].split() == ["compressor", "adacomp", "dense"]
  # Each run is announced as a command a user can paste: the console script, then train.
  echoed = [line[2:] for line in result.stdout.splitlines() if line.startswith("$ ")]
  assert len(echoed) == 2, result.stdout[:2000]
  for line in echoed:
    script, command, name, *_ = shlex.split(line)
    assert (os.path.basename(script), command, name) == ("tf-adacomp", "train", "fashion_mnist")
    assert os.access(script, os.X_OK), line
  for name in ("adacomp", "none"):
    assert json.loads((tmp_path / name / "summary.json").read_text())["compressor"] == name
  figure = tmp_path / "demo.png"
  assert figure.read_bytes().startswith(b"\x89PNG") and str(figure) in result.stdout


START_UP_LINES = [  # as TensorFlow 2.21 prints them on a CPU-only machine
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795426589.056564    3750 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.",
    "I0000 00:00:1795426589.124574    3750 cpu_feature_guard.cc:227] This TensorFlow binary "
    "is optimized to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild "
    "TensorFlow with the appropriate compiler flags.",
    "E0000 00:00:1795426600.520586    3773 cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
    "W0000 00:00:1795426602.955967    3773 dataset.cc:997] Input of GeneratorDatasetOp::"
    "Dataset will not be optimized because the dataset does not implement the "
    "AsGraphDefInternal() method needed to apply optimizations.",
]
KEPT_LINES = [
    "E0000 00:00:1795426600.520586    3773 collective_ops.cc:52] Collective timed out",
    "Traceback (most recent call last):",
    "ValueError: `batch_size` must be a multiple of --replicas. Received: batch_size=7",
    "WARNING:tensorflow:5 out of the last 5 calls to <function> triggered tf.function "
    "retracing.",
]


def test_start_up_noise_is_told_from_what_matters():
  assert all(quiet.is_start_up_noise(line) for line in START_UP_LINES)
  assert not any(quiet.is_start_up_noise(line) for line in KEPT_LINES)


@pytest.mark.slow
def test_the_command_is_quiet_unless_verbose(console_train):
  """The console script as a user runs it: no TF_CPP_MIN_LOG_LEVEL in the environment."""
  result, _ = console_train
  assert result.returncode == 0, result.stderr[-3000:]
  noise = [line for line in result.stderr.splitlines() if quiet.is_start_up_noise(line)]
  assert not noise, noise
  assert "3/3" in result.stdout  # Keras' progress bar stays


def test_verbose_is_an_option_before_the_command_or_a_log_level_the_user_set():
  """conftest sets TF_CPP_MIN_LOG_LEVEL, which alone makes the command verbose: the
  user's environment is given here."""
  user = {"HOME": "/home/u"}
  assert quiet.wants_verbose(["--verbose", "train", "fashion_mnist"], user)
  assert not quiet.wants_verbose(["train", "fashion_mnist", "--verbose=1"], user)  # train's
  assert not quiet.wants_verbose(["train", "--verbose"], user)
  assert not quiet.wants_verbose([], user)
  assert quiet.wants_verbose(["train", "fashion_mnist", "--verbose=1"],
                             dict(user, TF_CPP_MIN_LOG_LEVEL="0"))


def test_a_log_level_set_after_start_up_is_not_the_users(monkeypatch):
  """Where JAX is installed, importing TensorFlow imports it, and JAX sets
  TF_CPP_MIN_LOG_LEVEL: the command must stay quiet (the environment it started with
  decides)."""
  monkeypatch.setattr(quiet, "STARTING_ENVIRON", {"HOME": "/home/u"})
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")  # as JAX's import does
  assert not quiet.wants_verbose(["train", "fashion_mnist"])


def test_the_demo_figure_says_dense_and_draws_the_ratio_on_a_linear_scale(tmp_path,
                                                                         monkeypatch):
  """A log scale drew 234x as a bar 2.5x shorter than dense's; "none" meant dense."""
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top

  from tf_adacomp.examples import report  # pylint: disable=g-import-not-at-top

  def summary(compressor, sent):
    return {"example": "fashion_mnist", "compressor": compressor, "replicas": 4, "steps": 9,
            "test_accuracy": 0.88, "bytes_sent_per_step": sent,
            "dense_bytes_per_step": 1000.0, "compression_ratio": 1000.0 / sent}

  drawn = []
  monkeypatch.setattr(pyplot, "close", drawn.append)
  path = report.plot_summaries([summary("adacomp", 4.0), summary("none", 1000.0)],
                               str(tmp_path / "demo.png"))
  assert pathlib.Path(path).read_bytes().startswith(b"\x89PNG")
  ratio = drawn[0].axes[1]
  assert [t.get_text() for t in ratio.get_xticklabels()] == ["adacomp", "dense"]
  assert ratio.get_yscale() == "linear"
  heights = [bar.get_height() for bar in ratio.patches]
  assert heights == [250.0, 1.0]  # bar heights in proportion to the ratios
  labels = [t.get_text() for t in ratio.texts]
  assert labels[0].startswith("250.0x") and labels[1].startswith("1.0x")
