"""The Horovod migration (docs/migrating_from_horovod.md): a Horovod-shaped tf.keras script,
converted by the page's table, trains on 2 worker processes under
MultiWorkerMirroredStrategy with tf_adacomp.tf_keras.CompressedOptimizer, and the page
says truly how many lines changed and covers each Horovod piece."""

import difflib
import re

import numpy as np
import pytest

import multi_worker

ROOT = multi_worker.PROJECT_ROOT
ORIGINAL = ROOT / "docs" / "migration" / "horovod_keras_fashion_mnist.py"
MIGRATED = ROOT / "examples" / "tf_keras_fashion_mnist.py"
PAGE = ROOT / "docs" / "migrating_from_horovod.md"


def code_lines(path):
  """The lines of ``path`` that are code: no module docstring, comment or blank line."""
  text = path.read_text()
  body = text.split('"""', 2)[2] if text.startswith('"""') else text
  return [line.rstrip() for line in body.splitlines()
          if line.strip() and not line.strip().startswith("#")]


def changed_lines(original, migrated):
  """(lines removed or replaced, lines added) between two lists of lines."""
  removed = added = 0
  matcher = difflib.SequenceMatcher(a=original, b=migrated, autojunk=False)
  for tag, i1, i2, j1, j2 in matcher.get_opcodes():
    if tag != "equal":
      removed += i2 - i1
      added += j2 - j1
  return removed, added


def test_changed_lines_counts_a_replaced_line_on_both_sides():
  assert changed_lines(["a", "b", "c"], ["a", "B", "c", "d"]) == (1, 2)
  assert changed_lines(["a"], ["a"]) == (0, 0)


def test_the_page_states_the_lines_the_migration_changes():
  original, migrated = code_lines(ORIGINAL), code_lines(MIGRATED)
  removed, added = changed_lines(original, migrated)
  stated = re.search(r"(\d+) of its (\d+) lines of code are removed or changed and (\d+) "
                     r"are added", PAGE.read_text())
  assert stated, "the page must state the migration's line counts"
  assert [int(g) for g in stated.groups()] == [removed, len(original), added]
  # The one line of compression: the wrapped optimizer.
  assert sum("CompressedOptimizer(" in line for line in migrated) == 1
  assert not any("hvd" in line or "horovod" in line for line in migrated)


@pytest.mark.parametrize("piece", [
    "hvd.init", "hvd.rank", "hvd.local_rank", "hvd.size", "hvd.DistributedOptimizer",
    "compression=hvd.Compression.fp16", "op=hvd.Adasum", "backward_passes_per_step",
    "sparse_as_dense", "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
    "LearningRateWarmupCallback", "horovodrun -np"])
def test_the_page_has_a_row_for_each_horovod_piece(piece):
  rows = [line for line in PAGE.read_text().splitlines() if line.startswith("|")]
  assert any(piece in row.split("|")[1] for row in rows if row.count("|") >= 3), piece


@pytest.mark.slow
def test_the_migrated_script_trains_on_2_workers_with_residues_in_its_checkpoint(tmp_path):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  checkpoints = tmp_path / "checkpoints"
  results = multi_worker.run_workers(
      MIGRATED, num_workers=2, out_dir=tmp_path / "out", timeout=300,
      env={"EPOCHS": "2", "STEPS_PER_EPOCH": "25"}, args=[str(checkpoints)])
  assert all(r.returncode == 0 for r in results), multi_worker.describe(results)
  accuracy = float(re.search(r"test accuracy (\S+)", results[0].stdout).group(1))
  assert accuracy > 0.55, results[0].stdout  # 50 steps of batch 128; chance is 0.1
  assert "test accuracy" not in results[1].stdout  # the chief prints
  # The chief's checkpoints, with each worker's residues summed (the rest went to
  # temporary folders and are gone).
  assert sorted(p.name for p in checkpoints.glob("*.index")) == [
      "checkpoint-1.index", "checkpoint-2.index"]
  reader = tf.train.load_checkpoint(str(checkpoints / "checkpoint-2"))
  residues = [k for k in reader.get_variable_to_shape_map() if "/residues/" in k]
  assert len(residues) == 6, sorted(reader.get_variable_to_shape_map())
  assert all(np.abs(reader.get_tensor(k)).sum() > 0 for k in residues)
