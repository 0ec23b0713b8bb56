"""A run's summary: its settings and bytes per step (from the library's accounting),
printed as a table, written as ``summary.json``, and drawn (``plot_summaries``).

The byte figures come from ``tf_adacomp``: ``stats.summarize`` of the model's plans, and
the ``CompressionStats`` callback's totals; this module is the examples' one caller.
"""

import json
import math
import os

import tf_adacomp
from tf_adacomp import stats as stats_lib
from tf_adacomp.compressors import base

KIND_ORDER = base.KINDS  # the table's per-kind rows, in this order


def summarize(example, config, model, strategy, stats):
  """The run's settings and bytes per step: measured, or dense float32 without ``stats``.

  Args:
    example: the example module (its ``NAME``).
    config: the run's ``flags_and_config.Config``.
    model: the trained model (its trainable variables are counted).
    strategy: the run's strategy (its replicas).
    stats: the ``tf_adacomp.CompressionStats`` callback of the fit, or None (no
      compression: TensorFlow's dense all-reduce).

  Returns:
    The summary's settings and ``compression`` (per kind and ``"total"``), and with
    ``stats`` its ``variables`` (what each layer weight got per step of this fit).
  """
  totals = stats.totals() if stats is not None else None
  # The library's own accounting: each variable's kind and float32 bytes, from its plan.
  baseline = tf_adacomp.NoCompression()
  plans = [baseline.plan(v.shape, v.dtype, v.path) for v in model.trainable_variables
           if v.dtype in ("float16", "bfloat16", "float32", "float64")]
  dense = {kind: entry["dense_bytes"]
           for kind, entry in stats_lib.summarize((p, p.dense_nbytes) for p in plans).items()}
  compression = {}
  for kind, dense_bytes in dense.items():
    if totals and kind in totals and totals[kind]["steps"]:
      entry = totals[kind]
      sent = entry["sent_bytes"] / entry["steps"]
    else:  # dense all-reduce (or nothing measured): float32 gradients
      sent = float(dense_bytes)
    compression[kind] = {"dense_bytes_per_step": float(dense_bytes),
                         "sent_bytes_per_step": sent,
                         "ratio": dense_bytes / sent if sent else math.nan}
  summary = {
      "example": example.NAME, "compressor": config.compressor, "exchange": config.exchange,
      "strategy": config.strategy, "replicas": strategy.num_replicas_in_sync,
      "epochs": config.epochs, "batch_size": config.batch_size,
      "learning_rate": config.learning_rate, "synthetic": config.synthetic,
      "parameters": int(sum(math.prod(v.shape) for v in model.trainable_variables)),
      "compression": compression,
      "bytes_sent_per_step": compression["total"]["sent_bytes_per_step"],
      "dense_bytes_per_step": compression["total"]["dense_bytes_per_step"],
      "compression_ratio": compression["total"]["ratio"],
  }
  if stats is not None:  # what each layer weight got, per step of this fit
    summary["variables"] = {
        name: {"kind": v["kind"], "shape": v["shape"],
               "dense_bytes_per_step": v["dense_bytes"] / v["steps"],
               "sent_bytes_per_step": v["sent_bytes"] / v["steps"], "ratio": v["ratio"]}
        for name, v in stats.variable_totals().items()}
  return summary


def publish(summary, model_dir):
  """Prints the summary's table; writes it to ``<model_dir>/summary.json`` if given."""
  print(format_summary(summary))
  if model_dir:
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)


def _rows(summaries):
  """``(label, [cell per summary])`` rows of the summary table."""
  kinds = [k for k in KIND_ORDER if any(k in s["compression"] for s in summaries)]

  def ratio(s, kind):
    entry = s["compression"].get(kind)
    return f"{entry['ratio']:.1f}x" if entry else "-"

  rows = [("compressor", [label(s) for s in summaries]),
          ("replicas", [f"{s['replicas']} ({s['strategy']})" for s in summaries]),
          ("steps x global batch", [f"{s['steps']} x {s['batch_size']}" for s in summaries]),
          ("test accuracy", [f"{s['test_accuracy']:.4f}" for s in summaries]),
          ("bytes sent / replica / step", [f"{s['bytes_sent_per_step']:,.0f}" for s in summaries]),
          ("dense float32 bytes / step", [f"{s['dense_bytes_per_step']:,.0f}" for s in summaries]),
          ("compression ratio, all", [ratio(s, "total") for s in summaries])]
  rows += [(f"  {kind} layers", [ratio(s, kind) for s in summaries]) for kind in kinds]
  rows += [("train time (s)", [f"{s['train_seconds']:.1f}" for s in summaries]),
           ("wall time (s)", [f"{s['wall_seconds']:.1f}" for s in summaries])]
  return rows


def format_summary(*summaries) -> str:
  """One column per run: accuracy, bytes per step, compression per kind, time."""
  title = f"== {summaries[0]['example']}" + (" (synthetic data)" if summaries[0]["synthetic"]
                                              else "") + " =="
  lines = [title]
  for label, cells in _rows(summaries):
    lines.append(f"{label:<30}" + "".join(f"{cell:>20}" for cell in cells))
  return "\n".join(lines)


def label(summary) -> str:
  """The run's name for a reader: its compressor, "dense" for TensorFlow's all-reduce."""
  return "dense" if summary["compressor"] == "none" else summary["compressor"]


def plot_summaries(summaries, path) -> str:
  """Draws the runs side by side (test accuracy; compression ratio, dense = 1x) to ``path``.

  The ratio (dense float32 bytes / bytes sent, per replica and step) is drawn on a
  linear scale, labelled on each bar, so that a bar twice as tall is twice the ratio.

  Args:
    summaries: summary dicts (see ``training.train``), one bar each.
    path: the PNG to write.

  Returns:
    ``path``.

  Raises:
    ImportError: matplotlib is not installed (it comes with the ``[examples]`` extra).
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top

  names = [label(s) for s in summaries]
  figure, (accuracy, ratio) = pyplot.subplots(1, 2, figsize=(9, 3.6))
  bars = accuracy.bar(names, [s["test_accuracy"] for s in summaries], color="tab:blue")
  accuracy.bar_label(bars, fmt="%.4f")
  accuracy.set_ylim(0, 1.05)
  accuracy.set_title("test accuracy")
  ratios = [s["compression_ratio"] for s in summaries]
  bars = ratio.bar(names, ratios, color="tab:orange")
  ratio.bar_label(bars, labels=[
      f"{r:,.1f}x\n{s['bytes_sent_per_step']:,.0f} B/step" for r, s in zip(ratios, summaries)])
  ratio.set_ylim(0, max(ratios) * 1.25)
  ratio.set_title("compression ratio (dense float32 bytes / bytes sent)", fontsize=10)
  figure.suptitle(f"{summaries[0]['example']}: {summaries[0]['replicas']} replicas, "
                  f"{summaries[0]['steps']} steps")
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  pyplot.close(figure)
  return path

