"""The tests' processes leave TensorFlow's and Keras' optional integrations out
(tests/startup/lean_imports.py): JAX, scikit-learn and matplotlib, refused to TensorFlow's
and Keras' own module code only, loaded as usual for everyone else."""

import json
import os
import subprocess
import sys

import pytest

from startup import lean_imports

PRINT_LOADED = ("print(json.dumps(sorted({m.partition('.')[0] for m in sys.modules} & "
                "{'jax', 'sklearn', 'matplotlib'})))")
LOADED = "import json, sys, tensorflow, keras; " + PRINT_LOADED


def _find_from(importer: str, at_module_level: bool, name: str = "sklearn"):
  """The finder asked for ``name`` by code of module ``importer``: at its top level, or
  in one of its functions."""
  finder = lean_imports._SkipOptionalIntegrations()  # pylint: disable=protected-access
  code = ("spec = finder.find_spec(name)" if at_module_level else
          "def load():\n  return finder.find_spec(name)\nspec = load()")
  scope = {"__name__": importer, "finder": finder, "name": name}
  exec(compile(code, f"<{importer}>", "exec"), scope)  # pylint: disable=exec-used
  return scope["spec"]


@pytest.mark.parametrize("importer", ["tensorflow.lite.python.util",
                                      "keras.src.wrappers.fixes", "tf_keras.src.utils"])
@pytest.mark.parametrize("name", ["jax", "sklearn.base", "matplotlib.pyplot"])
def test_tensorflows_and_keras_module_code_is_refused_the_integrations(importer, name):
  with pytest.raises(ModuleNotFoundError, match=f"{name} left out of {importer}'s import"):
    _find_from(importer, at_module_level=True, name=name)


@pytest.mark.parametrize("importer,at_module_level", [
    ("__main__", True),  # a test, an example or a benchmark
    ("tf_adacomp.cli", True),
    ("sklearn", True),  # scikit-learn's own submodules, once something else imports it
    ("keras.src.wrappers.sklearn_wrapper", False),  # Keras' code run after its import
])
def test_every_other_import_goes_to_the_usual_finders(importer, at_module_level):
  assert _find_from(importer, at_module_level) is None


def test_other_modules_go_to_the_usual_finders_from_keras_too():
  assert _find_from("keras.src.backend", True, name="numpy") is None


def test_the_suites_processes_start_with_it():
  startup = os.path.dirname(lean_imports.__file__)
  assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == startup
  assert any(type(f).__name__ == "_SkipOptionalIntegrations" for f in sys.meta_path)


@pytest.mark.slow  # two processes importing TensorFlow
def test_a_started_process_imports_tensorflow_and_keras_without_them_and_can_still_load_them():
  # Turned off, the canary: TensorFlow and Keras still import all three (if a release stops,
  # tests/startup is no longer needed).
  full = subprocess.run([sys.executable, "-c", LOADED], capture_output=True, text=True,
                        check=True, env=dict(os.environ, **{lean_imports.TURN_OFF: "1"}))
  assert json.loads(full.stdout.splitlines()[-1]) == ["jax", "matplotlib", "sklearn"]
  lean = subprocess.run(
      [sys.executable, "-c",
       f"{LOADED}; import sklearn.datasets, matplotlib.pyplot, jax; {PRINT_LOADED}"],
      capture_output=True, text=True, check=True)
  assert [json.loads(line) for line in lean.stdout.splitlines()[-2:]] == [
      [], ["jax", "matplotlib", "sklearn"]]
