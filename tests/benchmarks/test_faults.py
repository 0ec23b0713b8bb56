"""benchmarks/faults.py with real worker processes: a worker killed mid-epoch, the job
resumed from tf_adacomp.BackupAndRestore, workers that find different backups refused,
and local steps (rounds of 4) killed and resumed mid-round (the other scenarios and the
soak run in the benchmark itself; docs/reliability.md has their figures)."""

import contextlib
import io
import json
import os
import re
import shutil

import pytest

import benchmark_scripts
import faults  # benchmarks/faults.py (benchmark_scripts puts benchmarks/ on sys.path)
import multi_worker

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
# The mid_epoch scenario's jobs: 2 epochs of 6 steps, a backup every 3 steps.
JOB = ["--epochs", "2", "--steps_per_epoch", "6", "--save_freq", "3"]


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
  """The mid_epoch and local_steps scenarios, run by one faults.py (one driver for both)
  with no uninterrupted runs (--no_baseline; see the local_steps test below), its work
  folder kept (the backups its jobs left): ``(figures, {scenario: row}, work folder)``.

  The driver runs here, ``faults.main`` with the command line it would be given (this
  process has TensorFlow imported already: a process of its own would import it again
  only to start the workers); the workers are processes of their own, as always, with
  this process's environment, as a driver process would have passed it on."""
  json_path = tmp_path_factory.mktemp("faults") / "faults.json"
  printed = io.StringIO()
  error = None
  try:
    with contextlib.redirect_stdout(printed), pytest.MonkeyPatch.context() as env:
      for name in ("TF_CPP_MIN_LOG_LEVEL", "CUDA_VISIBLE_DEVICES"):  # as given a driver
        env.setenv(name, ENV[name])
      faults.main(["--scenarios", "mid_epoch,local_steps", *JOB, "--collective_timeout", "60",
                   "--timeout", "240", "--no_baseline", "--keep", "--json", str(json_path)])
  except (Exception, SystemExit) as raised:  # pylint: disable=broad-except
    error = raised
  found = re.search(r"^work folder: (.+)$", printed.getvalue(), re.M)
  work = found.group(1).strip() if found else None
  try:
    assert error is None, f"{error!r}\n{printed.getvalue()[-3000:]}"
    figures = json.loads(json_path.read_text())
    rows = {row["scenario"]: row for row in figures["scenarios"]}
    assert sorted(rows) == ["local_steps", "mid_epoch"], figures["scenarios"]
    yield figures, rows, work
  finally:
    if work:
      shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def mid_epoch(scenarios):
  """The mid_epoch scenario: ``(figures, row, work folder)``."""
  figures, rows, work = scenarios
  return figures, rows["mid_epoch"], work


@pytest.mark.slow
def test_a_worker_killed_mid_epoch_fails_its_peer_and_the_job_resumes(mid_epoch):
  _, row, _ = mid_epoch
  assert row["killed_at_step"] == 8 and row["victim_returncode"] == -9, row
  # The survivor failed on its own (TensorFlow's heartbeats or the collective timeout),
  # well before the job's 240 s limit.
  assert row["survivors_failed"], row
  assert row["seconds_to_fail"] < 90, row
  # Resumed from the backup of step 6 (the last before the kill), with the residue
  # totals that backup saved, the same weights on both workers, and epoch 2 trained
  # again from its start: 6 + 6 steps.
  assert row["resumed_at"] == [6] and row["expected_resume"] == 6, row
  assert row["residues_restored"] and row["restored_weights_identical"], row
  assert row["final_weights_identical"] and row["steps"] == 12, row
  assert row["ok"], row


@pytest.mark.slow
def test_workers_that_restore_different_steps_stop_naming_the_backup_dir(tmp_path, mid_epoch):
  # A folder per worker (no shared filesystem), as a job whose chief alone keeps the
  # backup leaves them: worker 0's holds the backup the mid_epoch jobs left (step 12),
  # worker 1's none. On a rerun worker 0 would resume at step 12 and worker 1 at 0 (and
  # their loads' collectives would not even match). Both must stop before loading,
  # saying why.
  _, _, work = mid_epoch
  shutil.copytree(os.path.join(work, "mid_epoch", "backup"), tmp_path / "backup-0")
  assert not (tmp_path / "backup-1").exists()
  worker = os.path.join(benchmark_scripts.BENCHMARKS_DIR, "fault_worker.py")
  rerun = multi_worker.run_workers(
      worker, num_workers=2, timeout=240, out_dir=tmp_path / "rerun",
      args=["--out_dir", str(tmp_path / "rerun"), *JOB,
            "--backup_dir", str(tmp_path / "backup-{worker}")])
  assert [r.returncode for r in rerun] == [1, 1], multi_worker.describe(rerun)
  for index in range(2):
    record = json.loads((tmp_path / "rerun" / f"worker{index}.json").read_text())
    assert record["error"] == "ValueError", record
    assert "found different backups: 1 of 2 found one" in record["message"], record
    assert f"Received: backup_dir='{tmp_path / f'backup-{index}'}'" in record["message"]


@pytest.fixture(scope="module")
def local_steps_row(scenarios):
  """The local_steps scenario (rounds of 4, DiLoCo's outer step) on the mid_epoch
  scenario's jobs: ``(row, baselines)``."""
  figures, rows, _ = scenarios
  return rows["local_steps"], figures["baselines"]


@pytest.mark.slow
def test_local_steps_killed_mid_round_resume_the_round_from_a_mid_round_backup(
    local_steps_row):
  row, baselines = local_steps_row
  assert row["local_steps"] == 4 and row["outer_optimizer"] == "nesterov", row
  # Backups every 3 steps: the one at step 6 falls inside the round of steps 5-8, and
  # worker 1 dies at step 7, inside it too (the first mid-round step after it).
  assert row["planned_backup"] == 6 and row["killed_at_step"] == 7, row
  assert row["backup_mid_round"] and row["kill_mid_round"], row
  assert row["victim_returncode"] == -9 and row["survivors_failed"], row
  # iterations resumes at the backup's step, with the residue totals, the anchors and
  # the outer Nesterov state that backup holds and the chief's weights at that backup.
  assert row["resumed_at"] == [6] and row["expected_resume"] == 6, row
  assert row["residues_restored"] and row["restored_weights_identical"], row
  assert row["anchors_saved_exactly"] and row["anchors_restored"], row
  assert row["outer_state_restored"] and row["restored_chief_weights"], row
  # Rounds end at the multiples of 4 before the kill and after the resume (epoch 2 again:
  # steps 7-12). (No uninterrupted run here, for time, --no_baseline: uninterrupted
  # rounds over gRPC with DiLoCo's outer step, that end with identical workers and learn,
  # are tests/test_optimizer_multi_worker.py's local+adacomp+nesterov run; nothing is
  # sent mid-round, tests/test_local_steps.py's.)
  assert row["killed_round_ends"] == [4], row
  assert row["resumed_round_ends"] == [8, 12], row
  assert row["uninterrupted_round_ends"] is None, row
  assert row["rounds_aligned"], row
  # The job ends at a round's end (step 12), where every worker adopts the same anchor.
  assert row["steps"] == 12 and row["final_round_complete"], row
  assert row["final_weights_identical"], row
  assert {(b["local_steps"], b["outer_optimizer"]) for b in baselines} == {
      (1, "average"), (4, "nesterov")}, baselines
  # The resumed job learned (10 classes: chance is 0.1).
  assert row["accuracy"] > 0.4, row
  assert row["rounds_ok"] and row["ok"], row
