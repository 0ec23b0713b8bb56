"""An example under --strategy=multi_worker: two processes over gRPC on 127.0.0.1.

(TopK: its kernels compile faster than AdaComp's; AdaComp under MultiWorkerMirroredStrategy
is tested in tests/test_optimizer_multi_worker.py.)"""

import json

import pytest

import multi_worker

SCRIPT = multi_worker.PROJECT_ROOT / "examples" / "fashion_mnist.py"


@pytest.mark.slow
def test_fashion_mnist_trains_on_two_workers_compressed(tmp_path):
  model_dir = tmp_path / "model"
  results = multi_worker.run_workers(
      SCRIPT, num_workers=2, out_dir=tmp_path / "out", timeout=300,
      args=["--strategy=multi_worker", "--compressor=topk", "--synthetic", "--epochs=1",
            "--steps_per_epoch=3", "--eval_steps=1", "--batch_size=8", "--verbose=0",
            f"--model_dir={model_dir}"])
  for index, result in enumerate(results):
    assert result.returncode == 0, multi_worker.describe(results)
  summary = json.loads((model_dir / "summary.json").read_text())  # the chief's
  assert (summary["strategy"], summary["replicas"], summary["steps"]) == ("multi_worker", 2, 3)
  assert summary["compression"]["dense"]["ratio"] > 10
  # One backup for the job, the chief's (tf_adacomp.BackupAndRestore); logs per worker.
  assert (model_dir / "checkpoint" / "latest.weights.h5").is_file()
  assert not (model_dir / "workers" / "1" / "checkpoint").exists()
  assert (model_dir / "workers" / "1" / "logs").is_dir()
  assert "compression ratio, all" in results[0].stdout
  assert "compression ratio, all" not in results[1].stdout  # printed by the chief only
