"""BackupAndRestore for compressed multi-worker training: one backup, replaced atomically.

Keras' ``keras.callbacks.BackupAndRestore`` writes ``latest.weights.h5`` in place, on
every worker. With ``CompressedOptimizer`` the backup holds, besides the weights and
the optimizer's slots, the residues (gradient mass not yet sent), and under
``MultiWorkerMirroredStrategy`` a save reads them with collectives, so every worker
saves at the same step. Keras' way then fails in two ways:

- a worker killed while writing leaves a torn file; with one folder per worker the
  workers resume from different backups (the torn one's previous, the others' newer)
  and their weights and step counts disagree from then on;
- with one shared folder, several workers write the same file at once.

This callback restores as Keras' does and saves differently: every worker saves (the
collectives need them all), but only the chief's backup is kept, in ``backup_dir``, and
each file replaces the previous one by a rename, so that a kill leaves the old backup
or the new one, never part of one. The other workers write to a scratch folder and
delete it. Every worker restores from ``backup_dir`` (a folder all of them read, as
Keras' multi-worker backups have always assumed), after checking with the others that
all found the same backup (a load runs collectives: workers loading different backups,
or some none, would not even fail cleanly).
"""

import hashlib
import json
import os
import shutil
import tempfile

import keras
import tensorflow as tf

from tf_adacomp.compat import internals
from tf_adacomp.ops import checks

WEIGHTS_FILE = "latest.weights.h5"  # Keras' names, so either callback can read the other's
METADATA_FILE = "training_metadata.json"


class BackupAndRestore(keras.callbacks.Callback):
  """Backs up training state every epoch (or every ``save_freq`` batches) and resumes
  from the backup when ``fit`` starts again; atomic, chief-only saves.

  A drop-in for ``keras.callbacks.BackupAndRestore`` (same arguments and files; it
  reads backups written by Keras' callback): the backup holds the model's weights and
  its optimizer's variables (with ``CompressedOptimizer``: the inner optimizer's slots,
  ``iterations`` and the residues, whose total a restore keeps whatever the number of
  replicas). A resumed ``fit`` starts at the epoch after the last one completed (the
  batches of an epoch cut short are trained again) with ``iterations`` where the backup
  left it. Under ``MultiWorkerMirroredStrategy`` every worker saves at the same steps,
  the chief's backup is the one kept, and every worker restores from ``backup_dir``.

  Args:
    backup_dir: folder of the backup; under ``MultiWorkerMirroredStrategy`` a folder
      every worker reads (a shared filesystem).
    save_freq: "epoch" (default) or an int >= 1, the batches between backups.
    double_checkpoint: also keep the previous backup (``*.bkp``), restored when the
      latest cannot be read (torn or damaged weights, metadata that is not the JSON a
      save writes).
    delete_checkpoint: delete the backup when training ends (default True, as Keras).

  Raises:
    ValueError: an empty ``backup_dir`` or a bad ``save_freq``; at the start of
      training, an unbuilt model (as Keras), workers that found different backups
      (``backup_dir`` not a folder they share), or a backup that cannot be read with
      no readable previous one (the message names each file and what is wrong; the
      files are left as they are).
  """

  def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=False,
               delete_checkpoint=True):
    super().__init__()
    if not backup_dir or not isinstance(backup_dir, (str, os.PathLike)):
      raise ValueError(f"`backup_dir` must be a non-empty path. Received: "
                       f"backup_dir={backup_dir!r}")
    if save_freq != "epoch":
      checks.positive_int(save_freq, "save_freq")
    self.backup_dir = os.fspath(backup_dir)
    self.save_freq = save_freq
    self.double_checkpoint = checks.boolean(double_checkpoint, "double_checkpoint")
    self.delete_checkpoint = checks.boolean(delete_checkpoint, "delete_checkpoint")
    self._epoch = 0
    self._batches_since_save = 0

  # --- Restoring ---------------------------------------------------------------------

  def on_train_begin(self, logs=None):
    if not self.model.built:
      raise ValueError("BackupAndRestore needs a built model: build it (call it on a "
                       f"batch) before fit(). Received: model={self.model.name!r}")
    optimizer = self.model.optimizer
    if optimizer is not None and not optimizer.built:
      # On every worker, backup or not: under MultiWorkerMirroredStrategy creating a
      # variable is a collective (its initial value is broadcast), so a worker that
      # built alone would wait for the others.
      optimizer.build(self.model.trainable_variables)
    # Before loading: a load under MultiWorkerMirroredStrategy runs collectives, so
    # workers that would load different backups (or some none) must not start.
    _check_same_backup_everywhere(self.model, self.backup_dir)
    # The latest backup, else the previous one. Every worker reads the same files, so
    # every worker makes the same choice (a load runs collectives under
    # MultiWorkerMirroredStrategy).
    problems = []
    for suffix in ("", ".bkp"):
      weights = os.path.join(self.backup_dir, WEIGHTS_FILE + suffix)
      if not tf.io.gfile.exists(weights):
        continue
      metadata = os.path.join(self.backup_dir, METADATA_FILE + suffix)
      try:
        # The metadata first: it is cheap to check, and a bad one then leaves the
        # weights unloaded.
        epoch = _read_epoch(metadata)
        self._load_weights(weights)
      except (OSError, _BadMetadata) as error:
        problems.append(str(error) if isinstance(error, _BadMetadata)
                        else f"{weights}: cannot be loaded ({error})")
        continue
      if epoch is not None:
        self._epoch = epoch
        internals.set_initial_epoch(self.model, epoch)
      return
    if problems:
      # Starting over would overwrite the backup at the next save: refuse, and leave
      # the files as they are for whoever repairs or removes them.
      raise ValueError(
          "BackupAndRestore found a backup it cannot read, and no readable previous "
          "backup (double_checkpoint=True keeps one): " + "; ".join(problems) + ". "
          "Repair or remove the backup's files to resume or start over. Received: "
          f"backup_dir={self.backup_dir!r}")

  def _load_weights(self, weights):
    if weights.endswith(".weights.h5"):
      self.model.load_weights(weights)
      return
    # The previous backup: Keras reads only names ending in ".weights.h5".
    scratch = tempfile.mkdtemp(prefix="backup-restore-")
    try:
      copy = os.path.join(scratch, WEIGHTS_FILE)
      tf.io.gfile.copy(weights, copy)
      self.model.load_weights(copy)
    finally:
      shutil.rmtree(scratch, ignore_errors=True)

  # --- Saving ------------------------------------------------------------------------

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = epoch

  def on_train_batch_end(self, batch, logs=None):
    if self.save_freq == "epoch":
      return
    self._batches_since_save += 1
    if self._batches_since_save >= self.save_freq:
      self._batches_since_save = 0
      # After an epoch's last batch, a resumed run starts at the next epoch.
      last = (self.params or {}).get("steps") == batch + 1
      self._save(epoch=self._epoch + 1 if last else self._epoch, batch=batch)

  def on_epoch_end(self, epoch, logs=None):
    if self.save_freq == "epoch":
      self._save(epoch=epoch + 1, batch=0)

  def on_train_end(self, logs=None):
    # Only the chief: under MultiWorkerMirroredStrategy the folder is shared.
    chief = self.model.distribute_strategy.extended.should_checkpoint
    if chief and self.delete_checkpoint and tf.io.gfile.exists(self.backup_dir):
      tf.io.gfile.rmtree(self.backup_dir)

  def _save(self, epoch, batch):
    """Writes the backup; ``epoch`` is the one a resumed run starts at."""
    chief = self.model.distribute_strategy.extended.should_checkpoint
    directory = self.backup_dir if chief else tempfile.mkdtemp(prefix="backup-worker-")
    try:
      tf.io.gfile.makedirs(directory)
      weights = os.path.join(directory, WEIGHTS_FILE)
      metadata = os.path.join(directory, METADATA_FILE)
      if chief and self.double_checkpoint:
        for path in (weights, metadata):
          if tf.io.gfile.exists(path):
            _replace(path + ".bkp", lambda partial, path=path: tf.io.gfile.copy(
                path, partial, overwrite=True))
      # Weights first: a kill between the two renames resumes the newer weights at
      # the older epoch (its batches are trained again), never the reverse.
      _replace(weights, lambda partial: self.model.save_weights(partial, overwrite=True))
      _replace(metadata, lambda partial: _write(partial, json.dumps(
          {"epoch": epoch, "batch": batch})))
    finally:
      if not chief:
        shutil.rmtree(directory, ignore_errors=True)


class _BadMetadata(Exception):
  """A backup's metadata file that is not what a save writes (torn, hand-edited)."""


def _read_epoch(path):
  """The epoch a resumed run starts at, from the metadata file ``path``.

  Args:
    path: a backup's metadata file (``{"epoch": int >= 0, ...}``, as Keras writes too).

  Returns:
    The epoch, or None when there is no such file (the weights alone are restored).

  Raises:
    _BadMetadata: the file is not valid JSON, not an object, or has no non-negative
      integer "epoch"; the message names the file and what it holds (shortened).
    OSError: the file cannot be read.
  """
  if not tf.io.gfile.exists(path):
    return None
  with tf.io.gfile.GFile(path, "rb") as f:
    raw = f.read()
  shown = raw.decode("utf-8", errors="replace")
  shown = repr(shown if len(shown) <= 200 else shown[:200] + "...")
  try:
    content = json.loads(raw)
  except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
    raise _BadMetadata(f"{path}: not valid JSON ({error}); it holds {shown}") from None
  if not isinstance(content, dict):
    raise _BadMetadata(f"{path}: not a JSON object; it holds {shown}")
  if "epoch" not in content:
    raise _BadMetadata(f"{path}: no 'epoch' key; it holds {shown}")
  epoch = content["epoch"]
  if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
    raise _BadMetadata(f"{path}: 'epoch' must be an integer >= 0; it holds {shown}")
  return epoch


def _replace(path, write):
  """``write(partial)`` to a temporary file beside ``path``, then renames it to ``path``
  (atomic on a POSIX filesystem: a reader sees the old file or the new one)."""
  folder, name = os.path.split(path)
  # Keras' save_weights wants names ending in ".weights.h5": the prefix keeps the ending.
  partial = os.path.join(folder, f".partial-{os.getpid()}-{name}")
  write(partial)
  tf.io.gfile.rename(partial, path, overwrite=True)


def _write(path, text):
  with tf.io.gfile.GFile(path, "w") as f:
    f.write(text)


def _backup_fingerprint(backup_dir):
  """``(found, digest)`` of the backup in ``backup_dir``: whether there is one, and a
  63-bit digest of its metadata and its files' sizes (equal for workers reading the
  same folder; a digest, not a hash of the weights, to stay cheap for large models)."""
  parts = []
  for name in (WEIGHTS_FILE, METADATA_FILE, WEIGHTS_FILE + ".bkp", METADATA_FILE + ".bkp"):
    path = os.path.join(backup_dir, name)
    if not tf.io.gfile.exists(path):
      parts.append(f"{name}:-")
      continue
    size = tf.io.gfile.stat(path).length
    content = ""
    if name.startswith(METADATA_FILE):
      # Bytes: a metadata file that is not text (hand-edited) is compared too, and its
      # message comes from the restore, the same on every worker.
      with tf.io.gfile.GFile(path, "rb") as f:
        content = f.read().hex()
    parts.append(f"{name}:{size}:{content}")
  found = tf.io.gfile.exists(os.path.join(backup_dir, WEIGHTS_FILE))
  digest = int.from_bytes(hashlib.sha256("|".join(parts).encode()).digest()[:8], "big") >> 1
  return found, digest


def _check_same_backup_everywhere(model, backup_dir):
  """Raises ValueError unless every worker of a multi-worker strategy finds the same
  backup in ``backup_dir`` (or every worker none)."""
  strategy = model.distribute_strategy
  if (not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
      or not internals.in_multi_worker_mode(strategy)):
    return
  found, digest = _backup_fingerprint(backup_dir)
  mine = tf.constant([[int(found), digest]], tf.int64)
  rows = strategy.gather(
      strategy.experimental_distribute_values_from_function(lambda _: mine), axis=0).numpy()
  if len({tuple(row) for row in rows}) > 1:
    with_backup = int(rows[:, 0].sum())
    raise ValueError(
        f"The workers found different backups: {with_backup} of {len(rows)} found one in "
        f"`backup_dir`, and not the same. Every worker must restore the same backup, so "
        f"`backup_dir` must be a folder all of them read (a shared filesystem), holding "
        f"this run's backup only. Received: backup_dir={backup_dir!r}")
