"""The Horovod migration (docs/migrating_from_horovod.md): a Horovod-shaped tf.keras script,
converted by the page's table on both routes (tf_keras with
tf_adacomp.tf_keras.CompressedOptimizer; Keras 3 with tf_adacomp.CompressedOptimizer),
trains on 2 worker processes under MultiWorkerMirroredStrategy, and the page says truly
how many lines changed and covers each Horovod piece.

Run as a script, ``python test_horovod_migration.py SCRIPT CHECKPOINT_DIR``, this file is
one worker of that run (``run_as_worker``): it runs SCRIPT as ``__main__`` and then
writes what the slow test compares across the workers."""

import difflib
import os
import re
import runpy
import sys

import numpy as np
import pytest

import multi_worker

ROOT = multi_worker.PROJECT_ROOT
ORIGINAL = ROOT / "docs" / "migration" / "horovod_keras_fashion_mnist.py"
# The converted scripts, one per route.
ROUTES = {"tf_keras": ROOT / "examples" / "tf_keras_fashion_mnist.py",
          "keras3": ROOT / "examples" / "keras3_fashion_mnist.py"}
PAGE = ROOT / "docs" / "migrating_from_horovod.md"
BATCH_SIZE = 64  # the scripts' per-worker batch (Horovod's)


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


@pytest.mark.parametrize("route", ROUTES)
def test_the_page_states_the_lines_the_migration_changes(route):
  script = ROUTES[route]
  original, migrated = code_lines(ORIGINAL), code_lines(script)
  removed, added = changed_lines(original, migrated)
  page = " ".join(PAGE.read_text().split())  # the sentence may wrap anywhere
  stated = re.search(rf"\(\.\./examples/{re.escape(script.name)}\): (\d+) of its (\d+) lines "
                     rf"of code are removed or changed and (\d+) are added", page)
  assert stated, f"the page must state the line counts of {script.name}"
  assert [int(g) for g in stated.groups()] == [removed, len(original), added]
  # The one line of compression: the wrapped optimizer.
  assert sum("CompressedOptimizer(" in line for line in migrated) == 1
  assert not any("hvd" in line or "horovod" in line for line in migrated)


@pytest.mark.parametrize("route", ROUTES)
def test_the_script_is_converted_as_the_table_says(route):
  lines = code_lines(ROUTES[route])
  text = "\n".join(lines)

  def index(fragment):
    found = [i for i, line in enumerate(lines) if fragment in line]
    assert len(found) == 1, (fragment, found)
    return found[0]

  for gone in ("experimental_run_tf_function", "legacy", ".shard(", "set_visible_devices"):
    assert gone not in text, gone
  # Memory growth before the strategy; the model and its compile under its scope; the
  # global batch.
  strategy = index("strategy = ")
  assert index("set_memory_growth(gpu, True)") < strategy
  assert lines[index("with strategy.scope():") + 1].startswith("  model = build_model(")
  assert "model.compile(" in "\n".join(lines[index("def build_model"):index("return model")])
  assert ".batch(BATCH_SIZE * strategy.num_replicas_in_sync)" in text
  assert "PolynomialDecay(" in text
  if route == "tf_keras":
    assert index('os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")') < index(
        "import tensorflow as tf")
    assert "adacomp.CompressedOptimizer(opt)" in text and "tf.keras.optimizers.SGD(" in text
    assert '"checkpoint-{epoch}"), save_weights_only=True' in text  # TensorFlow's format
  else:
    assert "tf.keras" not in text and "import keras" in lines
    assert "tf_adacomp.CompressedOptimizer(opt)" in text and "keras.optimizers.SGD(" in text
    assert '"checkpoint-{epoch}.weights.h5"), save_weights_only=True' in text
    # Every worker saves, each to a file of its own (Keras 3 writes the path it is given).
    assert "CHECKPOINT_DIR if strategy.cluster_resolver.task_id == 0 else" in text


@pytest.mark.parametrize("piece", [
    "hvd.init", "hvd.rank", "hvd.local_rank", "hvd.size", "hvd.DistributedOptimizer",
    "compression=hvd.Compression.fp16", "hvd.Compression.none", "op=hvd.Adasum",
    "backward_passes_per_step=1", "backward_passes_per_step=N", "average_aggregated_gradients",
    "sparse_as_dense", "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
    "LearningRateWarmupCallback", "horovodrun -np", "experimental_run_tf_function",
    "set_memory_growth", ".shard(hvd.size(), hvd.rank())", ".batch(", "model.compile(",
    "ModelCheckpoint(", "tf.keras.optimizers.legacy.SGD", "import tensorflow as tf"])
def test_the_page_has_a_row_for_each_horovod_piece(piece):
  rows = [line for line in PAGE.read_text().splitlines() if line.startswith("|")]
  assert any(piece in row.split("|")[1] for row in rows if row.count("|") >= 3), piece


@pytest.mark.parametrize("replacement", [
    "with strategy.scope():", "num_replicas_in_sync", 'compressor="fp16"',
    "keras.optimizers.schedules.PolynomialDecay", ".weights.h5"])
def test_the_page_has_a_row_for_each_replacement(replacement):
  rows = [line for line in PAGE.read_text().splitlines() if line.startswith("|")]
  assert any(replacement in row.split("|")[2] for row in rows if row.count("|") >= 3), replacement


def run_as_worker(script, checkpoint_dir):
  """In a worker: runs ``script`` as ``__main__`` with ``checkpoint_dir``, then loads the
  chief's last checkpoint back into its model, and writes ``worker{i}.npz`` to the run's
  folder: the final weights (``weight{k}``) and this worker's own residues
  (``residue{k}``: its replica's value), the same after the load (``loaded_weight{k}``,
  ``loaded_residue{k}``), and how many examples one replica gets from a batch of the
  script's data set (``replica_batch``)."""
  sys.argv = [script, checkpoint_dir]
  names = runpy.run_path(script, run_name="__main__")
  strategy, model = names["strategy"], names["model"]
  import keras  # pylint: disable=import-outside-toplevel

  def local(variable):
    if isinstance(variable, keras.Variable):  # Keras 3: the tf.Variable it holds
      variable = variable.value
    return strategy.experimental_local_results(variable)[0].numpy()

  def state(prefix):
    residues = [v for v in model.optimizer.variables if "residue" in v.name]
    found = {f"{prefix}weight{k}": w for k, w in enumerate(model.get_weights())}
    found.update({f"{prefix}residue{k}": local(v) for k, v in enumerate(residues)})
    return found

  arrays = state("")
  images, _ = next(iter(strategy.experimental_distribute_dataset(names["dataset"])))
  arrays["replica_batch"] = strategy.experimental_local_results(images)[0].shape[0]
  last = os.path.join(checkpoint_dir, f"checkpoint-{names['EPOCHS']}")
  model.load_weights(last + ".weights.h5" if os.path.exists(last + ".weights.h5") else last)
  arrays.update(state("loaded_"))
  np.savez(multi_worker.worker_out_dir() / f"worker{multi_worker.worker_index()}.npz",
           **arrays)


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
def test_the_converted_script_trains_on_2_workers_with_residues_in_its_checkpoints(
    route, tmp_path):
  checkpoints, out = tmp_path / "checkpoints", tmp_path / "out"
  results = multi_worker.run_workers(
      __file__, num_workers=2, out_dir=out, timeout=300,
      env={"EPOCHS": "2", "STEPS_PER_EPOCH": "25"}, args=[str(ROUTES[route]), str(checkpoints)])
  assert all(r.returncode == 0 for r in results), multi_worker.describe(results)
  accuracy = float(re.search(r"test accuracy (\S+)", results[0].stdout).group(1))
  assert accuracy > 0.55, results[0].stdout  # 50 steps of batch 128; chance is 0.1
  assert "test accuracy" not in results[1].stdout  # the chief prints
  # The chief's checkpoints, in the page's format (the other worker's went to a
  # temporary folder, now gone).
  assert sorted(p.name for p in checkpoints.iterdir() if p.name != "checkpoint") == (
      ["checkpoint-1.data-00000-of-00001", "checkpoint-1.index",
       "checkpoint-2.data-00000-of-00001", "checkpoint-2.index"] if route == "tf_keras" else
      ["checkpoint-1.weights.h5", "checkpoint-2.weights.h5"])
  workers = [dict(np.load(out / f"worker{i}.npz")) for i in range(2)]
  weights = [k for k in workers[0] if k.startswith("weight")]
  residues = [k for k in workers[0] if k.startswith("residue")]
  assert len(weights) == len(residues) == 6, sorted(workers[0])
  # One model: both workers end with the same weights. Each replica trains on the
  # per-worker batch of the Horovod script: the data set's batch is the global one.
  for key in weights:
    np.testing.assert_array_equal(workers[0][key], workers[1][key], err_msg=key)
  assert [int(w["replica_batch"]) for w in workers] == [BATCH_SIZE, BATCH_SIZE]
  # The last checkpoint holds the final weights and each replica's own residue (the
  # workers' residues differ; tf_adacomp.replica_state), which a load onto as many
  # workers gives back to each.
  for worker in workers:
    for key in weights:
      np.testing.assert_array_equal(worker["loaded_" + key], worker[key], err_msg=key)
    for key in residues:
      assert not np.array_equal(workers[0][key], workers[1][key]), key
      np.testing.assert_array_equal(worker["loaded_" + key], worker[key], err_msg=key)


if __name__ == "__main__":
  run_as_worker(*sys.argv[1:3])
