"""What every benchmark does with its figures: write them as JSON and say where."""

import json
import os


def write_json(path, result):
  """Writes ``result`` to ``path`` (creating its folder) and prints where it went."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {path}")
