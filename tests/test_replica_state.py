"""A resume on as many replicas is the run that was saved (tf_adacomp.replica_state).

Under the update exchange each replica keeps its own Adam moments (issue 43, defect 6):
a ``tf.train.Checkpoint`` or a ``.keras`` file keeps every replica's copy besides their
mean, and a load onto the same number of replicas gives each its own back, so that the
resumed run ends where the uninterrupted one does. For both optimizer wrappers; a load
onto another replica count, and a checkpoint or file written without the copies (before
this), give every replica the mean, as before.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from replica_harness import DEVICES, PER_REPLICA, data, linear_model
from tf_adacomp import optimizer as optimizer_lib
from tf_adacomp import replica_state

REPLICAS, STEPS, CUT = 2, 8, 3
BATCH = REPLICAS * PER_REPLICA
# The resumed run's float32 arithmetic is the uninterrupted run's: equal, but for the
# order a restore's host round trip cannot change (0.0 measured; 1.6e-2 with the mean).
ATOL = 1e-7


def _strategy(replicas=REPLICAS):
  return tf_adacomp.distribute.mirrored_strategy(devices=DEVICES[:replicas])


def _copies(variable):
  values = replica_state._distributed(variable)  # pylint: disable=protected-access
  return [c.numpy() for c in getattr(values, "values", [values])]


def _slots(optimizer):
  """Each per-replica variable's copies, in the order of ``optimizer.variables``."""
  return [_copies(v) for v in replica_state.per_replica(optimizer.variables)]


# --- The Keras 3 wrapper -----------------------------------------------------------------


def _keras3_model(strategy, second_moment):
  with strategy.scope():
    model = linear_model()
    model.compile(optimizer=tf_adacomp.CompressedOptimizer(
        keras.optimizers.Adam(0.01), "none", second_moment=second_moment), loss="mse")
  return model


def _keras3_resume(model, strategy, fmt, second_moment, directory):
  """``model`` saved in ``fmt`` and loaded onto ``strategy``."""
  if fmt == "keras":
    path = os.path.join(directory, "model.keras")
    model.save(path)
    with strategy.scope():
      return keras.models.load_model(path)
  path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
      os.path.join(directory, "ckpt"))
  loaded = _keras3_model(strategy, second_moment)
  if fmt == "checkpoint":  # built first; "deferred": built at its first step, restored then
    with strategy.scope():
      loaded.optimizer.build(loaded.trainable_variables)
  tf.train.Checkpoint(model=loaded, optimizer=loaded.optimizer).read(path).expect_partial()
  return loaded


def _check_resumed(loaded, saved, straight, fmt, x, y):
  """Each replica holds its own saved slots (``saved``, from ``_slots``; a deferred
  restore happens at the first step, so it is checked by the end only), and the rest of
  the run ends where the uninterrupted ``straight`` run ended."""
  if fmt != "deferred":
    for found, expected in zip(_slots(loaded.optimizer), saved):
      for copy, own in zip(found, expected):
        np.testing.assert_array_equal(copy, own)
  loaded.fit(x[CUT * BATCH:], y[CUT * BATCH:], batch_size=BATCH, shuffle=False, verbose=0)
  for found, expected in zip(loaded.get_weights(), straight.get_weights()):
    np.testing.assert_allclose(found, expected, rtol=0, atol=ATOL)


# The fast tier: the .keras file with the global moment (one of the six; a checkpoint's
# copies are test_a_checkpoint_keeps_copies_of_the_per_replica_state_only's and
# test_a_keras3_load_onto_another_replica_count_gives_every_replica_the_mean's); --full all.
@pytest.mark.parametrize("fmt, second_moment", [
    pytest.param("checkpoint", "local", marks=pytest.mark.slow), ("keras", "global"),
    pytest.param("checkpoint", "global", marks=pytest.mark.slow),
    pytest.param("deferred", "local", marks=pytest.mark.slow),
    pytest.param("deferred", "global", marks=pytest.mark.slow),
    pytest.param("keras", "local", marks=pytest.mark.slow)])
def test_a_keras3_resume_on_as_many_replicas_is_the_uninterrupted_run(fmt, second_moment,
                                                                      tmp_path):
  x, y = data(REPLICAS, STEPS)
  strategy = _strategy()
  straight = _keras3_model(strategy, second_moment)
  straight.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)

  model = _keras3_model(strategy, second_moment)
  model.fit(x[:CUT * BATCH], y[:CUT * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
  saved = _slots(model.optimizer)
  assert any(not np.array_equal(*copies) for copies in saved)  # the replicas' differ
  loaded = _keras3_resume(model, strategy, fmt, second_moment, str(tmp_path))
  _check_resumed(loaded, saved, straight, fmt, x, y)


@pytest.mark.parametrize("fmt", ["checkpoint", pytest.param("keras", marks=pytest.mark.slow)])
def test_a_keras3_load_onto_another_replica_count_gives_every_replica_the_mean(fmt, tmp_path):
  x, y = data(REPLICAS, STEPS)
  model = _keras3_model(_strategy(), "local")
  model.fit(x[:CUT * BATCH], y[:CUT * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
  means = [np.mean(copies, axis=0) for copies in _slots(model.optimizer)]
  loaded = _keras3_resume(model, _strategy(4), fmt, "local", str(tmp_path))
  found = _slots(loaded.optimizer)
  assert len(found) == len(means)
  for copies, mean in zip(found, means):
    assert len(copies) == 4
    for copy in copies:
      np.testing.assert_allclose(copy, mean, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fmt", [pytest.param("checkpoint", marks=pytest.mark.slow), "keras"])
def test_a_keras3_checkpoint_or_file_without_the_copies_loads_as_the_mean(
    fmt, tmp_path, monkeypatch):
  """As written before tf_adacomp.replica_state: no copies, each replica the mean."""
  x, y = data(REPLICAS, STEPS)
  strategy = _strategy()
  with monkeypatch.context() as patch:  # the earlier versions' save
    patch.setattr(replica_state, "attach", lambda variables: None)
    patch.setattr(optimizer_lib.CompressedOptimizer, "replica_state",
                  property(lambda self: replica_state.FileCopies([])))
    model = _keras3_model(strategy, "local")
    model.fit(x[:CUT * BATCH], y[:CUT * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    means = [np.mean(copies, axis=0) for copies in _slots(model.optimizer)]
    if fmt == "keras":
      path = os.path.join(str(tmp_path), "model.keras")
      model.save(path)
    else:
      path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
          os.path.join(str(tmp_path), "ckpt"))
  if fmt == "keras":
    with strategy.scope():
      loaded = keras.models.load_model(path)
  else:
    loaded = _keras3_model(strategy, "local")
    with strategy.scope():
      loaded.optimizer.build(loaded.trainable_variables)
    # Every saved value restores; the copies' objects find nothing to restore (so
    # assert_existing_objects_matched() would name them: expect_partial).
    tf.train.Checkpoint(model=loaded, optimizer=loaded.optimizer).read(path).expect_partial()
  for copies, mean in zip(_slots(loaded.optimizer), means):
    for copy in copies:
      np.testing.assert_allclose(copy, mean, rtol=1e-6, atol=1e-7)


def test_a_checkpoint_keeps_copies_of_the_per_replica_state_only(tmp_path):
  """The cost: Adam's two moments per weight get copies; the weights, the step
  counters, the learning rate are stored once."""
  x, y = data(REPLICAS, STEPS)
  model = _keras3_model(_strategy(), "local")
  model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, shuffle=False, verbose=0)
  path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
      os.path.join(str(tmp_path), "ckpt"))
  copied = {name: shape for name, shape in tf.train.list_variables(path)
            if f"/{replica_state.CHILD}/" in name}
  assert len(copied) == 4, copied  # kernel and bias, first and second moment
  assert sorted(copied.values()) == sorted([[REPLICAS, 3], [REPLICAS, 3],
                                            [REPLICAS, 5, 3], [REPLICAS, 5, 3]])


def test_a_savedmodel_of_a_model_that_holds_the_optimizer_still_saves_and_loads(tmp_path):
  """The copies are a checkpoint's and a file's, not a SavedModel's (whose export graph
  holds other variables): tf.saved_model.save and model.export work as before."""
  x, y = data(REPLICAS, STEPS)
  model = _keras3_model(_strategy(), "local")
  model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, shuffle=False, verbose=0)
  tf.saved_model.save(model, str(tmp_path / "saved_model"))
  tf.saved_model.load(str(tmp_path / "saved_model"))
  model.export(str(tmp_path / "exported"), verbose=False)
  exported = tf.saved_model.load(str(tmp_path / "exported"))  # held: serve needs its variables
  served = exported.serve(tf.constant(x[:2]))
  np.testing.assert_allclose(served, model.predict(x[:2], verbose=0), rtol=1e-6, atol=1e-6)


# --- The tf_keras wrapper ----------------------------------------------------------------


def _tf_keras():
  return pytest.importorskip("tf_keras")


def _tf_keras_model(strategy):
  tf_keras = _tf_keras()
  from tf_adacomp import tf_keras as adacomp_tf_keras  # pylint: disable=import-outside-toplevel
  with strategy.scope():
    tf_keras.utils.set_random_seed(1)
    model = tf_keras.Sequential([tf_keras.Input([5]), tf_keras.layers.Dense(3)])
    model.compile(optimizer=adacomp_tf_keras.CompressedOptimizer(
        tf_keras.optimizers.Adam(0.01), "none", exchange="updates"), loss="mse")
  return model


@pytest.mark.parametrize("fmt", [  # the fast tier: .keras; --full all
    pytest.param("checkpoint", marks=pytest.mark.slow),
    pytest.param("deferred", marks=pytest.mark.slow), "keras"])
def test_a_tf_keras_resume_on_as_many_replicas_is_the_uninterrupted_run(fmt, tmp_path):
  tf_keras = _tf_keras()
  from tf_adacomp import tf_keras as adacomp_tf_keras  # pylint: disable=import-outside-toplevel
  x, y = data(REPLICAS, STEPS)
  strategy = _strategy()
  straight = _tf_keras_model(strategy)
  straight.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)

  model = _tf_keras_model(strategy)
  model.fit(x[:CUT * BATCH], y[:CUT * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
  saved = _slots(model.optimizer)
  assert any(not np.array_equal(*copies) for copies in saved)
  if fmt == "keras":
    path = os.path.join(str(tmp_path), "model.keras")
    model.save(path)
    with strategy.scope():
      loaded = tf_keras.models.load_model(
          path, custom_objects={"CompressedOptimizer": adacomp_tf_keras.CompressedOptimizer})
  else:
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        os.path.join(str(tmp_path), "ckpt"))
    loaded = _tf_keras_model(strategy)
    if fmt == "checkpoint":
      with strategy.scope():
        loaded.optimizer.build(loaded.trainable_variables)
    tf.train.Checkpoint(model=loaded, optimizer=loaded.optimizer).read(path).expect_partial()
  _check_resumed(loaded, saved, straight, fmt, x, y)


# Slow: the replica_state path of test_a_keras3_load_onto_another_replica_count_gives_every_
# replica_the_mean[checkpoint] (the fast tier); the tf_keras wrapper's restore onto another
# replica count trains on in tests/conformance/test_oracle_tf_keras.py's
# test_trains_as_plain_tf_keras[gradients,sgd,replicas=2,event=checkpoint_other].
@pytest.mark.slow
def test_a_tf_keras_load_onto_another_replica_count_gives_every_replica_the_mean(tmp_path):
  tf_keras = _tf_keras()
  from tf_adacomp import tf_keras as adacomp_tf_keras  # pylint: disable=import-outside-toplevel
  x, y = data(REPLICAS, STEPS)
  model = _tf_keras_model(_strategy())
  model.fit(x[:CUT * BATCH], y[:CUT * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
  means = [np.mean(copies, axis=0) for copies in _slots(model.optimizer)]
  path = os.path.join(str(tmp_path), "model.keras")
  model.save(path)
  with _strategy(4).scope():
    loaded = tf_keras.models.load_model(
        path, custom_objects={"CompressedOptimizer": adacomp_tf_keras.CompressedOptimizer})
  found = _slots(loaded.optimizer)
  assert len(found) == len(means)
  for copies, mean in zip(found, means):
    assert len(copies) == 4
    for copy in copies:
      np.testing.assert_allclose(copy, mean, rtol=1e-6, atol=1e-7)


# --- Across workers ------------------------------------------------------------------------


def multi_worker_resume():
  """Worker (``run_workers`` target): under ``MultiWorkerMirroredStrategy`` (one CPU a
  worker), Adam with ``second_moment="local"`` straight through, and saved to a
  ``tf.train.Checkpoint`` after ``CUT`` steps, restored into a new model and continued;
  writes both final weights and the moments' copies before and after the restore to
  ``worker{i}.npz``."""
  import multi_worker  # pylint: disable=import-outside-toplevel

  strategy = tf_adacomp.distribute.multi_worker_strategy()
  index = multi_worker.worker_index()
  out = multi_worker.worker_out_dir()
  workers = strategy.num_replicas_in_sync
  x, y = data(workers, STEPS)
  batch = workers * PER_REPLICA

  def dataset(first, last):
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA)
    return tf.data.Dataset.from_tensor_slices(
        (x[first * batch:last * batch], y[first * batch:last * batch])).batch(
            batch).with_options(options)

  straight = _keras3_model(strategy, "local")
  straight.fit(dataset(0, STEPS), verbose=0)
  model = _keras3_model(strategy, "local")
  model.fit(dataset(0, CUT), verbose=0)
  saved = _slots(model.optimizer)
  path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
      os.path.join(out, f"worker{index}", "ckpt"))
  loaded = _keras3_model(strategy, "local")
  with strategy.scope():
    loaded.optimizer.build(loaded.trainable_variables)
  tf.train.Checkpoint(model=loaded, optimizer=loaded.optimizer).read(path).expect_partial()
  restored = _slots(loaded.optimizer)
  loaded.fit(dataset(CUT, STEPS), verbose=0)
  arrays = {f"straight_{i}": w for i, w in enumerate(straight.get_weights())}
  arrays.update({f"resumed_{i}": w for i, w in enumerate(loaded.get_weights())})
  arrays.update({f"saved_{i}": np.stack(c) for i, c in enumerate(saved)})
  arrays.update({f"restored_{i}": np.stack(c) for i, c in enumerate(restored)})
  np.savez(os.path.join(out, f"worker{index}.npz"), **arrays)


@pytest.mark.slow
def test_a_multi_worker_resume_gives_each_worker_its_own_moments(tmp_path):
  from multi_worker import describe, run_workers  # pylint: disable=import-outside-toplevel
  results = run_workers(multi_worker_resume, num_workers=2, timeout=300, out_dir=tmp_path)
  assert all(r.returncode == 0 for r in results), describe(results)
  found = [dict(np.load(tmp_path / f"worker{i}.npz")) for i in range(2)]
  for arrays in found:
    saved = sorted(k for k in arrays if k.startswith("saved_"))
    assert len(saved) == 4, sorted(arrays)
    for key in saved:  # this worker's own copy, not the mean
      np.testing.assert_array_equal(arrays[key.replace("saved", "restored")], arrays[key])
    straight = sorted(k for k in arrays if k.startswith("straight_"))
    assert straight
    for key in straight:
      np.testing.assert_allclose(arrays[key.replace("straight", "resumed")], arrays[key],
                                 rtol=0, atol=ATOL)
  # The workers' moments differ (else the test would show nothing).
  assert not np.array_equal(found[0]["saved_0"], found[1]["saved_0"])
