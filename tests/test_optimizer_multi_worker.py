"""CompressedOptimizer under MultiWorkerMirroredStrategy: 2 worker processes over gRPC.

One job (tests/workers/compressed_fit.py) trains the plain optimizer and each
configuration below in turn, from the same seed; the tests read its results."""

import json

import numpy as np
import pytest

from adam_reference import np_global_moment
from multi_worker import WORKERS_DIR
from multi_worker import describe
from multi_worker import run_workers

RUNS = ("plain", "none", "adacomp", "adacomp:adasum:delta", "adam+plain",
        "adam+adacomp+global+doubling", "local+adacomp+nesterov", "local+none+average",
        "local+adam+none", "local+adam+bf16")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """One 2-worker job trains every run of RUNS in turn (one cluster start-up, one
  TensorFlow import per worker): ``{run: (arrays, logs)}``, a list entry per worker."""
  out = tmp_path_factory.mktemp("compressed_fit")
  results = run_workers(WORKERS_DIR / "compressed_fit.py", num_workers=2, timeout=480,
                        args=RUNS, out_dir=out)
  assert all(r.returncode == 0 for r in results), describe(results)
  found = {}
  for run in RUNS:
    folder = out / run.replace(":", "-")  # compressed_fit.run_name
    found[run] = ([dict(np.load(folder / f"worker{i}.npz")) for i in range(2)],
                  [json.loads((folder / f"worker{i}.json").read_text()) for i in range(2)])
  return found


def _final_weights(arrays):
  """The keys of the final weights, the same in every worker's file: without any, the
  comparisons below would loop over nothing and pass."""
  keys = sorted(k for k in arrays[0] if k.startswith("final_"))
  assert keys, sorted(arrays[0])
  for other in arrays[1:]:
    assert sorted(k for k in other if k.startswith("final_")) == keys, sorted(other)
  return keys


@pytest.mark.slow
def test_no_compression_trains_like_the_plain_optimizer(runs):
  arrays, logs = runs["none"]
  plain_arrays, _ = runs["plain"]
  assert _final_weights(arrays) == _final_weights(plain_arrays)
  for key in _final_weights(plain_arrays):
    np.testing.assert_allclose(arrays[0][key], plain_arrays[0][key], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(arrays[0][key], arrays[1][key])
  assert logs[0]["replicas"] == 2
  # multi_worker_strategy(heartbeat_timeout=45) reached TensorFlow's coordination service.
  assert [log["heartbeat_timeout_ms"] for log in logs] == [45_000, 45_000]
  assert logs[0]["stats"]["total"]["ratio"] == pytest.approx(1.0)


@pytest.mark.slow
def test_no_worker_is_warned_that_it_trains_alone(runs):
  # The optimizer is built under the strategy's scope, whose 2 workers TF_CONFIG names:
  # tf_adacomp.UnsynchronizedWorkersWarning (issue 42) must stay silent on every worker.
  for run, (_, logs) in runs.items():
    assert [log["unsynchronized_warnings"] for log in logs] == [[], []], run


@pytest.mark.slow
def test_adacomp_over_grpc_keeps_workers_identical_and_compresses(runs):
  arrays, logs = runs["adacomp"]
  for key in _final_weights(arrays):
    np.testing.assert_array_equal(arrays[0][key], arrays[1][key])
  residues = [k for k in arrays[0] if k.startswith("residue_")]
  assert residues
  assert any(not np.array_equal(arrays[0][k], arrays[1][k]) for k in residues)
  for log in logs:
    losses = log["history"]["loss"]
    assert losses[-1] < losses[0]
    assert log["stats"]["dense"]["ratio"] > 20  # the dense kernels, bytes over gRPC
  # Every worker sent as many bytes (the gather pads each to the longest); how a bucket's
  # bytes split among its tensors follows each worker's own counts.
  assert logs[0]["stats"]["total"] == logs[1]["stats"]["total"]
  assert ({k: v["dense_bytes"] for k, v in logs[0]["stats"].items()}
          == {k: v["dense_bytes"] for k, v in logs[1]["stats"].items()})


@pytest.mark.slow
def test_adacomp_with_adasum_of_deltas_over_grpc(runs):
  arrays, logs = runs["adacomp:adasum:delta"]
  for key in _final_weights(arrays):
    np.testing.assert_array_equal(arrays[0][key], arrays[1][key])
  for log in logs:
    losses = log["history"]["loss"]
    assert losses[-1] < losses[0]
    assert log["stats"]["dense"]["ratio"] > 20


@pytest.mark.slow
def test_adam_with_the_global_second_moment_averaged_over_grpc(runs):
  # The sync steps (1, 2, 4, ...) all-reduce the moments inside a tf.cond in replica
  # context, the path MultiWorkerMirroredStrategy takes (no merge_call).
  arrays, logs = runs["adam+adacomp+global+doubling"]
  plain_arrays, plain_logs = runs["adam+plain"]
  for key in _final_weights(arrays):
    np.testing.assert_array_equal(arrays[0][key], arrays[1][key])
  shared = sorted(k for k in arrays[0] if k.startswith("shared_velocity_"))
  assert shared and any(np.any(arrays[0][k]) for k in shared)
  for key in shared:
    np.testing.assert_array_equal(arrays[0][key], arrays[1][key])
  for log, plain in zip(logs, plain_logs):  # 10 steps: trains about as plain Adam does
    losses = log["history"]["loss"]
    assert losses[-1] < 0.95 * losses[0]
    assert losses[-1] < 1.1 * plain["history"]["loss"][-1]


@pytest.mark.slow
@pytest.mark.parametrize("run", ["local+adacomp+nesterov", "local+none+average"])
def test_local_steps_over_grpc_end_each_round_with_identical_workers(runs, run):
  # Two rounds of 5 local steps (tests/workers/compressed_fit.py): the round's exchange
  # runs inside a tf.cond in replica context, MultiWorkerMirroredStrategy's path.
  arrays, logs = runs[run]
  plain_arrays, plain_logs = runs["plain"]
  for key in _final_weights(arrays):
    np.testing.assert_array_equal(arrays[0][key], arrays[1][key])
    assert not np.array_equal(arrays[0][key], plain_arrays[0][key])  # not plain SGD
  anchors = sorted(k for k in arrays[0] if k.startswith("anchor_"))
  assert len(anchors) == len(_final_weights(arrays))
  for anchor, key in zip(anchors, _final_weights(arrays)):  # the last round's start
    np.testing.assert_array_equal(arrays[0][anchor], arrays[1][anchor])
    assert not np.array_equal(arrays[0][anchor], arrays[0][key])
  for log, plain in zip(logs, plain_logs):
    losses = log["history"]["loss"]
    assert losses[-1] < losses[0]
    assert log["evaluation"]["accuracy"] > 0.8 * plain["evaluation"]["accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("run", ["local+adacomp+nesterov", "local+none+average"])
def test_with_local_steps_the_logs_are_averaged_at_round_ends_and_held_between(runs, run):
  # Rounds of 5 steps over 2 epochs of 5: averaged across the workers at steps 1 (nothing
  # held yet), 5 and 10, the last average logged by every worker between
  # (tf_adacomp.step_logs); the plain optimizer's averaged at every step.
  _, logs = runs[run]
  steps = [log["history"]["batch_logs"] for log in logs]
  assert steps[0] == steps[1]  # every worker logs the same values at every step
  losses = [step["loss"] for step in steps[0]]
  assert len(losses) == 10, losses
  assert losses[1:4] == [losses[0]] * 3 and losses[5:9] == [losses[4]] * 4, losses
  assert len({losses[0], losses[4], losses[9]}) == 3, losses
  # The average at an epoch's last step is the epoch's own (Keras reads the metrics then).
  assert [losses[4], losses[9]] == pytest.approx(logs[0]["history"]["loss"], rel=1e-6)
  plain = [step["loss"] for step in runs["plain"][1][0]["history"]["batch_logs"]]
  assert all(a != b for a, b in zip(plain, plain[1:])), plain


@pytest.mark.slow
@pytest.mark.parametrize("run", ["local+adam+none", "local+adam+bf16"])
def test_local_adam_over_grpc_infers_one_first_moment_at_a_rounds_end(runs, run):
  # Adam inside rounds of 5 steps, sent whole (uncompressed or in bfloat16): at the last
  # round's end (step 10) each worker's first moment is inferred from the mean
  # pseudo-update, -mean * divisor / (alpha H), with its own divisor (its estimate of
  # the global second moment): m / divisor is the same on both workers, where each
  # worker's own first moment, from its own batches, would not be.
  arrays, logs = runs[run]
  for key in _final_weights(arrays):
    np.testing.assert_array_equal(arrays[0][key], arrays[1][key])
  moments = sorted(k for k in arrays[0] if k.startswith("m_"))
  assert len(moments) == len(_final_weights(arrays)), sorted(arrays[0])
  for key in moments:
    i = key[len("m_"):]
    per_worker = []
    for held in arrays:
      estimate = np_global_moment(held[f"v_{i}"], held[f"w_{i}"], 2, beta_1=0.9)
      per_worker.append(held[key] / (np.sqrt(estimate) + 1e-7))  # Keras' epsilon
    assert not np.array_equal(arrays[0][key], arrays[1][key])  # each its own estimate
    np.testing.assert_allclose(per_worker[0], per_worker[1], rtol=1e-4,
                               atol=1e-4 * np.abs(per_worker[0]).max())
  for log in logs:
    assert log["history"]["loss"][-1] < log["history"]["loss"][0]
