"""The training run every example shares: ``train`` (``model.fit``), and ``run``, its ``main``.

An example module provides ``NAME``, ``DEFAULTS`` (its hyper-parameters, overridden by
flags), ``load_data(config) -> input_data.Data`` and ``build_model(config, data) -> keras.Model``
(uncompiled, logits out), and optionally ``callbacks(config) -> [keras.callbacks.Callback]``
(more callbacks for ``fit``; those with a ``summary() -> dict`` method add its entries to
the summary); ``train(example, config)`` does the rest:

  0. unless ``--noxla_cache``, TensorFlow's persistent XLA cache (``tf_adacomp.xla_cache``,
     in a process that has not started TensorFlow yet): each kernel compiles once, not
     once per replica device;
  1. the strategy (``distribution.make_strategy``: ``--strategy``, ``--replicas``; logical
     devices where there are fewer GPUs than replicas), made before anything else touches
     TensorFlow's devices;
  2. input pipelines (``input_data.pipelines``): the example's shuffled, augmented examples,
     repeated, batched to the global batch size and prefetched;
  3. the model and a ``CompressedOptimizer`` (``optimizers.make_optimizer``; or, with
     ``--exchange cross_device_ops``, a ``CompressedAllReduce`` strategy) built in the
     strategy's scope;
  4. ``model.fit`` with Keras progress bars, compression statistics, TensorBoard logs and
     resumable checkpoints (residues included) in ``--model_dir``;
  5. the test accuracy, and a summary (``report``) printed and written to
     ``<model_dir>/summary.json``.
"""

import dataclasses
import logging
import os
import time
from typing import Any, Dict

import keras

import tf_adacomp
from tf_adacomp import xla_cache
from tf_adacomp.examples import input_data
from tf_adacomp.examples import distribution
from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import optimizers
from tf_adacomp.examples import report


def train(example, config, callbacks=()) -> Dict[str, Any]:
  """Trains ``example`` as ``config`` says; returns (and writes) the run's summary.

  Args:
    example: an example module (``NAME``, ``DEFAULTS``, ``load_data``, ``build_model``).
    config: a ``flags_and_config.Config``, from ``make_config`` or ``config_from_flags``.
    callbacks: more Keras callbacks for ``fit`` (e.g. a benchmark's step timer).

  Returns:
    The summary dict (see ``report.summarize``); also printed, and written to
    ``<model_dir>/summary.json`` by the chief when ``model_dir`` is set.
  """
  flags_and_config.validate(config)
  start = time.perf_counter()
  if config.xla_cache and xla_cache.can_enable():
    # Each kernel compiles once, not once per replica device (and not again next run).
    xla_cache.enable()
  # First: logical devices need TensorFlow's devices untouched.
  strategy = distribution.make_strategy(config)

  keras.utils.set_random_seed(config.seed)
  data = example.load_data(config)
  train_data, test_data = input_data.pipelines(data, config)
  steps_per_epoch = config.steps_per_epoch or max(data.train_size // config.batch_size, 1)
  chief = distribution.is_chief(strategy)
  model_dir = config.model_dir
  # One backup for the whole job, in --model_dir (a folder every worker reads; only the
  # chief's save is kept there, see tf_adacomp.BackupAndRestore); logs per worker.
  backup_dir = os.path.join(model_dir, "checkpoint") if model_dir else None
  if model_dir and not chief:
    model_dir = os.path.join(model_dir, "workers", str(strategy.cluster_resolver.task_id))

  with strategy.scope():
    model = example.build_model(config, data)
    model.compile(optimizer=optimizers.make_optimizer(config, steps_per_epoch),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

  stats = tf_adacomp.CompressionStats(
      log_dir=os.path.join(model_dir, "logs", "compression") if model_dir else None)
  compressing = config.compressor != "none"
  # An example may train with callbacks of its own (e.g. ResIST's rounds).
  own = list(example.callbacks(config)) if hasattr(example, "callbacks") else []
  callbacks = list(callbacks) + own + ([stats] if compressing else [])
  if model_dir:
    callbacks += [
        # Weights, optimizer state and residues, every epoch, replaced atomically; a
        # rerun resumes from them.
        tf_adacomp.BackupAndRestore(backup_dir, delete_checkpoint=False),
        keras.callbacks.TensorBoard(os.path.join(model_dir, "logs"))]

  clock = _TrainClock()
  model.fit(train_data, epochs=config.epochs, steps_per_epoch=steps_per_epoch,
            shuffle=False,  # the pipelines shuffle
            callbacks=[clock] + callbacks, verbose=config.verbose if chief else 0)
  train_seconds = clock.seconds
  test_loss, test_accuracy = model.evaluate(test_data, steps=config.eval_steps, verbose=0)
  steps = int(model.optimizer.iterations.numpy())  # resumed runs count their earlier steps

  summary = report.summarize(example, config, model, strategy, stats if compressing else None)
  summary.update(test_accuracy=float(test_accuracy), test_loss=float(test_loss),
                 steps=steps, steps_per_epoch=steps_per_epoch,
                 train_seconds=train_seconds, wall_seconds=time.perf_counter() - start,
                 config=dataclasses.asdict(config))  # every setting, to reproduce the run
  for callback in own:  # what an example's callbacks measured (e.g. bytes per round)
    if hasattr(callback, "summary"):
      summary.update(callback.summary())
  if chief:
    report.publish(summary, model_dir)
  return summary


class _TrainClock(keras.callbacks.Callback):
  """Seconds from the start of training to its end (first step's compiling included).

  Not around ``fit``: after the last step, ``fit`` returned 2-50 s later, idle (0% CPU)
  while TensorFlow destroyed the input iterator (py-spy: ``~IteratorResource`` waiting
  on a tf.data thread), by an amount that varied from run to run of one configuration."""

  def __init__(self):
    super().__init__()
    self._start = self.seconds = None

  def on_train_begin(self, logs=None):
    self._start = time.perf_counter()

  def on_train_end(self, logs=None):
    self.seconds = time.perf_counter() - self._start


def run(example, argv):
  """The examples' absl ``main``: train from flags; an error in a flag, or no data
  (``input_data.DataUnavailable``), exits with its message."""
  if len(argv) > 1:
    raise SystemExit(f"Unexpected arguments: {argv[1:]}. Flags are --name=value.")
  try:
    config = flags_and_config.config_from_flags(example)
  except ValueError as error:
    raise SystemExit(f"{example.NAME}: {error}") from None
  quiet_tensorflow_logs()
  try:
    train(example, config)
  except input_data.DataUnavailable as error:
    # No data is the user's machine, not a bug: its message and ways out, no traceback.
    raise SystemExit(f"{example.NAME}: {error}") from None


def quiet_tensorflow_logs():
  """Hides TensorFlow's INFO lines (one per collective), which absl would print."""
  logging.getLogger("tensorflow").setLevel(logging.WARNING)
