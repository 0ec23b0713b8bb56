"""What the benchmarks share: writing their figures as JSON, reading AdaComp's bytes."""

import json
import os


def write_json(path, result):
  """Writes ``result`` to ``path`` (creating its folder) and prints where it went."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {path}")


def adacomp_elements_sent(variables):
  """Elements AdaComp sent per step (all variables), from its bytes per variable.

  ``variables`` is ``CompressionStats.variable_totals()`` or an example summary's
  ``variables`` (which has ``sent_bytes_per_step``).

  An AdaComp payload is 3 header words and ``count`` codes of ``bits`` bits, and the
  exchange adds 4 bytes of length (docs/wire_format.md), so ``count`` follows from
  the bytes; the figure is the most any replica sent, averaged over the steps.
  """
  total = 0.0
  for v in variables.values():
    n = 1
    for d in v["shape"]:
      n *= d
    bits = (n - 1).bit_length() + 1
    sent = (v["sent_bytes_per_step"] if "sent_bytes_per_step" in v
            else v["sent_bytes"] / v["steps"])
    words = (sent - 4) / 4 - 3
    total += min(n, max(words, 0.0) * 32 / bits)
  return total
