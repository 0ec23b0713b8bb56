"""Which tier runs: the fast default (``pytest``) or the whole suite (``pytest --full``).

``tests/conftest.py`` records the tier before test modules are imported, so a module can
size its work at import time (hypothesis' ``max_examples`` in a decorator, for example).
"""

import os

_ENVIRONMENT = "TF_ADACOMP_TEST_TIER"


def record(full: bool) -> None:
  """Called by conftest once the command line is parsed (in every xdist worker too)."""
  os.environ[_ENVIRONMENT] = "full" if full else "fast"


def full() -> bool:
  """Whether the whole suite runs (``--full``)."""
  return os.environ.get(_ENVIRONMENT) == "full"


def examples(count: int) -> int:
  """Hypothesis examples for a property: ``count`` in the whole suite, a quarter (at least
  5) in the fast tier, where the same property is sampled, less widely."""
  return count if full() else max(5, count // 4)
