"""The Bazel BUILD file stays in step with the code, checked offline.

Bazel itself cannot run here (Debian's bazel-bootstrap cannot fetch rules_python without
the internet). Starlark is a subset of Python, so the BUILD file is executed with
stand-ins for its rules, and the targets it declares are checked against the files:
every source belongs to a target, every file named exists, labels and pip requirements
resolve, and every module a target imports is provided by it or by its dependencies.
"""

import ast
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYTHON_DIRS = ("tf_adacomp", "examples", "tests", "benchmarks")
# Import names of the third-party packages, and their pip (requirement) names.
PIP_NAMES = {"absl": "absl-py", "h5py": "h5py", "hypothesis": "hypothesis", "jax": "jax", "keras": "keras",
             "matplotlib": "matplotlib",
             "ml_dtypes": "ml-dtypes", "numpy": "numpy", "pytest": "pytest",
             "sklearn": "scikit-learn", "tensorboard": "tensorboard",
             "tensorflow": "tensorflow", "tensorflow_datasets": "tensorflow-datasets",
             "tf_keras": "tf-keras"}


def _glob(patterns, exclude=()):
  found = {str(p.relative_to(ROOT)) for pattern in patterns for p in ROOT.glob(pattern)
           if p.is_file()}
  return sorted(found - {str(p.relative_to(ROOT)) for e in exclude for p in ROOT.glob(e)})


def _read_build():
  """``{name: {"rule": ..., **attributes}}`` of every target BUILD declares."""
  targets = {}

  def rule(kind):
    def declare(name, **attributes):
      assert name not in targets, f"two targets named {name!r}"
      targets[name] = dict(attributes, rule=kind)
    return declare

  scope = {"load": lambda *args: None, "glob": _glob, "package": lambda **kw: None,
           "licenses": lambda *args: None, "requirement": lambda name: f"@pip//{name}"}
  for kind in ("py_library", "py_binary", "py_test", "genrule"):
    scope[kind] = rule(kind)
  exec(compile((ROOT / "BUILD").read_text(), "BUILD", "exec"), scope)  # pylint: disable=exec-used
  return targets


TARGETS = _read_build()


def _generated():
  return {out for t in TARGETS.values() if t["rule"] == "genrule" for out in t["outs"]}


def _source(path):
  """The checked-in file a (possibly generated) path stands for."""
  if path in _generated():
    generator = next(t for t in TARGETS.values() if t["rule"] == "genrule"
                     and path in t["outs"])
    return generator["srcs"][generator["outs"].index(path)]
  return path


def _all_deps(name, seen=None):
  seen = set() if seen is None else seen
  for dep in TARGETS[name].get("deps", []):
    if dep not in seen:
      seen.add(dep)
      if dep.startswith(":"):
        _all_deps(dep[1:], seen)
  return seen


def _imported_modules(path, index):
  """Every module imported anywhere in a file (``from m import x``: ``m.x`` if a module)."""
  tree = ast.parse((ROOT / path).read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      for alias in node.names:
        full = f"{node.module}.{alias.name}"
        yield full if full in index else node.module


def _module_index():
  """``{importable module name: target}`` for the project's own modules."""
  index = {}
  for name, target in TARGETS.items():
    if target["rule"] == "genrule":
      continue
    roots = [""] + [f"{i}/" for i in target.get("imports", [])]
    for path in target.get("srcs", []):
      for root in roots:
        if path.startswith(root) and path.endswith(".py"):
          module = path[len(root):-3].replace("/", ".").removesuffix(".__init__")
          index.setdefault(module, name)
  return index


def test_the_build_file_is_checked_by_these_stand_ins():
  """The stand-ins see the targets a reader sees (guards against checking nothing)."""
  assert {"tf_adacomp", "examples", "tf-adacomp", "fashion_mnist", "test_helpers",
          "test_build"} <= set(TARGETS)


def test_every_python_file_belongs_to_a_target():
  listed = {_source(p) for t in TARGETS.values() if t["rule"] != "genrule"
            for p in t.get("srcs", [])}
  files = {str(p.relative_to(ROOT)) for d in PYTHON_DIRS for p in (ROOT / d).rglob("*.py")}
  assert files - listed == set()


def test_every_named_file_exists():
  generated = _generated()
  for name, target in TARGETS.items():
    for key in ("srcs", "data", "main"):
      value = target.get(key, [])
      for path in [value] if isinstance(value, str) else value:
        if path.startswith(":"):  # a target's outputs (e.g. data = [":a_binary"])
          assert path[1:] in TARGETS, f"{name}: {key} {path} names no target"
          continue
        assert path in generated or (ROOT / path).is_file(), f"{name}: {key} {path}"


def test_labels_and_requirements_resolve():
  requirements = {re.split(r"[=<>]", line)[0].strip().lower()
                  for line in (ROOT / "requirements.txt").read_text().splitlines()
                  if line.strip() and not line.startswith("#")}
  setup = (ROOT / "pyproject.toml").read_text()
  for name, target in TARGETS.items():
    for dep in target.get("deps", []):
      if dep.startswith(":"):
        assert dep[1:] in TARGETS, f"{name}: unknown target {dep}"
      else:
        package = dep.removeprefix("@pip//")
        assert package in requirements, f"{name}: {package} not in requirements.txt"
        # ml-dtypes and h5py come with tensorflow and keras.
        assert f'"{package}' in setup or package in ("ml-dtypes", "h5py"), (
            f"{name}: {package} not declared in pyproject.toml")


def test_examples_and_tests_have_targets():
  examples = {p.stem for p in (ROOT / "examples").glob("*.py")  # the scripts, not the
              if re.search(r"^NAME = ", p.read_text(), re.M)}  # modules they share
  binaries = {n for n, t in TARGETS.items() if t["rule"] == "py_binary"}
  assert examples <= binaries
  tests = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
  assert tests == {t["srcs"][0] for t in TARGETS.values() if t["rule"] == "py_test"}


@pytest.mark.parametrize("name", sorted(n for n, t in TARGETS.items() if t["rule"] != "genrule"))
def test_every_import_is_provided_by_the_deps(name):
  index = _module_index()
  provided = {name} | {d[1:] for d in _all_deps(name) if d.startswith(":")}
  pip = {d.removeprefix("@pip//") for d in _all_deps(name) if d.startswith("@pip//")}
  for path in TARGETS[name]["srcs"]:
    for module in _imported_modules(_source(path), index):
      top = module.split(".")[0]
      if top in sys.stdlib_module_names or top == "__future__":
        continue
      if top in PIP_NAMES:
        assert PIP_NAMES[top] in pip, f"{name}: {path} imports {module}; add {PIP_NAMES[top]}"
        continue
      owner = index.get(module) or index.get(module.rpartition(".")[0])
      assert owner is not None, f"{name}: {path} imports {module}, which no target provides"
      assert owner in provided, f"{name}: {path} imports {module} from :{owner}, not a dep"
