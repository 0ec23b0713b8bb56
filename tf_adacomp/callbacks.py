"""A Keras callback that puts compression statistics into the logs and TensorBoard."""

import math

import keras
import tensorflow as tf

from tf_adacomp import log
from tf_adacomp import stats
from tf_adacomp.compat import internals
from tf_adacomp.cross_device_ops import CompressedAllReduce
from tf_adacomp.optimizer import CompressedOptimizer


class CompressionStats(keras.callbacks.Callback):
  """Puts the compression of a compressed exchange into Keras' logs and TensorBoard.

  The compression ratio is dense float32 bytes / bytes sent (one replica, the gradient
  or update exchange). By default the progress bar gets one figure, ``compression_ratio``:
  that of the epoch so far (its summed bytes), so that steps that send nothing (with
  ``local_steps``, all but a round's last) or little do not make it jump, ending with the
  epoch's, which Keras prints at the bar's end and the History keeps. The History (``model.history.history``) also gets, per epoch, one
  ``compression_ratio_<kind>`` per variable kind (conv, dense, recurrent, vector),
  ``bytes_sent`` (the mean per step, every byte counted) and, with Adam's shared second
  moment, ``moment_bytes`` (the mean per step of its dense moment averages at steps 1, 2,
  4, 8, ..., counted in ``bytes_sent`` but kept out of the ratios, which measure the
  compressor). With ``log_dir`` every figure also goes to TensorBoard scalars under
  ``compression/``, per step and per epoch (``epoch_...``; a step that sent nothing has
  no ratio and writes none). ``totals()`` gives the bytes and ratios of the whole
  training run, every byte counted, per kind; ``variable_totals()`` the same per
  variable (per layer weight). Where ``CompressedOptimizer``'s ``dense_when_faster`` is
  on (its default) each decision between the dense and the compressed exchange is
  logged (logger
  ``tf_adacomp``), with the step times it was taken on.

  Args:
    source: the ``CompressedOptimizer`` or ``CompressedAllReduce`` to read; by default
      the model's optimizer (inside a ``LossScaleOptimizer`` too), else its strategy's
      cross-device ops.
    log_dir: optional TensorBoard directory for per-step scalars.
    progress_bar: ``"ratio"`` (the default: the one figure above) or ``"all"`` (every
      figure in Keras' logs: the last step's on the bar, the epoch's at its end, where
      Keras' own TensorBoard callback also reads them).

  Raises:
    ValueError: ``progress_bar`` is neither; (at the start of training) no compressed
      exchange is found.
  """

  PROGRESS_BAR = ("ratio", "all")

  def __init__(self, source=None, log_dir=None, progress_bar="ratio"):
    super().__init__()
    if progress_bar not in self.PROGRESS_BAR:
      raise ValueError(f"`progress_bar` must be one of {self.PROGRESS_BAR}. "
                       f"Received: progress_bar={progress_bar!r}")
    self.source = source
    self.log_dir = log_dir
    self.progress_bar = progress_bar
    self._writer = None
    self._epoch = []
    self._so_far = {"dense_bytes": 0.0, "sent_bytes": 0.0}  # the epoch's, moments apart
    self._totals = {}
    self._variables = {}
    self._iterations = None  # the source's step count at the last batch end
    self._has_moments = False  # whether the source averages Adam's moments
    self._decision = None  # the last decision of dense_when_faster logged

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
    self._iterations = self._source_iterations()
    if self.log_dir and self._writer is None:
      self._writer = tf.summary.create_file_writer(self.log_dir)

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = []
    self._so_far = {"dense_bytes": 0.0, "sent_bytes": 0.0}

  def _source_iterations(self):
    """The source's optimizer steps, if it counts them (None: it does not)."""
    iterations = getattr(self.source, "iterations", None)
    return None if iterations is None else int(iterations.numpy())

  def _moment_bytes(self):
    """Per variable, the bytes of the last step's moment averages; None: the source
    averages no moments (no shared second moment)."""
    moment_bytes = getattr(self.source, "moment_bytes", None)
    moments = moment_bytes() if moment_bytes is not None else None
    iterations = self._source_iterations()
    advanced = iterations is None or self._iterations is None or iterations > self._iterations
    self._iterations = iterations
    # A step the optimizer skipped (non-finite gradients) averaged no moments.
    return moments if moments is None or advanced else [0] * len(moments)

  def _log_decision(self):
    """Logs a new decision of ``dense_when_faster`` (the source's ``exchange_choice``)."""
    exchange_choice = getattr(self.source, "exchange_choice", None)
    choice = exchange_choice() if exchange_choice is not None else None
    if not choice or choice["phase"] != "chosen":
      return
    decision = (choice["exchange"], choice["compressed_step_seconds"],
                choice["dense_step_seconds"], choice.get("bf16_step_seconds"))
    if decision != self._decision:
      self._decision = decision
      # bf16's time where its probe ran.
      bf16 = "" if decision[3] is None else f", {1e3 * decision[3]:.1f} ms bf16"
      log.info("dense_when_faster: the %s exchange from step %d (a step took %.1f ms "
               "compressed, %.1f ms dense%s: medians over every replica).",
               choice["exchange"], self._source_iterations() or 0, 1e3 * decision[1],
               1e3 * decision[2], bf16)

  def on_train_batch_end(self, batch, logs=None):
    self._log_decision()
    variable_bytes = self.source.variable_bytes()
    moments = self._moment_bytes()
    if not variable_bytes:
      return
    self._has_moments = moments is not None
    moments = moments or [0] * len(variable_bytes)
    for (plan, nbytes), moment in zip(variable_bytes, moments):
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
    # The compressor's own figures: every byte but the moment averages.
    compressed = stats.summarize((plan, nbytes - moment) for (plan, nbytes), moment
                                 in zip(variable_bytes, moments))
    moment_bytes = float(sum(moments))
    self._epoch.append((compressed, summary["total"]["sent_bytes"], moment_bytes))
    self._so_far["dense_bytes"] += compressed["total"]["dense_bytes"]
    self._so_far["sent_bytes"] += compressed["total"]["sent_bytes"]
    values = self._values(compressed, summary["total"]["sent_bytes"],
                          moment_bytes if self._has_moments else None)
    if logs is not None:
      if self.progress_bar == "all":
        logs.update(values)
      elif self._so_far["sent_bytes"]:  # nothing sent yet: no figure rather than NaN
        logs["compression_ratio"] = stats.ratio(self._so_far["dense_bytes"],
                                                self._so_far["sent_bytes"])
    if self._writer is not None:
      step = int(self.model.optimizer.iterations.numpy())
      with self._writer.as_default(step=step):
        for name, value in values.items():
          if not math.isnan(value):
            tf.summary.scalar(f"compression/{name}", value)

  def on_epoch_end(self, epoch, logs=None):
    if logs is not None and self._epoch:
      summaries = [compressed for compressed, _, _ in self._epoch]
      sums = {kind: {"dense_bytes": sum(s[kind]["dense_bytes"] for s in summaries),
                     "sent_bytes": sum(s[kind]["sent_bytes"] for s in summaries)}
              for kind in summaries[0]}
      for entry in sums.values():
        entry["ratio"] = stats.ratio(entry["dense_bytes"], entry["sent_bytes"])
      steps = len(self._epoch)
      values = self._values(
          sums, sum(sent for _, sent, _ in self._epoch) / steps,
          sum(m for _, _, m in self._epoch) / steps if self._has_moments else None)
      if self.progress_bar == "all":
        logs.update(values)
        return
      # Keras prints the epoch's logs at the end of its bar: the one figure there, the
      # rest straight into the History (which appends the logs after this callback).
      logs["compression_ratio"] = values.pop("compression_ratio")
      history = getattr(getattr(self.model, "history", None), "history", None)
      if isinstance(history, dict):
        for name, value in values.items():
          history.setdefault(name, []).append(value)
      if self._writer is not None:
        with self._writer.as_default(step=epoch):
          for name, value in values.items():
            if not math.isnan(value):
              tf.summary.scalar(f"compression/epoch_{name}", value)

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
    return self._values(summary, summary["total"]["sent_bytes"]) if summary else {}

  @staticmethod
  def _values(summary, bytes_sent, moment_bytes=None):
    """The log entries: ratios of ``summary`` (moments apart), every byte in bytes_sent."""
    values = {"compression_ratio": summary["total"]["ratio"], "bytes_sent": float(bytes_sent)}
    if moment_bytes is not None:
      values["moment_bytes"] = float(moment_bytes)
    for kind, entry in summary.items():
      if kind != "total":
        values[f"compression_ratio_{kind}"] = entry["ratio"]
    return values


def _with_ratios(totals):
  """Adds ``ratio`` (dense bytes / bytes sent; NaN when nothing was sent) to each entry."""
  return {name: dict(entry, ratio=entry["dense_bytes"] / entry["sent_bytes"]
                     if entry["sent_bytes"] else float("nan"))
          for name, entry in totals.items()}
