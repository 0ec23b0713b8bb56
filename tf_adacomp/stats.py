"""Compression statistics: dense float32 bytes against bytes actually sent."""

import math


def summarize(plans_and_bytes):
  """Per variable kind and in total, from ``(TensorPlan, bytes sent)`` pairs.

  Args:
    plans_and_bytes: iterable of ``(plan, nbytes)``, bytes one replica sent for that
      tensor in one step, everything counted.

  Returns:
    ``{kind: {"dense_bytes", "sent_bytes", "ratio"}}`` with a ``"total"`` entry; the
    ratio is dense float32 bytes / bytes sent (NaN before anything was sent).
  """
  summary = {}
  for plan, nbytes in plans_and_bytes:
    for kind in (plan.kind, "total"):
      entry = summary.setdefault(kind, {"dense_bytes": 0, "sent_bytes": 0})
      entry["dense_bytes"] += plan.dense_nbytes
      entry["sent_bytes"] += nbytes
  for entry in summary.values():
    entry["dense_bytes"], entry["sent_bytes"] = (float(entry["dense_bytes"]),
                                                 float(entry["sent_bytes"]))
    entry["ratio"] = (entry["dense_bytes"] / entry["sent_bytes"] if entry["sent_bytes"]
                      else math.nan)
  return summary
