"""A Keras callback that puts compression statistics into the logs and TensorBoard."""

import keras
import tensorflow as tf

from tf_adacomp import stats
from tf_adacomp.compat import internals
from tf_adacomp.cross_device_ops import CompressedAllReduce
from tf_adacomp.optimizer import CompressedOptimizer


class CompressionStats(keras.callbacks.Callback):
  """Logs the compression ratio (dense float32 bytes / bytes sent) of every step.

  Adds to the batch logs (shown by Keras' progress bar) ``compression_ratio``, one
  ``compression_ratio_<kind>`` per variable kind (conv, dense, recurrent, vector) and
  ``bytes_sent`` (one replica, one step); the epoch logs (and so ``History`` and
  Keras' own TensorBoard callback) get the epoch's: its mean ``bytes_sent`` per step
  and the ratios of its summed bytes (with ``local_steps`` only a round's last step
  sends anything, and a step that sent nothing has no ratio of its own). With ``log_dir``,
  the per-step values are also written as TensorBoard scalars under ``compression/``.
  ``totals()`` gives the bytes and ratios of the whole training run, per kind;
  ``variable_totals()`` the same per variable (per layer weight).

  Args:
    source: the ``CompressedOptimizer`` or ``CompressedAllReduce`` to read; by default
      the model's optimizer (inside a ``LossScaleOptimizer`` too), else its strategy's
      cross-device ops.
    log_dir: optional TensorBoard directory for per-step scalars.

  Raises:
    ValueError: (at the start of training) no compressed exchange is found.
  """

  def __init__(self, source=None, log_dir=None):
    super().__init__()
    self.source = source
    self.log_dir = log_dir
    self._writer = None
    self._epoch = []
    self._totals = {}
    self._variables = {}

  def _find_source(self):
    optimizer = self.model.optimizer
    while optimizer is not None:
      if isinstance(optimizer, CompressedOptimizer):
        return optimizer
      optimizer = getattr(optimizer, "inner_optimizer", None)
    ops = internals.cross_device_ops_of(self.model.distribute_strategy)
    if isinstance(ops, CompressedAllReduce):
      return ops
    raise ValueError("CompressionStats found no CompressedOptimizer or CompressedAllReduce "
                     f"on the model. Received: source={self.source!r}")

  def on_train_begin(self, logs=None):
    if self.source is None:
      self.source = self._find_source()
    self._totals = {}
    self._variables = {}
    if self.log_dir and self._writer is None:
      self._writer = tf.summary.create_file_writer(self.log_dir)

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = []

  def on_train_batch_end(self, batch, logs=None):
    variable_bytes = self.source.variable_bytes()
    if not variable_bytes:
      return
    for plan, nbytes in variable_bytes:
      total = self._variables.setdefault(plan.name, {
          "kind": plan.kind, "shape": plan.shape.as_list(), "dense_bytes": 0.0,
          "sent_bytes": 0.0, "steps": 0})
      total["dense_bytes"] += plan.dense_nbytes
      total["sent_bytes"] += nbytes
      total["steps"] += 1
    summary = stats.summarize(variable_bytes)
    for kind, entry in summary.items():
      total = self._totals.setdefault(kind, {"dense_bytes": 0.0, "sent_bytes": 0.0, "steps": 0})
      total["dense_bytes"] += entry["dense_bytes"]
      total["sent_bytes"] += entry["sent_bytes"]
      total["steps"] += 1
    values = self._values(summary)
    self._epoch.append(summary)
    if logs is not None:
      logs.update(values)
    if self._writer is not None:
      step = int(self.model.optimizer.iterations.numpy())
      with self._writer.as_default(step=step):
        for name, value in values.items():
          tf.summary.scalar(f"compression/{name}", value)

  def on_epoch_end(self, epoch, logs=None):
    if logs is not None and self._epoch:
      sums = {kind: {"dense_bytes": sum(s[kind]["dense_bytes"] for s in self._epoch),
                     "sent_bytes": sum(s[kind]["sent_bytes"] for s in self._epoch)}
              for kind in self._epoch[0]}
      for entry in sums.values():
        entry["ratio"] = stats.ratio(entry["dense_bytes"], entry["sent_bytes"])
      logs.update(self._values(sums))
      logs["bytes_sent"] = sums["total"]["sent_bytes"] / len(self._epoch)

  def on_train_end(self, logs=None):
    if self._writer is not None:
      self._writer.flush()

  def totals(self):
    """Bytes of every step of the last (or current) ``fit``, per variable kind.

    Returns:
      ``{kind: {"dense_bytes", "sent_bytes", "steps", "ratio"}}`` with a ``"total"``
      entry: float32 bytes and bytes one replica sent, summed over the steps, and
      their ratio (the compression achieved over the run). Empty before training.
    """
    return _with_ratios(self._totals)

  def variable_totals(self):
    """Like ``totals()``, per variable: the compression each layer weight got.

    Returns:
      ``{variable name: {"kind", "shape", "dense_bytes", "sent_bytes", "steps",
      "ratio"}}`` in the order the exchange sends them. Empty before training.
    """
    return _with_ratios(self._variables)

  def step_values(self):
    """``{log name: value}`` for the last step."""
    summary = stats.summarize(self.source.variable_bytes())
    return self._values(summary) if summary else {}

  @staticmethod
  def _values(summary):
    values = {"compression_ratio": summary["total"]["ratio"],
              "bytes_sent": float(summary["total"]["sent_bytes"])}
    for kind, entry in summary.items():
      if kind != "total":
        values[f"compression_ratio_{kind}"] = entry["ratio"]
    return values


def _with_ratios(totals):
  """Adds ``ratio`` (dense bytes / bytes sent; NaN when nothing was sent) to each entry."""
  return {name: dict(entry, ratio=entry["dense_bytes"] / entry["sent_bytes"]
                     if entry["sent_bytes"] else float("nan"))
          for name, entry in totals.items()}
