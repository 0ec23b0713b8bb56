"""benchmarks/faults.py with real worker processes: a worker killed mid-epoch, the job
resumed from tf_adacomp.BackupAndRestore, and workers that find different backups
refused (the other scenarios and the soak run in the benchmark itself;
docs/reliability.md has their figures)."""

import json
import os
import subprocess
import sys

import benchmark_scripts
import multi_worker

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")


def test_a_worker_killed_mid_epoch_fails_its_peer_and_the_job_resumes(tmp_path):
  result = subprocess.run(
      [sys.executable, os.path.join(benchmark_scripts.BENCHMARKS_DIR, "faults.py"),
       "--scenarios", "mid_epoch", "--epochs", "2", "--steps_per_epoch", "6",
       "--save_freq", "3", "--collective_timeout", "60", "--timeout", "240", "--no_baseline",
       "--json", str(tmp_path / "faults.json")],
      capture_output=True, text=True, env=ENV, timeout=560, check=False)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  row, = json.loads((tmp_path / "faults.json").read_text())["scenarios"]
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


def test_workers_that_restore_different_steps_stop_naming_the_backup_dir(tmp_path):
  # A folder per worker (no shared filesystem): only the chief's holds the backup, so
  # on the rerun worker 0 would resume at step 4 and worker 1 at 0 (and their loads'
  # collectives would not even match). Both must stop before loading, saying why.
  worker = os.path.join(benchmark_scripts.BENCHMARKS_DIR, "fault_worker.py")
  backup = str(tmp_path / "backup-{worker}")
  common = ["--epochs", "1", "--steps_per_epoch", "4", "--save_freq", "2",
            "--backup_dir", backup]
  first = multi_worker.run_workers(worker, num_workers=2, timeout=240,
                                   out_dir=tmp_path / "first",
                                   args=["--out_dir", str(tmp_path / "first"), *common])
  assert [r.returncode for r in first] == [0, 0], multi_worker.describe(first)
  second = multi_worker.run_workers(
      worker, num_workers=2, timeout=240, out_dir=tmp_path / "second",
      args=["--out_dir", str(tmp_path / "second"), "--epochs", "2", *common[2:]])
  assert [r.returncode for r in second] == [1, 1], multi_worker.describe(second)
  for index in range(2):
    record = json.loads((tmp_path / "second" / f"worker{index}.json").read_text())
    assert record["error"] == "ValueError", record
    assert "found different backups: 1 of 2 found one" in record["message"], record
    assert f"Received: backup_dir='{tmp_path / f'backup-{index}'}'" in record["message"]
