"""How a canary of ``tests/compat`` fails: naming the private name and the versions.

A canary exercises one private Keras or TensorFlow name the way tf_adacomp uses it. When
an upgrade renames it, removes it or changes what it does, the canary's failure must say
which name, who relies on it and which versions are installed, so that the fix starts
in the right place (``tf_adacomp/compat/``) without reading a traceback.
"""

import contextlib

import pytest

from tf_adacomp.compat import versions


def fail(name: str, user: str, what: str):
  """Fails the test: ``name`` (a private name), relied on by ``user``, ``what`` happened."""
  pytest.fail(
      f"The private {name}, relied on by {user}, has changed: {what}. Installed: "
      f"{versions.installed()}; checked against {versions.tested()}. Update "
      f"tf_adacomp/compat/ (internals.py lists every private name and who uses it).",
      pytrace=False)


def require(condition, name: str, user: str, what: str) -> None:
  """Fails as ``fail`` unless ``condition``; ``what`` says what was expected."""
  if not condition:
    fail(name, user, what)


@contextlib.contextmanager
def watching(name: str, user: str):
  """Turns any error inside the block (a missing attribute, a changed signature, a
  module moved) into the canary's failure for ``name``."""
  try:
    yield
  except Exception as error:  # pylint: disable=broad-except
    fail(name, user, f"{type(error).__name__}: {error}")
