"""CompressedOptimizer checkpoints restored with another number of replicas.

A checkpoint stores, per variable, the total of the replicas' residues (the gradient mass
not yet sent); restoring it with any number of replicas, or without a strategy, must keep
that total and keep the FFT compressor's step counter (its theta schedule) where it was.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import digits_data
import tf_adacomp

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _strategy(replicas):
  if replicas == 0:
    return None
  return tf_adacomp.distribute.mirrored_strategy(devices=[f"/cpu:{i}" for i in range(replicas)])


def _model(strategy, compressor):
  scope = strategy.scope() if strategy else tf.name_scope("no_strategy")
  with scope:
    optimizer = tf_adacomp.CompressedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), compressor, exchange="gradients")
    model = digits_data.mlp(0, optimizer)
    model.optimizer.build(model.trainable_variables)
  return model


def _fit(model, steps, offset=0):
  (x, y), _ = digits_data.flat()
  start = offset * 64
  model.fit(x[start:start + 64 * steps], y[start:start + 64 * steps], batch_size=64,
            epochs=1, verbose=0, shuffle=False)


def _copies(variable):
  value = variable.value
  return [c.numpy() for c in value.values] if hasattr(value, "values") else [value.numpy()]


def _states(model):
  """Per state variable: the list of its replicas' values."""
  return [_copies(v) for state in model.optimizer.residues for v in state]


def _totals(model):
  """Per residue (floating state): the sum over replicas; per counter: each replica's."""
  return [np.sum(copies, axis=0) if copies[0].dtype.kind == "f" else np.array(copies)
          for copies in _states(model)]


def _compressor(name):
  # Biases go dense (fewer compilations); the FFT compressor with a theta schedule,
  # whose position a counter that moved on restore would shift. FFT programs are not
  # fused and cost the most to compile: it compresses the 64x64 kernel only (one
  # residue and one counter; the 64x10 kernel goes dense).
  if name == "fft":
    return tf_adacomp.get_compressor("fft", theta=0.9, final_theta=0.5, theta_decay_steps=100,
                                     min_size=1000)
  return tf_adacomp.AdaComp(min_size=100)


# Replicas saved with and restored with (0: no strategy). Each case compiles its
# kernels for two strategies, so the FFT counter is checked where summing would move it
# (from more replicas to fewer). The fast tier splits (none to 2) and sums (2 to none)
# on devices 0 and 1; the 4-replica cases (XLA compiles per device) run with --full.
@pytest.mark.parametrize("compressor, saved_with, restored_with", [
    # Fast tier: one restore onto another number of replicas (FFT: its step counter
    # too); AdaComp's with --full (the cross-device ops' split is fast-tested on bare
    # variables in tests/test_cross_device_ops_restore.py).
    pytest.param("adacomp", 0, 2, marks=pytest.mark.slow),
    # Slow too: the fast tier restores onto as many replicas (tests/test_replica_state.py).
    pytest.param("fft", 2, 0, marks=pytest.mark.slow),
    pytest.param("adacomp", 4, 2, marks=pytest.mark.slow),
    pytest.param("fft", 4, 2, marks=pytest.mark.slow)])
def test_a_restore_with_other_replicas_keeps_the_residue_total_and_the_step(
    tmp_path, compressor, saved_with, restored_with):
  saved = _model(_strategy(saved_with), _compressor(compressor))
  _fit(saved, steps=3)
  totals = _totals(saved)
  assert any(t.dtype.kind == "f" and np.abs(t).sum() > 0 for t in totals)
  weights = saved.get_weights()
  path = str(tmp_path / "ckpt.weights.h5")
  saved.save_weights(path)  # what keras.callbacks.BackupAndRestore writes

  restored = _model(_strategy(restored_with), _compressor(compressor))
  restored.load_weights(path)
  for a, b in zip(weights, restored.get_weights()):
    np.testing.assert_array_equal(a, b)
  assert int(restored.optimizer.iterations.numpy()) == 3
  for before, after, copies in zip(totals, _totals(restored), _states(restored)):
    if before.dtype.kind == "f":
      # Split evenly over the replicas (a power of two: exact), summed back.
      np.testing.assert_array_equal(before, after)
    else:  # the FFT step counter: 3 on every replica, whatever the replicas before
      assert before.tolist() == [3] * len(before)
      assert [int(c) for c in copies] == [3] * len(copies)
  _fit(restored, steps=2, offset=3)  # training goes on
  assert int(restored.optimizer.iterations.numpy()) == 5
  assert all(np.isfinite(w).all() for w in restored.get_weights())
  if compressor == "fft":
    assert all(int(c) == 5 for copies in _states(restored) for c in copies
               if np.asarray(c).dtype.kind == "i")
