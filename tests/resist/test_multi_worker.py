"""ResIST across processes: MultiWorkerMirroredStrategy, 2 workers on 127.0.0.1 (gRPC)."""

import json

import numpy as np
import pytest

from multi_worker import WORKERS_DIR
from multi_worker import describe
from multi_worker import run_workers


@pytest.mark.slow
def test_two_workers_train_sub_resnets_and_leave_every_exchange_identical(tmp_path):
  results = run_workers(WORKERS_DIR / "resist_fit.py", num_workers=2, timeout=180,
                        out_dir=tmp_path)
  assert all(r.returncode == 0 for r in results), describe(results)
  logs = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(2)]
  weights = [np.load(tmp_path / f"worker{i}.npz") for i in range(2)]
  assert logs[0]["replicas"] == 2
  assert logs[0]["partitions"] == logs[1]["partitions"]  # dealt apart, the same
  assert len(logs[0]["partitions"]) == 3
  assert sorted(weights[0].files) == sorted(weights[1].files)
  # What the worker recorded at each of the 3 exchanges (the loop below checks nothing
  # if its recorder stopped being called): the drifted stem before, every weight after.
  assert sorted(n for n in weights[0].files if n.startswith("before")) == [
      f"before{r}_stem" for r in range(3)]
  assert {n.split("_")[0] for n in weights[0].files if n.startswith("round")} == {
      f"round{r}" for r in range(3)}
  for name in weights[0].files:
    if name.startswith("before"):  # trained apart: each worker's copy drifted its own way
      assert not np.array_equal(weights[0][name], weights[1][name]), name
    else:  # after every exchange, bit for bit the same model
      np.testing.assert_array_equal(weights[0][name], weights[1][name], err_msg=name)
  for log in logs:
    losses = log["history"]["loss"]
    assert losses[-1] < losses[0], losses
    assert log["gates"] == [[0.5, 0.5, 0.5]]  # test time: 1/S on this worker's replica
    measured = log["communication"]
    assert measured["rounds"] == 3
    assert measured["bytes_per_round"] < measured["local_sgd_bytes_per_round"]
