"""Keeps TensorFlow's and Keras' optional integrations out of the test processes.

With the test dependencies installed, ``import tensorflow, keras`` also imports JAX
(``tf.lite``'s JAX converter), scikit-learn (``keras.wrappers``' scikit-learn estimators)
and matplotlib (``keras.visualization``): about 1.8 of a process's 4.7 CPU-seconds of
import on the 2-core VM, paid again by every process of the suite that imports
TensorFlow (docs/development.md), none of which uses those integrations. Each is
imported in a ``try``, and left out when its module is missing.

``install()`` makes an import of ``jax``, ``sklearn`` or ``matplotlib`` fail with
``ModuleNotFoundError`` when the code importing it is the module-level code of
TensorFlow, Keras or tf_keras; the same import from anywhere else (a test, an example, a
benchmark, or Keras code running after its import) loads the package as usual. The
tests' processes get it from ``sitecustomize.py`` beside this file (conftest puts this
folder first on ``PYTHONPATH``). ``TF_ADACOMP_TEST_FULL_IMPORTS=1`` turns it off.
"""

import os
import sys

SKIPPED = frozenset({"jax", "jaxlib", "sklearn", "matplotlib"})
IMPORTERS = frozenset({"tensorflow", "keras", "tf_keras"})
TURN_OFF = "TF_ADACOMP_TEST_FULL_IMPORTS"


def _top(name: str) -> str:
  return name.partition(".")[0]


class _SkipOptionalIntegrations:
  """A ``sys.meta_path`` finder that refuses ``SKIPPED`` to ``IMPORTERS``' module code."""

  def find_spec(self, name, path=None, target=None):  # pylint: disable=unused-argument
    if _top(name) not in SKIPPED:
      return None
    frame = sys._getframe(1)  # pylint: disable=protected-access
    # The import statement's frame: the first one outside importlib's machinery.
    while frame is not None and _top(frame.f_globals.get("__name__", "")) == "importlib":
      frame = frame.f_back
    if frame is None or frame.f_code.co_name != "<module>":
      return None
    importer = frame.f_globals.get("__name__", "")
    if _top(importer) in IMPORTERS:
      raise ModuleNotFoundError(
          f"{name} left out of {importer}'s import by tests/startup/lean_imports.py",
          name=name)
    return None


def install() -> bool:
  """Puts the finder first on ``sys.meta_path`` once; returns whether it is there."""
  if os.environ.get(TURN_OFF) == "1":
    return False
  # By the class' name: conftest imports this file as startup.lean_imports, and
  # sitecustomize as lean_imports (two module objects, two classes).
  if not any(type(f).__name__ == _SkipOptionalIntegrations.__name__ for f in sys.meta_path):
    sys.meta_path.insert(0, _SkipOptionalIntegrations())
  return True
