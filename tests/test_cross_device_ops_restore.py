"""CompressedAllReduce's residues restored by a strategy over another number of devices.

A checkpoint written over 4 devices and restored over 2 (or the reverse) keeps each
residue's total over devices, the gradient not yet sent: every device gets the saved sum
/ devices of a floating state and the first device's value of an integer one (the FFT
compressor's step counter), as ``CompressedOptimizer``'s on-read residues do. Device
counts are powers of two, so the split and the float64 sums below are exact. The tests
that train the digits MLP with ``model.fit`` (XLA compiles the kernels once per device)
run in the slow tier; the split itself is checked on bare variables in the fast one.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp import cross_device_ops
import digits_data

BATCH = 64


def _fit(devices, compressor, steps, start=0, model=None, nan=False):
  """``model.fit`` of the digits MLP over ``devices`` CPUs (a new model and strategy
  unless ``model`` is given); ``nan`` weighs the samples by NaN, whose non-finite
  gradients (every one: NaN inputs would leave the last kernel's finite, through the
  ReLU) leave every residue as it is. ``(ops, model)``."""
  if model is None:
    ops = tf_adacomp.CompressedAllReduce(compressor)
    strategy = tf_adacomp.distribute.mirrored_strategy(
        devices=[f"/cpu:{d}" for d in range(devices)], cross_device_ops=ops)
    with strategy.scope():
      model = digits_data.mlp(0)
  (x, y), _ = digits_data.flat()
  x, y = x[BATCH * start:BATCH * (start + steps)], y[BATCH * start:BATCH * (start + steps)]
  weights = np.full(len(x), np.nan if nan else 1.0, np.float32)
  if steps:
    model.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=1, verbose=0,
              shuffle=False)
  return tf_adacomp.CompressedAllReduce.of(model.distribute_strategy), model


def _checkpoint(ops, model):
  return tf.train.Checkpoint(model=model, optimizer=model.optimizer, residues=ops)


def _held(ops):
  """``{key: [per device: [state values]]}`` of the tensors that hold states."""
  return {key: [[v.numpy() for v in states] for states in per_device]
          for key, per_device in ops.residues.items() if all(per_device)}


def _totals(held):
  """Each state's total over devices: the float32 sum in device order of a floating
  state (as the restore sums), the first device's value of an integer one."""
  totals = {}
  for key, per_device in held.items():
    totals[key] = []
    for s, first in enumerate(per_device[0]):
      total = first
      if first.dtype.kind == "f":
        for states in per_device[1:]:
          total = total + states[s]
      totals[key].append(total)
  return totals


def _assert_each_device_holds_its_share(ops, totals):
  held = _held(ops)
  assert held.keys() == totals.keys()
  devices = len(next(iter(held.values())))
  for key, per_device in held.items():
    for s, total in enumerate(totals[key]):
      values = [states[s] for states in per_device]
      if total.dtype.kind == "f":
        assert np.abs(total).sum() > 0  # zeros would come back from no checkpoint at all
        for value in values:
          np.testing.assert_array_equal(value, total / np.float32(devices), err_msg=key)
        # The error-feedback mass is kept: exact, as the shares are total / 2**k.
        np.testing.assert_array_equal(sum(v.astype(np.float64) for v in values),
                                      total.astype(np.float64), err_msg=key)
      else:
        for value in values:
          np.testing.assert_array_equal(value, total, err_msg=key)


def _assert_training_goes_on(ops, model):
  before = _held(ops)
  _fit(None, None, steps=1, start=10, model=model)
  assert all(np.isfinite(w).all() for w in model.get_weights())
  after = _held(ops)
  assert any(not np.array_equal(a[0][0], b[0][0]) for a, b in
             zip(before.values(), after.values()))  # the residues take part in the step


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory):
  """A checkpoint of 3 AdaComp steps over 4 devices: ``(path, totals, held)``."""
  ops, model = _fit(4, tf_adacomp.AdaComp(min_size=100), steps=3)
  held = _held(ops)
  assert len(held) == 2  # the two kernels (the biases go dense, holding nothing)
  path = _checkpoint(ops, model).save(str(tmp_path_factory.mktemp("four") / "ckpt"))
  return path, _totals(held), held


@pytest.mark.slow
def test_four_devices_to_two_keep_each_residues_total(four_devices):
  path, totals, _ = four_devices
  ops, model = _fit(2, tf_adacomp.AdaComp(min_size=100), steps=1)
  status = _checkpoint(ops, model).restore(path)
  _assert_each_device_holds_its_share(ops, totals)
  status.assert_consumed()  # nothing left unread in the checkpoint, nothing unrestored
  _assert_training_goes_on(ops, model)


@pytest.mark.slow
def test_a_restore_before_the_first_step_applies_when_the_residues_are_made(four_devices):
  path, totals, _ = four_devices
  ops, model = _fit(2, tf_adacomp.AdaComp(min_size=100), steps=0)
  assert not ops.residues  # nothing made yet: the checkpoint defers their restore
  status = _checkpoint(ops, model).restore(path)
  # The first step makes the residues (restored then) and, its gradients being NaN,
  # leaves them as restored.
  _fit(None, None, steps=1, model=model, nan=True)
  _assert_each_device_holds_its_share(ops, totals)
  status.assert_consumed()


@pytest.mark.parametrize("saved, restored", [(2, 4), (4, 2)])
def test_states_split_floats_and_give_integers_to_every_device(tmp_path, saved, restored):
  # The FFT compressor's states are (residue, step counter): a float and an int64, here
  # without a model (its XLA programs would take most of a minute to compile).
  rng = np.random.default_rng(saved)
  values = [(rng.standard_normal(5).astype(np.float32), np.int64(3 + d)) for d in range(saved)]

  def states(devices, initial=None):
    per_device = []
    for d in range(devices):
      with tf.device(f"/cpu:{d}"):
        residue, step = initial[d] if initial else (np.zeros(5, np.float32), np.int64(0))
        per_device.append([tf.Variable(residue), tf.Variable(step)])
    module = tf.Module()
    module.states = cross_device_ops._DeviceStates(per_device)  # pylint: disable=protected-access
    return module

  path = tf.train.Checkpoint(ops=states(saved, values)).save(str(tmp_path / "ckpt"))
  module = states(restored)
  tf.train.Checkpoint(ops=module).restore(path).assert_consumed()
  total = values[0][0]
  for residue, _ in values[1:]:
    total = total + residue
  for d, (residue, step) in enumerate(module.states):
    assert residue.device.endswith(f"CPU:{d}")
    np.testing.assert_array_equal(residue.numpy(), total / np.float32(restored))
    assert step.numpy() == 3  # the first saved device's counter


def _legacy_checkpoint(held, directory):
  """A checkpoint of the earlier layout (tf_adacomp before the stacked states): one
  variable per device and state, ``residues/residues/{key}/{device}/{state}``."""
  legacy = tf.Module()
  legacy.residues = {key: [[tf.Variable(v) for v in states] for states in per_device]
                     for key, per_device in held.items()}
  return tf.train.Checkpoint(residues=legacy).save(str(directory / "legacy"))


@pytest.mark.slow
def test_checkpoints_of_the_per_device_layout_load_with_as_many_devices_and_refuse_fewer(
    four_devices, tmp_path):
  _, _, held = four_devices
  path = _legacy_checkpoint(held, tmp_path)
  ops, _ = _fit(4, tf_adacomp.AdaComp(min_size=100), steps=1)
  # (Not assert_consumed: this checkpoint holds no nbytes counters.)
  tf.train.Checkpoint(residues=ops).restore(path)
  for key, per_device in held.items():
    for states, values in zip(ops.residues[key], per_device):
      np.testing.assert_array_equal(states[0].numpy(), values[0])
  ops, _ = _fit(2, tf_adacomp.AdaComp(min_size=100), steps=1)
  with pytest.raises(ValueError, match="more devices than this strategy's 2"):
    tf.train.Checkpoint(residues=ops).restore(path)
