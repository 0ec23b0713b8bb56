"""README's set-up commands stay true: CI runs the second one verbatim."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _setup_commands():
  block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
  return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_two_setup_commands():
  commands = _setup_commands()
  assert len(commands) == 2
  assert "tf-adacomp demo" in commands[0]
  assert "pytest tests" in commands[1]


def test_ci_runs_the_readme_test_command():
  ci = (ROOT / ".ci" / "run").read_text()
  assert _setup_commands()[1] in ci.splitlines()


def test_console_script_is_declared():
  assert "tf-adacomp=tf_adacomp.cli:main" in (ROOT / "setup.py").read_text()
