"""tf_adacomp.BackupAndRestore in one process: resuming, atomic saves, bad arguments.

The multi-worker behaviour (a worker killed, the job resumed) is exercised with real
processes in tests/benchmarks/test_faults.py and benchmarks/faults.py.
"""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import digits_data
import tf_adacomp
from tf_adacomp import backup as backup_module


def _model():
  optimizer = tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                             tf_adacomp.AdaComp(min_size=100))
  return digits_data.mlp(0, optimizer)


class _Stop(Exception):
  pass


class _StopAt(keras.callbacks.Callback):
  """Raises at a given optimizer step, as a killed process would stop there."""

  def __init__(self, step):
    super().__init__()
    self.step = step

  def on_train_batch_end(self, batch, logs=None):
    if int(self.model.optimizer.iterations.numpy()) == self.step:
      raise _Stop()


def _fit(model, callbacks, epochs=3):
  (x, y), _ = digits_data.flat()
  model.fit(x[:640], y[:640], batch_size=64, epochs=epochs, verbose=0, shuffle=False,
            callbacks=callbacks)


def _residues(model):
  return [r.numpy() for state in model.optimizer.residues for r in state]


def test_an_interrupted_fit_resumes_from_the_last_backup(tmp_path):
  # 10 steps per epoch, a backup every 4: the run stops at step 15, after the backup of
  # step 12 (epoch 2, batch 2), and the resumed run starts epoch 2 again at step 12.
  model = _model()
  saved = {}

  class Record(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      step = int(self.model.optimizer.iterations.numpy())
      if step == 12:
        saved.update(weights=self.model.get_weights(), residues=_residues(self.model))

  backup = tf_adacomp.BackupAndRestore(str(tmp_path), save_freq=4, delete_checkpoint=False)
  with pytest.raises(_Stop):
    _fit(model, [backup, Record(), _StopAt(15)])
  assert json.loads((tmp_path / "training_metadata.json").read_text())["epoch"] == 1

  resumed = _model()
  epochs = []

  class Epochs(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
      assert int(self.model.optimizer.iterations.numpy()) == 12
      for a, b in zip(saved["weights"], self.model.get_weights()):
        np.testing.assert_array_equal(a, b)
      for a, b in zip(saved["residues"], _residues(self.model)):
        np.testing.assert_array_equal(a, b)

    def on_epoch_begin(self, epoch, logs=None):
      epochs.append(epoch)

  _fit(resumed, [tf_adacomp.BackupAndRestore(str(tmp_path), save_freq=4), Epochs()])
  assert epochs == [1, 2]
  assert int(resumed.optimizer.iterations.numpy()) == 32
  assert not tmp_path.exists()  # delete_checkpoint=True: gone after a finished fit


def test_a_save_cut_off_leaves_the_previous_backup_whole(tmp_path, monkeypatch):
  model = _model()
  backup = tf_adacomp.BackupAndRestore(str(tmp_path), save_freq=4, delete_checkpoint=False)
  calls = []
  real = model.save_weights

  def save_weights(path, overwrite=True):
    calls.append(path)
    if len(calls) == 2:  # the second backup dies half written
      real(path, overwrite=overwrite)
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
      raise _Stop()
    real(path, overwrite=overwrite)

  monkeypatch.setattr(model, "save_weights", save_weights)
  with pytest.raises(_Stop):
    _fit(model, [backup])
  # Written beside the backup, never over it.
  assert all(os.path.basename(p).startswith(".partial-") for p in calls)
  restored = _model()
  restored.optimizer.build(restored.trainable_variables)
  restored.load_weights(str(tmp_path / backup_module.WEIGHTS_FILE))  # whole: it loads
  assert int(restored.optimizer.iterations.numpy()) == 4


def test_reads_a_backup_of_keras_own_callback(tmp_path):
  model = _model()
  with pytest.raises(_Stop):
    _fit(model, [keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=5,
                                                  delete_checkpoint=False), _StopAt(7)])
  resumed = _model()
  starts = []

  class Start(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
      starts.append(int(self.model.optimizer.iterations.numpy()))

  _fit(resumed, [tf_adacomp.BackupAndRestore(str(tmp_path), save_freq=5), Start()],
       epochs=1)
  assert starts == [5]


# Slow: the fallback is test_a_torn_metadata_file_falls_back_to_the_previous_backup's (by hand) in
# the fast tier; this one after two fits.
@pytest.mark.slow
def test_the_previous_backup_is_used_when_the_latest_cannot_be_read(tmp_path):
  model = _model()
  with pytest.raises(_Stop):
    _fit(model, [tf_adacomp.BackupAndRestore(str(tmp_path), save_freq=4,
                                             double_checkpoint=True,
                                             delete_checkpoint=False), _StopAt(9)])
  latest = tmp_path / backup_module.WEIGHTS_FILE
  latest.write_bytes(latest.read_bytes()[:100])  # damaged after the fact (disk, copy)
  resumed = _model()
  starts = []

  class Start(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
      starts.append(int(self.model.optimizer.iterations.numpy()))

  _fit(resumed, [tf_adacomp.BackupAndRestore(str(tmp_path), save_freq=4,
                                             double_checkpoint=True), Start()], epochs=1)
  assert starts == [4]


@pytest.mark.parametrize("kwargs, message", [
    (dict(backup_dir=""), r"Received: backup_dir=''"),
    (dict(backup_dir=None), r"Received: backup_dir=None"),
    (dict(backup_dir="b", save_freq=0), r"Received: save_freq=0"),
    (dict(backup_dir="b", save_freq="batch"), r"Received: save_freq='batch'"),
    (dict(backup_dir="b", double_checkpoint=1), r"Received: double_checkpoint=1"),
    (dict(backup_dir="b", delete_checkpoint="yes"), r"Received: delete_checkpoint='yes'"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, message):
  with pytest.raises(ValueError, match=message):
    tf_adacomp.BackupAndRestore(**kwargs)


def test_an_unbuilt_model_is_refused(tmp_path):
  model = keras.Sequential([keras.layers.Dense(2)])
  model.compile(optimizer="sgd", loss="mse")
  callback = tf_adacomp.BackupAndRestore(str(tmp_path))
  callback.set_model(model)
  with pytest.raises(ValueError, match="needs a built model"):
    callback.on_train_begin()
  assert tf.io.gfile.listdir(str(tmp_path)) == []


def _backup_by_hand(directory, epochs, weights_from=None):
  """Writes a backup (and with two epochs a previous one, ``*.bkp``) as the callback
  does, without a fit: a model's weights and ``{"epoch": e, "batch": 0}``."""
  model = weights_from or _model()
  model.optimizer.build(model.trainable_variables)
  for suffix, epoch in zip(("", ".bkp"), epochs):
    model.save_weights(str(directory / backup_module.WEIGHTS_FILE))
    if suffix:
      os.replace(directory / backup_module.WEIGHTS_FILE,
                 directory / (backup_module.WEIGHTS_FILE + suffix))
      model.save_weights(str(directory / backup_module.WEIGHTS_FILE))
    (directory / (backup_module.METADATA_FILE + suffix)).write_text(
        json.dumps({"epoch": epoch, "batch": 0}))


def _restore(directory):
  """A fresh model restored by the callback's ``on_train_begin``; its initial epoch."""
  model = _model()
  model.build([None, 64])
  callback = tf_adacomp.BackupAndRestore(str(directory), double_checkpoint=True)
  callback.set_model(model)
  callback.on_train_begin()
  return model._initial_epoch  # pylint: disable=protected-access


def test_a_torn_metadata_file_falls_back_to_the_previous_backup(tmp_path):
  _backup_by_hand(tmp_path, epochs=(3, 2))
  metadata = tmp_path / backup_module.METADATA_FILE
  metadata.write_text('{"epoch": 3, "ba')  # torn: cut off mid-write
  assert _restore(tmp_path) == 2  # the previous backup's epoch
  assert metadata.read_text() == '{"epoch": 3, "ba'  # nothing deleted


@pytest.mark.parametrize("content, problem", [
    ('{"epoch": 3, "ba', "not valid JSON"),
    ('{"batch": 0}', "no 'epoch'"),
    ('{"epoch": "three", "batch": 0}', "'epoch'"),
    ('[3]', "not a JSON object"),
])
def test_bad_metadata_without_a_previous_backup_is_refused_naming_the_file(
    tmp_path, content, problem):
  _backup_by_hand(tmp_path, epochs=(3,))
  metadata = tmp_path / backup_module.METADATA_FILE
  metadata.write_text(content)
  with pytest.raises(ValueError) as error:
    _restore(tmp_path)
  message = str(error.value)
  assert str(metadata) in message and problem in message, message
  assert repr(content)[:20] in message, message  # what the file held
  assert metadata.read_text() == content  # nothing deleted or rewritten


def test_bad_metadata_in_both_backups_is_refused_naming_both_files(tmp_path):
  _backup_by_hand(tmp_path, epochs=(3, 2))
  for suffix in ("", ".bkp"):
    (tmp_path / (backup_module.METADATA_FILE + suffix)).write_text("{}")
  with pytest.raises(ValueError) as error:
    _restore(tmp_path)
  for suffix in ("", ".bkp"):
    assert str(tmp_path / (backup_module.METADATA_FILE + suffix)) in str(error.value)


def test_the_fingerprint_of_a_backup_reads_metadata_that_is_not_text(tmp_path):
  # The workers compare fingerprints before any restore: a hand-edited (not UTF-8)
  # metadata file must reach the restore's message, not fail in the comparison.
  _backup_by_hand(tmp_path, epochs=(3,))
  (tmp_path / backup_module.METADATA_FILE).write_bytes(b"\xff\xfe{")
  found, digest = backup_module._backup_fingerprint(str(tmp_path))  # pylint: disable=protected-access
  assert found and digest >= 0
  (tmp_path / backup_module.METADATA_FILE).write_bytes(b"\xff\xfe[")
  assert backup_module._backup_fingerprint(str(tmp_path))[1] != digest  # pylint: disable=protected-access


def test_torn_weights_without_a_previous_backup_are_refused_naming_the_file(tmp_path):
  # Starting over instead would overwrite the backup with the next save.
  _backup_by_hand(tmp_path, epochs=(3,))
  weights = tmp_path / backup_module.WEIGHTS_FILE
  weights.write_bytes(weights.read_bytes()[:100])
  with pytest.raises(ValueError, match=f"{weights}.*Received: backup_dir="):
    _restore(tmp_path)
  assert len(weights.read_bytes()) == 100
