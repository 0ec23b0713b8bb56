"""CompressedOptimizer under MultiWorkerMirroredStrategy: 2 worker processes over gRPC."""

import json

import numpy as np
import pytest

from multi_worker import WORKERS_DIR
from multi_worker import describe
from multi_worker import run_workers


def _run(tmp_path, worker, mode, *more_args):
  out = tmp_path / mode
  results = run_workers(WORKERS_DIR / worker, num_workers=2, timeout=180,
                        args=[mode, *more_args], out_dir=out)
  assert all(r.returncode == 0 for r in results), describe(results)
  arrays = [dict(np.load(out / f"worker{i}.npz")) for i in range(2)]
  logs = [json.loads((out / f"worker{i}.json").read_text()) for i in range(2)]
  return arrays, logs


def _final_weights(arrays):
  """The keys of the final weights, the same in every worker's file: without any, the
  comparisons below would loop over nothing and pass."""
  keys = sorted(k for k in arrays[0] if k.startswith("final_"))
  assert keys, sorted(arrays[0])
  for other in arrays[1:]:
    assert sorted(k for k in other if k.startswith("final_")) == keys, sorted(other)
  return keys


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
  return _run(tmp_path_factory.mktemp("plain"), "keras_fit.py", "fix")


def test_no_compression_trains_like_the_plain_optimizer(tmp_path, plain_run):
  arrays, logs = _run(tmp_path, "compressed_fit.py", "none")
  plain_arrays, _ = plain_run
  assert _final_weights(arrays) == _final_weights(plain_arrays)
  for key in _final_weights(plain_arrays):
    np.testing.assert_allclose(arrays[0][key], plain_arrays[0][key], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(arrays[0][key], arrays[1][key])
  assert logs[0]["replicas"] == 2
  assert logs[0]["stats"]["total"]["ratio"] == pytest.approx(1.0)


def test_adacomp_over_grpc_keeps_workers_identical_and_compresses(tmp_path):
  arrays, logs = _run(tmp_path, "compressed_fit.py", "adacomp")
  for key in _final_weights(arrays):
    np.testing.assert_array_equal(arrays[0][key], arrays[1][key])
  residues = [k for k in arrays[0] if k.startswith("residue_")]
  assert residues
  assert any(not np.array_equal(arrays[0][k], arrays[1][k]) for k in residues)
  for log in logs:
    losses = log["history"]["loss"]
    assert losses[-1] < losses[0]
    assert log["stats"]["dense"]["ratio"] > 20  # the dense kernels, bytes over gRPC
  assert logs[0]["stats"] == logs[1]["stats"]


def test_adacomp_with_adasum_of_deltas_over_grpc(tmp_path):
  arrays, logs = _run(tmp_path, "compressed_fit.py", "adacomp", "adasum", "delta")
  for key in _final_weights(arrays):
    np.testing.assert_array_equal(arrays[0][key], arrays[1][key])
  for log in logs:
    losses = log["history"]["loss"]
    assert losses[-1] < losses[0]
    assert log["stats"]["dense"]["ratio"] > 20
