"""The modules of tf_adacomp import each other in one direction: no cycles.

A cycle works only as long as each module reaches the other's names after both have
loaded, which is why cycles hide in function-level imports: such an import runs late,
and the order it depends on is written nowhere. So this reads every import of every
module with ``ast``, at any depth (functions and conditionals included), and fails on
any cycle, naming each import of it with its file and line.

The graph is the installed package's: ``tf_adacomp/`` and, through pyproject.toml's
``package-dir``, ``examples/`` as ``tf_adacomp.examples``. An import of a package's
submodule counts as an edge to that submodule; the parent packages it loads on the way
do not (every submodule would otherwise be in a cycle with ``tf_adacomp/__init__.py``),
but an explicit ``import tf_adacomp`` does.
"""

import ast
import pathlib
import tomllib
from typing import Dict, List, NamedTuple, Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "tf_adacomp"


class Edge(NamedTuple):
  """One import: ``source`` imports ``target`` at ``path:line``."""
  source: str
  target: str
  path: str
  line: int


def package_dirs(root: pathlib.Path) -> Dict[str, pathlib.Path]:
  """``{package: directory}``: tf_adacomp and the ones pyproject.toml maps elsewhere."""
  config = tomllib.loads((root / "pyproject.toml").read_text())
  mapped = config["tool"]["setuptools"].get("package-dir", {})
  dirs = {PACKAGE: root / PACKAGE}
  dirs.update({name: root / folder for name, folder in mapped.items()
               if name.startswith(PACKAGE + ".")})
  return dirs


def modules(root: pathlib.Path) -> Dict[str, pathlib.Path]:
  """``{dotted module name: file}`` of every module of the package."""
  found = {}
  for package, folder in package_dirs(root).items():
    for path in sorted(folder.rglob("*.py")):
      parts = list(path.relative_to(folder).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts.pop()
      name = ".".join([package, *parts])
      found.setdefault(name, path)  # a mapped package wins over a stray copy inside
  return found


def _resolve(name: str, known) -> Optional[str]:
  """The longest prefix of ``name`` that is a module of the package (None: not ours)."""
  parts = name.split(".")
  while parts:
    candidate = ".".join(parts)
    if candidate in known:
      return candidate
    parts.pop()
  return None


def imports_of(module: str, path: pathlib.Path, known, root: pathlib.Path) -> List[Edge]:
  """Every import of the package's modules in ``path``, at any depth."""
  is_package = path.name == "__init__.py"
  edges = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    names = []
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # relative: from the module's own package
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        origin = ".".join(base + ([node.module] if node.module else []))
      else:
        origin = node.module or ""
      # ``from package import name``: the submodule ``name`` if there is one.
      names = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin
               for alias in node.names]
    for name in names:
      target = _resolve(name, known)
      if target is not None and target != module:
        edges.append(Edge(module, target, str(path.relative_to(root)), node.lineno))
  return edges


def import_graph(root: pathlib.Path = ROOT) -> Dict[str, List[Edge]]:
  """``{module: the imports it makes of the package's modules}``."""
  known = modules(root)
  return {module: imports_of(module, path, known, root) for module, path in known.items()}


def cycles(graph: Dict[str, List[Edge]]) -> List[List[Edge]]:
  """Cycles of ``graph``, each as its edges: in every strongly connected component of
  more than one module (Tarjan's algorithm), shortest cycles through its modules, the
  short ones first, each showing an import not shown before; so every module caught in
  a cycle is named, and the imports that close the cycles too."""
  index, low, stack, on_stack, components = {}, {}, [], set(), []

  def visit(module):  # recursion depth: at most the number of modules
    index[module] = low[module] = len(index)
    stack.append(module)
    on_stack.add(module)
    for edge in graph[module]:
      if edge.target not in index:
        visit(edge.target)
        low[module] = min(low[module], low[edge.target])
      elif edge.target in on_stack:
        low[module] = min(low[module], index[edge.target])
    if low[module] == index[module]:
      component = set()
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.add(member)
        if member == module:
          break
      if len(component) > 1:
        components.append(component)

  for module in sorted(graph):
    if module not in index:
      visit(module)
  found = []
  for component in components:
    shown = set()
    through = [_cycle_through(graph, component, start) for start in sorted(component)]
    for cycle in sorted(through, key=len):  # short ones first; each adds an import
      if not set(cycle) <= shown:
        shown.update(cycle)
        found.append(cycle)
  return found


def _cycle_through(graph, component, start) -> List[Edge]:
  """A shortest cycle through ``start`` inside its strongly connected ``component``,
  by breadth-first search."""
  came_from = {start: None}
  frontier = [start]
  while frontier:
    following = []
    for module in frontier:
      for edge in graph[module]:
        if edge.target == start:
          path = [edge]
          while came_from[path[0].source] is not None:
            path.insert(0, came_from[path[0].source])
          return path
        if edge.target in component and edge.target not in came_from:
          came_from[edge.target] = edge
          following.append(edge.target)
    frontier = following
  raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def _describe(cycle: List[Edge]) -> str:
  return "\n".join(f"  {e.source} -> {e.target}  ({e.path}:{e.line})" for e in cycle)


def test_the_package_has_no_import_cycle():
  found = cycles(import_graph())
  if found:
    pytest.fail("Import cycles between tf_adacomp modules (make each dependency go one "
                "way, e.g. move what both modules need to a module below them):\n"
                + "\n\n".join(_describe(c) for c in found), pytrace=False)


# --- The checker itself -------------------------------------------------------------------


def _graph(text_of: Dict[str, str], tmp_path) -> Dict[str, List[Edge]]:
  """The import graph of a package ``tf_adacomp`` made of ``{relative path: source}``."""
  for relative, text in text_of.items():
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  (tmp_path / "pyproject.toml").write_text("[tool.setuptools]\npackages = []\n")
  return import_graph(tmp_path)


def test_a_function_level_import_closing_a_cycle_is_found(tmp_path):
  graph = _graph({
      "tf_adacomp/__init__.py": "from tf_adacomp.sub import a\n",
      "tf_adacomp/sub/__init__.py": "",
      "tf_adacomp/sub/a.py": "from tf_adacomp.sub import b\n",
      "tf_adacomp/sub/b.py": "def f():\n  from . import a\n  return a\n",
  }, tmp_path)
  (cycle,) = cycles(graph)
  assert [(e.source, e.target) for e in cycle] == [
      ("tf_adacomp.sub.a", "tf_adacomp.sub.b"), ("tf_adacomp.sub.b", "tf_adacomp.sub.a")]
  assert cycle[1].path == "tf_adacomp/sub/b.py" and cycle[1].line == 2


def test_an_explicit_import_of_the_package_counts_and_parents_do_not(tmp_path):
  graph = _graph({
      "tf_adacomp/__init__.py": "from tf_adacomp import c\nfrom tf_adacomp import d\n",
      "tf_adacomp/c.py": "import tf_adacomp.d\n",
      "tf_adacomp/d.py": "def version():\n  import tf_adacomp\n  return tf_adacomp\n",
  }, tmp_path)
  cycle = cycles(graph)[0]  # the shortest; another goes through c
  assert {e.source for e in cycle} == {"tf_adacomp", "tf_adacomp.d"}
  assert [e.target for e in graph["tf_adacomp.c"]] == ["tf_adacomp.d"]  # not tf_adacomp


def test_one_way_imports_are_no_cycle(tmp_path):
  graph = _graph({
      "tf_adacomp/__init__.py": "from tf_adacomp import top\n",
      "tf_adacomp/top.py": "from tf_adacomp import low\nimport tf_adacomp.low as l\n",
      "tf_adacomp/low.py": "import os\nimport tensorflow\n",
  }, tmp_path)
  assert cycles(graph) == []
