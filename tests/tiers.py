"""Which tier runs: the fast default (``pytest``) or the whole suite (``pytest --full``).

``tests/conftest.py`` records the tier before test modules are imported, so a module can
size its work at import time (hypothesis' ``max_examples`` in a decorator, for example).
"""

import os

import pytest

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


def slow(*values, **kwargs):
  """One parametrize case that runs only in the whole suite: ``pytest.param(*values,
  marks=pytest.mark.slow)``, its id as without the mark (so ``--full`` names it as before).
  ``kwargs`` go to ``pytest.param`` (``id=...``)."""
  return pytest.param(*values, marks=pytest.mark.slow, **kwargs)


def fast_only(cases, keep):
  """Parametrize ``cases`` with those at the indices in ``keep`` in the fast tier and the
  others marked slow (the whole suite runs them all, with the same ids).

  A case is a tuple of argument values (a parametrize with several names), a
  ``pytest.param`` (its marks are kept), or the value of a single argument (wrap a tuple
  value of a single argument in ``pytest.param``).
  """
  out = []
  for i, case in enumerate(cases):
    if i in keep:
      out.append(case)
      continue
    if hasattr(case, "marks") and hasattr(case, "values"):  # a pytest.param already
      out.append(pytest.param(*case.values, marks=[*case.marks, pytest.mark.slow], id=case.id))
    elif isinstance(case, tuple):
      out.append(pytest.param(*case, marks=pytest.mark.slow))
    else:
      out.append(pytest.param(case, marks=pytest.mark.slow))
  return out
