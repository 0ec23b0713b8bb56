"""The hierarchical exchange on 2 worker processes x 2 local devices, over gRPC.

One job (tests/workers/hierarchical_fit.py) runs the exchange on integer gradients with
residues on every replica, then ``model.fit`` hierarchical, flat and uncompressed; the
tests read what each worker wrote for each of its 2 replicas.
"""

import json

import numpy as np
import pytest

from multi_worker import WORKERS_DIR
from multi_worker import describe
from multi_worker import run_workers

WORKERS, DEVICES, GRADIENTS = 2, 2, 3


@pytest.fixture(scope="module")
def job(tmp_path_factory):
  out = tmp_path_factory.mktemp("hierarchical_fit")
  results = run_workers(WORKERS_DIR / "hierarchical_fit.py", num_workers=WORKERS, timeout=360,
                        out_dir=out)
  assert all(r.returncode == 0 for r in results), describe(results)
  return ([dict(np.load(out / f"worker{w}.npz")) for w in range(WORKERS)],
          [json.loads((out / f"worker{w}.json").read_text()) for w in range(WORKERS)])


def _replicas(arrays, key):
  """``key`` (with ``{r}`` for the local replica) of every replica, worker by worker."""
  return [arrays[w][key.format(r=r)] for w in range(WORKERS) for r in range(DEVICES)]


@pytest.mark.slow
def test_each_worker_has_two_devices_and_one_payload(job):
  arrays, logs = job
  for log in logs:
    assert log["replicas"] == WORKERS * DEVICES
    assert log["hierarchy"] == "Hierarchy(workers=2, devices_per_worker=2)"
    assert [d.rsplit("/", 1)[1] for d in log["devices"]] == ["device:CPU:0", "device:CPU:1"]
  for k in range(GRADIENTS):  # only each worker's first device sends
    sent = _replicas(arrays, f"exchange_adacomp_replica{{r}}_nbytes_{k}")
    assert sent[0] > 0 and sent[2] > 0 and sent[1] == sent[3] == 0, sent


@pytest.mark.slow
def test_no_compression_is_exact_on_every_replica_of_every_worker(job):
  arrays, _ = job
  for k in range(GRADIENTS):
    expected = sum(arrays[0][f"exchange_none_grad{r}_{k}"] for r in range(WORKERS * DEVICES))
    for value in _replicas(arrays, f"exchange_none_replica{{r}}_sum_{k}"):
      np.testing.assert_array_equal(value, expected)


@pytest.mark.slow
def test_adacomp_replicas_are_identical_and_the_error_feedback_total_is_kept(job):
  arrays, _ = job
  for k in range(GRADIENTS):
    sums = _replicas(arrays, f"exchange_adacomp_replica{{r}}_sum_{k}")
    for value in sums[1:]:
      np.testing.assert_array_equal(value, sums[0])
    grads = sum(arrays[0][f"exchange_adacomp_grad{r}_{k}"] for r in range(WORKERS * DEVICES))
    old = sum(_replicas(arrays, f"exchange_adacomp_replica{{r}}_old_state_{k}"))
    new = _replicas(arrays, f"exchange_adacomp_replica{{r}}_new_state_{k}")
    np.testing.assert_allclose(sums[0] + sum(new), grads + old, atol=1e-5)
    assert not np.array_equal(sums[0], grads + old)  # AdaComp held something back
    assert not np.any(new[1]) and not np.any(new[3])  # residues on first devices only


@pytest.mark.slow
@pytest.mark.parametrize("run", ["hierarchical", "flat", "none"])
def test_fit_ends_with_the_same_weights_on_all_four_replicas(job, run):
  arrays, logs = job
  keys = sorted(k.split("_weight")[1] for k in arrays[0] if k.startswith(f"fit_{run}_replica0_"))
  assert keys
  for key in keys:
    copies = _replicas(arrays, f"fit_{run}_replica{{r}}_weight{key}")
    for copy in copies[1:]:
      np.testing.assert_array_equal(copy, copies[0])
  expected = "None" if run == "flat" else "Hierarchy(workers=2, devices_per_worker=2)"
  assert logs[0][run]["hierarchy"] == expected
  # Two epochs of 5 steps on the digits: a model that learns (chance is 0.1).
  assert logs[0][run]["evaluation"]["accuracy"] > 0.3, logs[0][run]
