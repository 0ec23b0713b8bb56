"""model.save and tf_keras.models.load_model of a model trained with
tf_adacomp.tf_keras.CompressedOptimizer: ``.keras`` and ``.h5`` files (and
``save_weights``/``load_weights``) keep the residues (their replicas' sum), the inner
optimizer's step counter and slots, with or without a strategy on either side; a
SavedModel, whose tf_keras loader would drop them, is refused. ``tf.train.Checkpoint``
restores onto other replica counts in tests/test_tf_keras.py; here, only its save after a
restore into a new optimizer."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import digits_data
import tf_adacomp
from tf_adacomp import tf_keras as adacomp_tf_keras

INNER = {"adam": lambda: tf_keras.optimizers.Adam(0.01),
         "sgd": lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9)}
SUFFIX = {"keras": ".keras", "h5": ".h5"}
BATCH = 64


def _strategy(replicas):
  """None: no strategy (tf_keras' default); n: a MirroredStrategy over n logical CPUs."""
  if replicas is None:
    return tf.distribute.get_strategy()
  return tf_adacomp.distribute.mirrored_strategy(devices=[f"/cpu:{i}" for i in range(replicas)])


def _mlp(strategy, inner="adam", compressor="adacomp", **kwargs):
  with strategy.scope():
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.layers.Dense(16, activation="relu",
                                                       input_shape=(64,)),
                                 tf_keras.layers.Dense(10)])
    model.compile(adacomp_tf_keras.CompressedOptimizer(INNER[inner](), compressor=compressor,
                                                       **kwargs),
                  tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _fit(model, first_step, steps):
  (x, y), _ = digits_data.flat()
  batches = slice(first_step * BATCH, (first_step + steps) * BATCH)
  model.fit(x[batches], y[batches], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def _load(path, replicas):
  with _strategy(replicas).scope():
    return tf_keras.models.load_model(path)


def _state(optimizer):
  """Each variable's name and cross-replica value (a residue's replicas' sum, a slot's
  mean), in the order of ``optimizer.variables``; the names are unique."""
  names = [v.name for v in optimizer.variables]
  assert len(set(names)) == len(names), names
  return dict(zip(names, (v.numpy() for v in optimizer.variables)))


def _shares(variable):
  return [v.numpy() for v in getattr(variable, "values", [variable])]


# The fast tier: none of the eight (a 2-replica .keras resume is tests/test_replica_state.py's,
# a file's weights reaching every replica below); --full all.
FAST_SAVES = set()


@pytest.mark.parametrize("fmt, saved_on, inner", [
    pytest.param(fmt, saved_on, inner,
                 id=f"{fmt}-{'saved-on-2' if saved_on else 'saved-alone'}-{inner}",
                 marks=() if (fmt, saved_on, inner) in FAST_SAVES else pytest.mark.slow)
    for fmt in ("keras", "h5") for saved_on in (None, 2) for inner in ("adam", "sgd")])
def test_a_saved_file_restores_the_optimizer_state_with_and_without_a_strategy(
    fmt, saved_on, inner, tmp_path):
  model = _mlp(_strategy(saved_on), inner)
  _fit(model, 0, 4)
  saved = _state(model.optimizer)
  residues = [r for state in model.optimizer.residues for r in state]
  assert any(np.any(r.numpy()) for r in residues)  # adacomp has held some back
  own = {r.name: _shares(r) for r in residues}
  path = str(tmp_path / f"model{SUFFIX[fmt]}")
  model.save(path)

  for loaded_on in (None, 2):
    loaded = _load(path, loaded_on)
    optimizer = loaded.optimizer
    assert isinstance(optimizer, adacomp_tf_keras.CompressedOptimizer)
    for expected, found in zip(model.get_weights(), loaded.get_weights()):
      np.testing.assert_array_equal(found, expected)
    assert int(optimizer.iterations.numpy()) == 4
    found = _state(optimizer)
    assert list(found) == list(saved)
    for name, value in saved.items():  # slots: the mean; residues: the sum
      np.testing.assert_allclose(found[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
    replicas = loaded_on or 1
    for residue in (r for state in optimizer.residues for r in state):
      if loaded_on == saved_on:
        # As many replicas (2): each gets its own residue back (tf_adacomp.replica_state;
        # an .h5 file keeps the copies as entries of their own, tf_keras_saving.h5_copies).
        for share, expected in zip(_shares(residue), own[residue.name]):
          np.testing.assert_array_equal(share, expected, err_msg=residue.name)
        continue
      for share in _shares(residue):  # the sum split evenly over the replicas present
        np.testing.assert_allclose(share, saved[residue.name] / replicas, rtol=1e-6,
                                   atol=1e-7, err_msg=residue.name)
    _fit(loaded, 4, 1)  # and training goes on from there
    assert int(optimizer.iterations.numpy()) == 5


RUNS = {
    # One replica: the residues AdaComp held back come back exactly too.
    "1-replica-adam-adacomp": (1, "adam", 0, 0.0),
    # Two: dense warm-up throughout (residues kept, all zero), as compressor "none".
    # An .h5 file keeps each replica's own slots as their mean: SGD's momentum is linear
    # in the slot, so the replicas' mean update is the same (Adam's is not).
    "2-replicas-sgd-dense": (2, "sgd", 100, 1e-6)}
# The fast tier: none of the six (a .keras resume on two replicas is tests/
# test_replica_state.py's test_a_tf_keras_resume_on_as_many_replicas_is_the_uninterrupted_run,
# the .weights.h5 format is test_weights_loaded_before_build_reach_every_replica_when_it_builds
# _in_a_replica's); --full all.
FAST_RUNS = set()


# "weights": save_weights to a .weights.h5 file, load_weights into a new model, whose
# optimizer is built (and given the state) at its first step.
@pytest.mark.parametrize("fmt, replicas, inner, start_step, atol", [
    pytest.param(fmt, *run, id=f"{fmt}-{name}",
                 marks=() if (fmt, name) in FAST_RUNS else pytest.mark.slow)
    for name, run in RUNS.items() for fmt in ("keras", "h5", "weights")])
def test_a_run_saved_and_loaded_midway_ends_where_the_uninterrupted_run_ends(
    fmt, replicas, inner, start_step, atol, tmp_path):
  model = _mlp(_strategy(replicas), inner, start_step=start_step)
  _fit(model, 0, 3)
  if fmt == "weights":
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    loaded = _mlp(_strategy(replicas), inner, start_step=start_step)
    loaded.load_weights(path)
  else:
    path = str(tmp_path / f"model{SUFFIX[fmt]}")
    model.save(path)
    loaded = _load(path, replicas)
  _fit(model, 3, 3)
  _fit(loaded, 3, 3)
  assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) == 6
  for expected, found in zip(model.get_weights(), loaded.get_weights()):
    np.testing.assert_allclose(found, expected, rtol=0, atol=atol)


@pytest.mark.parametrize("saved_on", [
    pytest.param(None, marks=pytest.mark.slow), 2], ids=["alone", "on-2"])
def test_a_saved_model_is_refused_naming_what_its_loader_would_drop(saved_on, tmp_path):
  model = _mlp(_strategy(saved_on))
  _fit(model, 0, 1)
  with pytest.raises(ValueError, match=r"SavedModel.*iterations.*residues.*\.keras"):
    model.save(str(tmp_path / "saved_model"))
  # Without the optimizer, the model alone is saved (for inference) and loads.
  model.save(str(tmp_path / "alone"), include_optimizer=False)
  loaded = tf_keras.models.load_model(str(tmp_path / "alone"))
  for expected, found in zip(model.get_weights(), loaded.get_weights()):
    np.testing.assert_array_equal(found, expected)


# Slow: the .h5 format is test_a_saved_file_restores_the_optimizer_state_with_and_without_a
# _strategy's in the fast tier; this one is the same path for a second state per variable.
@pytest.mark.slow
def test_an_h5_file_keeps_both_states_of_the_fft_compressor(tmp_path):
  # Two states per variable (residue, step counter): the file keys them by name.
  model = _mlp(_strategy(None), "sgd", compressor="fft")
  _fit(model, 0, 2)
  path = str(tmp_path / "model.h5")
  model.save(path)
  saved = _state(model.optimizer)
  found = _state(_load(path, None).optimizer)
  assert list(found) == list(saved)
  for name, value in saved.items():
    np.testing.assert_array_equal(found[name], value, err_msg=name)


def test_a_checkpoint_restored_before_the_first_step_saves_the_residues_again(tmp_path):
  # BackupAndRestore's round: restore into a new optimizer, train, save again.
  model = _mlp(_strategy(None))
  _fit(model, 0, 2)
  first = tf.train.Checkpoint(model=model).save(str(tmp_path / "first" / "ckpt"))
  again = _mlp(_strategy(None))
  tf.train.Checkpoint(model=again).restore(first)
  _fit(again, 2, 1)
  second = tf.train.Checkpoint(model=again).save(str(tmp_path / "second" / "ckpt"))
  names = {name for name, _ in tf.train.list_variables(second)}
  assert {f"model/optimizer/residues/{i}/0/.ATTRIBUTES/VARIABLE_VALUE"
          for i in range(len(again.optimizer.residues))} <= names
  assert "model/optimizer/bytes_sent/.ATTRIBUTES/VARIABLE_VALUE" in names
  restored = _mlp(_strategy(None))
  tf.train.Checkpoint(model=restored).restore(second)
  restored.optimizer.build(restored.trainable_variables)
  for expected, found in zip(_state(again.optimizer).values(),
                             _state(restored.optimizer).values()):
    np.testing.assert_array_equal(found, expected)


def test_a_file_of_another_optimizer_is_refused_not_dropped():
  variables = [tf.Variable(tf.ones([4, 3])), tf.Variable(tf.ones([3]))]
  optimizer = adacomp_tf_keras.CompressedOptimizer(INNER["sgd"](), compressor="topk")
  optimizer.build(variables)
  count = len(optimizer.variables)
  with pytest.raises(ValueError, match=rf"has {count} variables .* has 1\b"):
    optimizer.load_own_variables({"0": np.array(7, np.int64)})  # a step counter, 7
  with pytest.raises(ValueError, match=rf"has {count} variables .* has 1\b"):
    optimizer.set_weights([np.array(7, np.int64)])
  # Values beyond the variables that are not an .h5 file's copies of the per-replica
  # state (one per residue and slot, with a leading replica axis) are refused too.
  extra = [np.ones([2, *v.shape], v.dtype.as_numpy_dtype) for v in optimizer.variables]
  with pytest.raises(ValueError, match=rf"has {count} variables .* has {2 * count}\b"):
    optimizer.set_weights([v.numpy() for v in optimizer.variables] + extra)
  # An optimizer saved before its first step holds nothing to lose: this one stays.
  optimizer.load_own_variables({"0": np.array(0, np.int64)})
  assert int(optimizer.iterations.numpy()) == 0


def test_weights_loaded_before_build_reach_every_replica_when_it_builds_in_a_replica(tmp_path):
  model = _mlp(_strategy(2))
  _fit(model, 0, 3)
  saved = list(_state(model.optimizer).values())
  path = str(tmp_path / "model.weights.h5")
  model.save_weights(path)
  strategy = _strategy(2)
  loaded = _mlp(strategy)
  loaded.load_weights(path)  # its optimizer has no residues yet: kept until it builds
  optimizer = loaded.optimizer

  def build():  # as at its first step in fit: in a replica context
    optimizer.build(loaded.trainable_variables)

  @tf.function
  def first_step():
    strategy.run(build)

  first_step()
  assert int(optimizer.iterations.numpy()) == 3
  found = list(_state(optimizer).values())
  assert len(found) == len(saved)
  for expected, value in zip(saved, found):
    np.testing.assert_allclose(value, expected, rtol=1e-6, atol=1e-7)
  residues = [r for state in optimizer.residues for r in state]
  for residue, total in zip(residues, saved):  # the residues come first
    for share in _shares(residue):
      np.testing.assert_allclose(share, total / 2, rtol=1e-6, atol=1e-7)


def test_a_saved_devices_per_worker_that_does_not_fit_falls_back_on_load():
  # The layout of the machine it was saved on (tf_adacomp.hierarchy): on one device it
  # is the flat exchange, not a ValueError at build.
  saved = adacomp_tf_keras.CompressedOptimizer(tf_keras.optimizers.SGD(0.1), "none",
                                               devices_per_worker=2)
  restored = adacomp_tf_keras.CompressedOptimizer.from_config(saved.get_config())
  restored.build([tf.Variable(np.zeros(3, np.float32))])
  assert restored.hierarchy is None and restored.devices_per_worker == 2
