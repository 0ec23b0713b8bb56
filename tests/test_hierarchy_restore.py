"""A model trained with ``devices_per_worker`` restored onto another number of devices.

``devices_per_worker`` describes the machine a job ran on, not the model: a ``.keras``
file saved from 4 replicas in 2 workers of 2 devices must load (and train on) 1 device
without a strategy and 3 replicas, where 2 devices per worker does not fit. It used to
fail in ``load_model`` with "`devices_per_worker` must divide the strategy's 1
replicas". The worker's residue lives on its first device; the file holds the sum over
the replicas, which a restore splits evenly: the total must be what was saved.
"""

import json
import logging
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from replica_harness import DEVICES, PER_REPLICA, data, linear_model

STEPS = 3


def _strategy(replicas):
  return tf_adacomp.distribute.mirrored_strategy(devices=DEVICES[:replicas])


def _compressor(name):
  # AdaComp on the 5x3 kernel too (min_size=1): residues that are not zero.
  return tf_adacomp.AdaComp(min_size=1) if name == "adacomp" else name


def _residue_totals(optimizer):
  """Per residue variable: the sum of its replicas' copies."""
  totals = []
  for state in optimizer.residues:
    for variable in state:
      value = variable.value
      copies = value.values if hasattr(value, "values") else [value]
      totals.append(np.sum([c.numpy() for c in copies], axis=0))
  return totals


def _fit(model, replicas, steps=STEPS):
  x, y = data(replicas, steps)
  model.fit(x, y, batch_size=replicas * PER_REPLICA, epochs=1, shuffle=False, verbose=0)


@pytest.fixture(scope="module", params=[  # AdaComp's kernels on 4 devices: --full
    pytest.param("adacomp", marks=pytest.mark.slow), "none"])
def saved(request, tmp_path_factory):
  """``(path, weights, residue totals)`` of a model trained on 2 workers x 2 devices."""
  strategy = _strategy(4)
  with strategy.scope():
    model = linear_model()
    model.compile(optimizer=tf_adacomp.CompressedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), _compressor(request.param),
        devices_per_worker=2), loss="mse")
  _fit(model, 4)
  assert model.optimizer.hierarchy.workers == 2
  totals = _residue_totals(model.optimizer)
  if request.param == "adacomp":
    assert any(np.abs(t).sum() > 0 for t in totals)
  path = str(tmp_path_factory.mktemp("saved") / f"{request.param}.keras")
  model.save(path)
  return path, model.get_weights(), totals


# Slow (both; 1: alone): a 4-replica fit, saved and loaded. The fallback itself is
# tests/test_hierarchy.py's test_a_saved_devices_per_worker_that_does_not_fit_falls_back_
# with_a_warning in the fast tier, a saved layout read back from a config
# test_a_restored_layout_that_fits_is_kept's below (and the tf_keras wrapper's on load,
# tests/test_tf_keras_saving.py's test_a_saved_devices_per_worker_that_does_not_fit_falls_
# back_on_load).
@pytest.mark.parametrize("replicas", [pytest.param(1, marks=pytest.mark.slow),
                                      pytest.param(3, marks=pytest.mark.slow)])
def test_a_model_saved_with_devices_per_worker_loads_and_trains_on_other_devices(
    saved, replicas, caplog, tmp_path):
  path, weights, totals = saved
  with caplog.at_level(logging.WARNING, logger="tf_adacomp"):
    if replicas == 1:
      model = keras.models.load_model(path)
    else:
      with _strategy(replicas).scope():
        model = keras.models.load_model(path)
  for a, b in zip(weights, model.get_weights()):
    np.testing.assert_array_equal(a, b)
  optimizer = model.optimizer
  assert optimizer.hierarchy is None  # 2 devices per worker do not fit: the flat exchange
  assert int(optimizer.iterations.numpy()) == STEPS
  for before, after in zip(totals, _residue_totals(optimizer)):
    # Split evenly over the replicas and summed back (by 3: within rounding).
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-7)
  lines = [r.getMessage() for r in caplog.records if "devices_per_worker" in r.getMessage()]
  assert len(lines) == 1, lines
  assert "devices_per_worker=2" in lines[0] and f"{replicas} replica" in lines[0], lines
  assert "the flat exchange" in lines[0], lines
  _fit(model, replicas, steps=2)  # training goes on
  assert int(optimizer.iterations.numpy()) == STEPS + 2
  assert all(np.isfinite(w).all() for w in model.get_weights())
  # Saved again, it keeps the layout it was given (used again wherever it fits).
  again = str(tmp_path / "again.keras")
  model.save(again)
  with zipfile.ZipFile(again) as archive:
    config = json.loads(archive.read("config.json"))
  assert config["compile_config"]["optimizer"]["config"]["devices_per_worker"] == 2


def test_a_restored_layout_that_fits_is_kept():
  # From a config (as load_model): 2 devices per worker fit 4 replicas, and are used.
  config = tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1), "none",
                                          devices_per_worker=2).get_config()
  with _strategy(4).scope():
    optimizer = tf_adacomp.CompressedOptimizer.from_config(config)
    optimizer.build([keras.Variable(np.zeros([3], np.float32))])
  assert (optimizer.hierarchy.workers, optimizer.hierarchy.devices_per_worker) == (2, 2)


def test_a_layout_given_by_the_user_that_does_not_fit_is_still_refused():
  # The user's own argument (or one given again through custom_objects) is checked.
  with _strategy(3).scope():
    optimizer = tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1), "none",
                                               devices_per_worker=2)
    with pytest.raises(ValueError, match=r"divide the strategy's 3 replicas"):
      optimizer.build([keras.Variable(np.zeros([3], np.float32))])
