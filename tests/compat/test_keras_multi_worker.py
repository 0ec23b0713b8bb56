"""The fix for Keras 3 ``model.fit`` under multi-worker ``MultiWorkerMirroredStrategy``.

- Canaries: on the installed Keras, each guard (``keras_multi_worker_fix_needed``)
  agrees with the behaviour it stands for, observed by running the original function;
  the private names only a cluster exercises are read on 2 workers.
- In process: the patches install once, revert, skip Keras 2 and paths fixed upstream,
  and change nothing under other strategies; ``CompressedOptimizer`` applies the fix
  itself, with one log line.
- 2 worker processes on 127.0.0.1 (tests/multi_worker.py) train with ``model.fit``:
  with the fix they train, agree bit for bit and match one process training on the same
  global batches; without it (or with only half of it) they fail with the upstream
  errors; the standard constructor with ``CompressedOptimizer`` trains with no call.
"""

import json
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import canaries
import tf_adacomp
from multi_worker import WORKERS_DIR, describe, run_workers
from tf_adacomp import distribute
from tf_adacomp.compat import internals
from tf_adacomp.compat import keras_multi_worker as kmw
from tf_adacomp.compat import patches
from tf_adacomp.compat import versions
from workers import keras_fit

keras_trainer = internals.keras_tensorflow_trainer()

KERAS_FIT_WORKER = WORKERS_DIR / "keras_fit.py"
NUM_WORKERS = 2


def _cpus():
  return [d.name for d in tf.config.list_logical_devices("CPU")][:2]


def _bare_multi_worker_strategy():
  """An instance that is a MultiWorkerMirroredStrategy, without starting a cluster."""
  cls = tf.distribute.MultiWorkerMirroredStrategy
  return cls.__new__(cls)


# --- Canaries: each guard agrees with the installed Keras' behaviour ----------------------


def test_the_symbolic_build_still_reduces_the_distributed_batch(unpatched_keras, monkeypatch):
  """The bug of the first patch: Keras' ``_maybe_symbolic_build`` reduces the first
  distributed batch across replicas (``strategy.reduce``), which MWMS cannot do for a
  nested batch. Run on a ``MirroredStrategy`` (which can), with that reduce observed."""
  name = f"`{kmw.SYMBOLIC_BUILD}`"
  user = "the symbolic-build patch and its guard"
  strategy = distribute.mirrored_strategy(devices=_cpus())
  with strategy.scope():
    model = keras.Sequential([keras.Input([3]), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
  reduced = []
  real_reduce = strategy.reduce

  def observed_reduce(reduce_op, value, axis):
    reduced.append(any(isinstance(v, tf.distribute.DistributedValues)
                       for v in tf.nest.flatten(value)))
    return real_reduce(reduce_op, value, axis=axis)

  monkeypatch.setattr(strategy, "reduce", observed_reduce)
  dataset = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((np.zeros([8, 3], np.float32),
                                          np.zeros([8, 2], np.float32))).batch(4))
  with canaries.watching(name, user):
    keras_trainer.TensorFlowTrainer._maybe_symbolic_build(  # pylint: disable=protected-access
        model, iterator=[(0, 0, iter(dataset))])
  has_bug = any(reduced)
  canaries.require(has_bug == (kmw.SYMBOLIC_BUILD in kmw.keras_multi_worker_fix_needed()),
                   name, user, f"the original reduces the distributed batch: {has_bug}; the "
                   f"guard says the patch is needed: {not has_bug}")


def test_reduce_per_replica_still_fails_on_scalar_logs_in_multi_worker_mode(unpatched_keras,
                                                                             monkeypatch):
  """The bug of the second patch: in multi-worker mode Keras' ``reduce_per_replica``
  averages along axis 0, which scalar logs do not have. Multi-worker mode is what
  Keras' own ``_collective_all_reduce_multi_worker`` says, set to True here around a
  ``MirroredStrategy``; the patch, installed, gives the mean over replicas instead."""
  name = f"`{internals.KERAS_TENSORFLOW_TRAINER}.reduce_per_replica`"
  user = "the reduce_per_replica patch and its guard"
  strategy = distribute.mirrored_strategy(devices=_cpus())
  logs = {"loss": strategy.run(lambda: tf.cast(
      tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32) + 1.0)}
  with canaries.watching(name, user):
    monkeypatch.setattr(keras_trainer, "_collective_all_reduce_multi_worker", lambda s: True)
  original = keras_trainer.reduce_per_replica
  try:
    original(logs, strategy, "auto")
    has_bug = False
  except (tf.errors.InvalidArgumentError, ValueError) as error:
    has_bug = "reduction dimension" in str(error).lower()
  canaries.require(has_bug == (kmw.REDUCE_PER_REPLICA in kmw.keras_multi_worker_fix_needed()),
                   name, user, f"the original fails on scalar logs: {has_bug}; the guard "
                   f"says the patch is needed: {not has_bug}")
  if has_bug:
    assert patches.install(kmw.REDUCE_PER_REPLICA)
    reduced = keras_trainer.reduce_per_replica(logs, strategy, "auto")
    assert float(reduced["loss"]) == 1.5  # the mean of replicas' 1.0 and 2.0


def test_keras_tests_multi_worker_mode_with_collective_all_reduce_multi_worker():
  """Off for the strategies one process can run (on 2 workers: test below)."""
  name = f"`{internals.KERAS_TENSORFLOW_TRAINER}._collective_all_reduce_multi_worker`"
  strategies = (tf.distribute.get_strategy(), distribute.mirrored_strategy(devices=_cpus()))
  with canaries.watching(name, "the reduce_per_replica patch"):
    found = [keras_trainer._collective_all_reduce_multi_worker(s)  # pylint: disable=protected-access
             for s in strategies]
  canaries.require(found == [False, False], name, "the reduce_per_replica patch",
                   f"False for the default and a MirroredStrategy, got {found}")


# --- In process: guard, idempotence, no-op for other strategies --------------------------

def test_fix_is_needed_by_the_installed_keras():
  """The Keras of requirements.txt still has both failing calls: both patches are needed.
  (The skips of the control runs below depend on this being right.)"""
  if versions.keras_version() < (3, 0):
    pytest.skip("Keras 2")
  assert kmw.keras_multi_worker_fix_needed() == kmw.PATCHES


def test_fix_is_idempotent_and_revertible(unpatched_keras):
  originals = (keras_trainer.TensorFlowTrainer._maybe_symbolic_build,  # pylint: disable=protected-access
               keras_trainer.reduce_per_replica)
  needed = kmw.keras_multi_worker_fix_needed()
  assert kmw.apply_keras_multi_worker_fix() == needed
  patched = (keras_trainer.TensorFlowTrainer._maybe_symbolic_build,  # pylint: disable=protected-access
             keras_trainer.reduce_per_replica)
  assert kmw.apply_keras_multi_worker_fix() == needed  # twice: patched once
  assert (keras_trainer.TensorFlowTrainer._maybe_symbolic_build,  # pylint: disable=protected-access
          keras_trainer.reduce_per_replica) == patched
  assert kmw.keras_multi_worker_fix_needed() == needed  # judged on the originals
  if needed:
    assert patched != originals
    assert kmw.keras_multi_worker_fix_applied()
  assert kmw.revert_keras_multi_worker_fix() == needed
  assert (keras_trainer.TensorFlowTrainer._maybe_symbolic_build,  # pylint: disable=protected-access
          keras_trainer.reduce_per_replica) == originals
  assert not kmw.keras_multi_worker_fix_applied()


def test_fix_skips_keras_2(unpatched_keras, monkeypatch):
  monkeypatch.setattr(keras, "__version__", "2.15.0")
  assert kmw.keras_multi_worker_fix_needed() == ()
  assert kmw.apply_keras_multi_worker_fix() == ()
  assert not kmw.keras_multi_worker_fix_applied()


def test_fix_skips_a_path_fixed_upstream(unpatched_keras, monkeypatch):
  def reduce_per_replica(values, strategy, reduction):  # as if fixed upstream
    return values
  monkeypatch.setattr(keras_trainer, "reduce_per_replica", reduce_per_replica)
  assert kmw.REDUCE_PER_REPLICA not in kmw.keras_multi_worker_fix_needed()
  assert kmw.REDUCE_PER_REPLICA not in kmw.apply_keras_multi_worker_fix()
  assert keras_trainer.reduce_per_replica is reduce_per_replica


def _fit_tiny_model(strategy, initial_weights):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(96, 5)).astype(np.float32)
  y = rng.integers(0, 3, size=96).astype(np.int32)
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
  with strategy.scope():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
  if initial_weights is not None:
    model.set_weights(initial_weights)
  initial = model.get_weights()
  history = model.fit(dataset, epochs=2, shuffle=False, verbose=0).history
  evaluation = model.evaluate(dataset, verbose=0, return_dict=True)
  predictions = model.predict(dataset, verbose=0)
  return initial, model.get_weights(), history, evaluation, predictions


# The fast tier checks the default strategy; the 2-replica one runs with --full.
@pytest.mark.parametrize("kind", [pytest.param("mirrored", marks=pytest.mark.slow), "default"])
def test_fix_is_a_no_op_without_multi_worker(unpatched_keras, kind):
  def make_strategy():
    if kind == "mirrored":  # a plain MirroredStrategy with collective keys of its own
      return distribute.mirrored_strategy(devices=_cpus())
    return tf.distribute.get_strategy()

  initial, *before = _fit_tiny_model(make_strategy(), None)
  kmw.apply_keras_multi_worker_fix()
  assert kmw.keras_multi_worker_fix_applied()
  _, *after = _fit_tiny_model(make_strategy(), initial)
  weights_before, history_before, evaluation_before, predictions_before = before
  weights_after, history_after, evaluation_after, predictions_after = after
  for b, a in zip(weights_before, weights_after):
    np.testing.assert_array_equal(a, b)
  assert history_after == history_before
  assert evaluation_after == evaluation_before
  np.testing.assert_array_equal(predictions_after, predictions_before)


def test_logs_are_averaged_in_one_all_reduce_per_dtype(monkeypatch):
  """``mean_over_replicas``: every logged value's mean over the replicas, exactly what a
  reduction per value gives, in one ``strategy.reduce`` per dtype (a fixed cost of
  every step in multi-worker mode, one collective instead of one per logged value)."""
  strategy = distribute.mirrored_strategy(devices=_cpus())

  def per_replica(fn):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: fn(float(ctx.replica_id_in_sync_group)))

  values = {
      "loss": per_replica(lambda r: tf.constant(1.5 * r + 0.25)),
      "accuracy": per_replica(lambda r: tf.constant(0.5 + 0.125 * r)),
      "per_class": per_replica(lambda r: tf.reshape(tf.range(6.0) * (r + 1.0), [2, 3])),
      "steps": per_replica(lambda r: tf.constant([2.0, 4.0], tf.float64) * (r + 1.0)),
      "alone": per_replica(lambda r: tf.constant(3, tf.int32)),
  }
  expected = {k: strategy.reduce("MEAN", v, axis=None) for k, v in values.items()}
  calls = []
  reduce = strategy.reduce
  monkeypatch.setattr(strategy, "reduce",
                      lambda op, value, axis: calls.append(op) or reduce(op, value, axis))
  got = kmw.mean_over_replicas(values, strategy)
  assert sorted(got) == sorted(values)
  for key, value in expected.items():
    assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
    np.testing.assert_array_equal(got[key], value, err_msg=key)
  assert calls == ["MEAN"] * 3  # float32 (3 values), float64, int32


@pytest.mark.parametrize("reduction", ["auto", "mean", "sum", "first", "concat"])
def test_patched_reduce_per_replica_is_the_original_under_mirrored(unpatched_keras, reduction):
  original = keras_trainer.reduce_per_replica
  if kmw.REDUCE_PER_REPLICA not in kmw.apply_keras_multi_worker_fix():
    pytest.skip("reduce_per_replica needs no patch in this Keras")
  patched = keras_trainer.reduce_per_replica
  assert patched is not original
  strategy = distribute.mirrored_strategy(devices=_cpus())
  values = {
      "loss": strategy.experimental_distribute_values_from_function(
          lambda ctx: tf.constant(1.5 * ctx.replica_id_in_sync_group + 0.25)),
      "vector": strategy.experimental_distribute_values_from_function(
          lambda ctx: tf.range(3, dtype=tf.float32) * float(ctx.replica_id_in_sync_group + 1)),
      "plain": tf.constant(7.0),
  }
  expected = original(values, strategy, reduction)
  got = patched(values, strategy, reduction)
  for key in values:
    np.testing.assert_array_equal(got[key], expected[key])


# --- 2 worker processes: the fix trains, each half of it is needed -------------------------

def _run_keras_fit(mode, out_dir):
  return run_workers(KERAS_FIT_WORKER, num_workers=NUM_WORKERS, timeout=120, args=[mode],
                     out_dir=out_dir)


@pytest.fixture(scope="module")
def fix_run(tmp_path_factory):
  """One run of 2 workers with the fix: ``(reports, arrays)``, per worker."""
  out_dir = tmp_path_factory.mktemp("fix_run")
  results = _run_keras_fit("fix", out_dir)
  assert all(r.returncode == 0 for r in results), describe(results)
  reports = [json.loads((out_dir / f"worker{i}.json").read_text()) for i in range(NUM_WORKERS)]
  arrays = [dict(np.load(out_dir / f"worker{i}.npz")) for i in range(NUM_WORKERS)]
  return reports, arrays


@pytest.mark.slow
def test_keras_fit_multi_worker_with_fix(fix_run):
  reports, arrays = fix_run

  for report in reports:
    assert report["replicas"] == NUM_WORKERS
    assert report["patches"] == list(kmw.keras_multi_worker_fix_needed())
  # It trains: the loss falls, epoch after epoch and at the final evaluation.
  history = reports[0]["history"]
  assert history["loss"][1] < history["loss"][0] - 0.1, history
  assert reports[0]["evaluation"]["loss"] < history["loss"][0] - 0.2, reports[0]
  # The workers agree bit for bit: logs (all-reduced) and weights.
  for report in reports[1:]:
    assert report["history"] == reports[0]["history"]
    assert report["evaluation"] == reports[0]["evaluation"]
  assert sorted(arrays[0]) == sorted(arrays[1])
  for key in arrays[0]:
    np.testing.assert_array_equal(arrays[1][key], arrays[0][key], err_msg=key)
  count = len(arrays[0]) // 2
  initial = [arrays[0][f"initial_{i}"] for i in range(count)]
  final = [arrays[0][f"final_{i}"] for i in range(count)]
  assert any(not np.array_equal(a, b) for a, b in zip(initial, final))

  # And they computed what one process computes on the same global batches of 64.
  model = keras_fit.make_model()
  model.set_weights(initial)
  reference_history, reference_evaluation = keras_fit.fit(model, *keras_fit.load_digits())
  for got, want in zip(final, model.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(history["loss"], reference_history["loss"], rtol=1e-4)
  np.testing.assert_allclose(history["accuracy"], reference_history["accuracy"], atol=1e-6)
  np.testing.assert_allclose(reports[0]["evaluation"]["loss"], reference_evaluation["loss"],
                             rtol=1e-4)


def _skip_unless_needed(patch):
  if patch not in kmw.keras_multi_worker_fix_needed():
    pytest.skip(f"the installed Keras {keras.__version__} does not have this bug")


# The control runs (upstream Keras; the symbolic-build patch alone) and the standard
# constructor's run all use tf.distribute.MultiWorkerMirroredStrategy() as it comes: one
# 2-worker job (tests/workers/standard_strategy_fit.py) runs the controls this Keras
# needs, each a fresh model.fit that fails while tracing its first step, then the
# standard run, instead of a cluster start-up each.
CONTROLS = {kmw.SYMBOLIC_BUILD: "none", kmw.REDUCE_PER_REPLICA: "symbolic-build-only"}


@pytest.fixture(scope="module")
def standard_run(tmp_path_factory):
  """The 2-worker job of the standard constructor, after the control runs this Keras
  needs: ``(results, out_dir, {control: [its record per worker]})``."""
  out_dir = tmp_path_factory.mktemp("standard_run")
  controls = [CONTROLS[patch] for patch in kmw.keras_multi_worker_fix_needed()]
  results = run_workers(WORKERS_DIR / "standard_strategy_fit.py", num_workers=NUM_WORKERS,
                        timeout=240, out_dir=out_dir, args=controls)
  found = {}
  if controls:
    for i in range(NUM_WORKERS):
      path = out_dir / f"worker{i}.controls.json"
      assert path.exists(), describe(results)
      for control, record in json.loads(path.read_text()).items():
        found.setdefault(control, []).append(record)
  return results, out_dir, found


def _control(standard_run, control):
  """Each worker's record of the control run ``control``, and the job's outputs."""
  results, _, found = standard_run
  assert len(found.get(control, ())) == NUM_WORKERS, describe(results)
  return found[control], describe(results)


@pytest.mark.slow
def test_keras_fit_multi_worker_without_fix_fails_upstream(standard_run):
  """The control run: upstream Keras fails in fit's symbolic build."""
  _skip_unless_needed(kmw.SYMBOLIC_BUILD)
  records, outputs = _control(standard_run, "none")
  for record in records:
    assert record["patches"] == [], record
    # fit raised: it trained nothing, and no results were written after it.
    assert "error" in record and "history" not in record, (record, outputs)
    assert "ValueError: Attempt to convert a value (PerReplica" in record["error"], record
    assert "unsupported type (<class 'tensorflow.python.distribute.values.PerReplica'>) " \
           "to a Tensor" in record["error"], record


@pytest.mark.slow
def test_keras_fit_multi_worker_needs_both_patches(standard_run):
  """With the symbolic build fixed only, the scalar logs' MEAN along axis 0 fails."""
  _skip_unless_needed(kmw.REDUCE_PER_REPLICA)
  records, outputs = _control(standard_run, "symbolic-build-only")
  for record in records:
    assert record["patches"] == [kmw.SYMBOLIC_BUILD], record
    assert "error" in record and "history" not in record, (record, outputs)
    assert "Invalid reduction dimension 0 for input with 0 dimensions" in record["error"], \
        record


@pytest.mark.slow
@pytest.mark.parametrize("key, name, user", [
    ("in_multi_worker_mode", "`CollectiveAllReduceExtended._in_multi_worker_mode`",
     "internals.in_multi_worker_mode (backup, this fix)"),
    ("collective_all_reduce_multi_worker",
     "`keras.src.backend.tensorflow.trainer._collective_all_reduce_multi_worker`",
     "the reduce_per_replica patch"),
    ("own_distribute_strategy", "`TensorFlowTrainer._distribute_strategy`",
     "the symbolic-build patch"),
])
def test_private_names_on_two_workers(fix_run, key, name, user):
  """Canaries that need a cluster: on 2 workers, multi-worker mode is on by both tests,
  and a model made in the strategy's scope knows it as its own."""
  reports, _ = fix_run
  found = [report["private"][key] for report in reports]
  canaries.require(found == [True] * NUM_WORKERS, name, user,
                   f"expected True on each of {NUM_WORKERS} workers, got {found}")


# --- CompressedOptimizer applies the fix --------------------------------------------------


def test_other_strategies_leave_keras_alone(unpatched_keras):
  assert kmw.apply_keras_multi_worker_fix_for(tf.distribute.get_strategy()) == ()
  assert kmw.apply_keras_multi_worker_fix_for(None) == ()
  tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1))
  assert not kmw.keras_multi_worker_fix_applied()


def test_a_multi_worker_strategy_installs_the_fix_once_with_one_log_line(unpatched_keras, caplog):
  needed = kmw.keras_multi_worker_fix_needed()
  strategy = _bare_multi_worker_strategy()
  with caplog.at_level(logging.INFO, logger="tf_adacomp"):
    assert kmw.apply_keras_multi_worker_fix_for(strategy) == needed
    assert kmw.apply_keras_multi_worker_fix_for(strategy) == ()  # idempotent
  lines = [r.getMessage() for r in caplog.records if r.name == "tf_adacomp"]
  assert len(lines) == (1 if needed else 0), lines
  if needed:
    assert kmw.UPSTREAM_ISSUE in lines[0] and needed[0] in lines[0]
    assert kmw.keras_multi_worker_fix_applied()


@pytest.mark.slow
def test_plain_multi_worker_strategy_trains_with_model_fit(standard_run):
  """The standard constructor, 2 worker processes over gRPC, no call to tf_adacomp's fix."""
  results, out_dir, _ = standard_run
  assert all(r.returncode == 0 for r in results), describe(results)
  logs = [json.loads((out_dir / f"worker{i}.json").read_text()) for i in range(2)]
  weights = [np.load(out_dir / f"worker{i}.npz") for i in range(2)]
  needed = bool(kmw.keras_multi_worker_fix_needed())
  for log, result in zip(logs, results):
    # Not applied before the optimizer was created (the controls' patch was reverted).
    assert not log["fix_applied_before"]
    assert log["fix_applied_after"] == needed
    assert log["steps"] > 0 and np.isfinite(log["history"]["loss"]).all()
    assert result.stderr.count(kmw.UPSTREAM_ISSUE) == (1 if needed else 0)
  for name in weights[0].files:  # the workers stay bit-identical
    np.testing.assert_array_equal(weights[0][name], weights[1][name])
