"""Installs of the package as users make them provide tf_adacomp.examples and tf-adacomp.

Each test builds or installs the checkout into a new virtual environment, offline: the
new environment sees this one's site-packages (TensorFlow and the other dependencies)
through a path entry, and pip builds with this environment's setuptools and wheel
(``--no-build-isolation``). Each then runs from a folder outside the checkout.
"""

import importlib.metadata
import os
import pathlib
import shutil
import site
import subprocess
import sys
import sysconfig
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("tf_adacomp", "examples", "pyproject.toml", "setup.py", "README.md")


def _run(command, cwd, timeout=300):
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CONFIG")}
  env["TF_CPP_MIN_LOG_LEVEL"] = "3"
  result = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
  assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
  return result


def _new_venv(path):
  """A venv whose own site-packages comes first, then this environment's (for TF)."""
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
  python = path / "bin" / "python"
  purelib = subprocess.run(
      [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
      capture_output=True, text=True, check=True).stdout.strip()
  # A plain path entry: .pth files over there (this checkout's editable install) are
  # not processed, so only the new install can provide tf_adacomp.
  ours = [sysconfig.get_paths()["purelib"]] + site.getsitepackages()
  (pathlib.Path(purelib) / "dependencies.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")
  return python


def _pip(python, *args, cwd):
  return _run([python, "-m", "pip", "--disable-pip-version-check", "--no-input", *args], cwd)


def _copy_sources(destination):
  for name in SOURCES:
    source = ROOT / name
    if source.is_dir():
      shutil.copytree(source, destination / name,
                      ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    else:
      shutil.copy(source, destination / name)
  return destination


def _check_installed(python, venv, cwd):
  """tf_adacomp.examples imports from the new venv, and the console script runs."""
  where = _run([python, "-c", "import tf_adacomp, tf_adacomp.examples.fashion_mnist as m; "
                "print(tf_adacomp.__file__); print(m.__file__)"], cwd).stdout.split()
  for path in where:
    assert not path.startswith(str(ROOT)), f"imported from the checkout: {path}"
  result = _run([venv / "bin" / "tf-adacomp", "train", "fashion_mnist", "--help"], cwd)
  assert "--compressor" in result.stdout and "--replicas" in result.stdout
  return where


@pytest.mark.slow
def test_a_wheel_installed_elsewhere_has_the_examples_and_the_script(tmp_path):
  sources = _copy_sources(tmp_path / "src")
  wheels = tmp_path / "wheels"
  _pip(sys.executable, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, ".",
       cwd=sources)
  (wheel,) = wheels.glob("tf_adacomp-*.whl")
  python = _new_venv(tmp_path / "venv")
  _pip(sys.executable, "--python", python, "install", "--no-deps", wheel, cwd=tmp_path)
  where = _check_installed(python, tmp_path / "venv", tmp_path)
  assert all(str(tmp_path / "venv") in path for path in where)


@pytest.mark.slow
def test_an_editable_install_where_wheel_and_setuptools_are_present(tmp_path):
  """The case that once lost tf_adacomp.examples: `pip install -e .` into an environment
  that already has wheel and setuptools (TensorFlow brings wheel) took pip's legacy
  `setup.py develop` path, which ignores package-dir."""
  # What pip found here: setuptools with PEP 660 editables, and wheel.
  assert int(importlib.metadata.version("setuptools").split(".")[0]) >= 64
  assert importlib.metadata.version("wheel")
  sources = _copy_sources(tmp_path / "src")
  python = _new_venv(tmp_path / "venv")
  result = _pip(sys.executable, "--python", python, "install", "--no-deps",
                "--no-build-isolation", "-e", sources, cwd=tmp_path)
  assert "setup.py develop" not in result.stdout + result.stderr
  assert not list((tmp_path / "venv").rglob("*.egg-link"))
  where = _check_installed(python, tmp_path / "venv", tmp_path)
  assert all(path.startswith(str(sources)) for path in where)  # editable: the sources


def test_every_package_of_the_tree_is_declared():
  """pyproject.toml lists the packages one by one: a new subpackage (tf_adacomp/compat/)
  left out would be missing from every wheel, and ``import tf_adacomp`` would fail there."""
  declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"])
  found = {".".join(path.parent.relative_to(ROOT).parts)
           for path in (ROOT / "tf_adacomp").rglob("__init__.py")}
  assert found <= declared, f"packages missing from pyproject.toml: {sorted(found - declared)}"
