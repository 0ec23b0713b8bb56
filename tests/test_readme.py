"""README stays true: its set-up commands (CI runs the second) and its Python snippets."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _setup_commands():
  block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
  return [line for line in block.splitlines() if line.strip()]


def _python_snippets():
  return re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_opens_with_two_setup_commands():
  commands = _setup_commands()
  assert len(commands) == 2
  assert "dataset-fashion-mnist" in commands[0] and "tf-adacomp demo" in commands[0]
  assert "pytest --full" in commands[1]  # the whole suite, not only the fast tier


def test_ci_runs_both_readme_commands_in_order():
  """CI runs the first command (the main job), then the second (the tests), verbatim."""
  lines = (ROOT / ".ci" / "run").read_text().splitlines()
  first, second = _setup_commands()
  assert first in lines and second in lines
  assert lines.index(first) < lines.index(second)
  commands = [line for line in lines if line.strip() and not line.lstrip().startswith(("#", "set ", "cd "))]
  assert commands == [first, second], "CI runs something besides the README's commands"


def test_console_script_is_declared():
  assert 'tf-adacomp = "tf_adacomp.cli:main"' in (ROOT / "pyproject.toml").read_text()


def test_every_python_block_of_the_readme_is_run():
  """The snippets below are found by their fence: one that _python_snippets misses (another
  tag, an indented fence) would go untested, and none at all would leave an empty
  parametrization, which pytest skips rather than fails."""
  fences = re.findall(r"^\s*```(\S*)\s*$", README, re.M)
  assert len(fences) % 2 == 0, fences
  tags = fences[0::2]  # opening fences (closing ones carry no tag)
  assert not any(fences[1::2]), fences
  assert set(tags) <= {"bash", "python"}, tags
  assert len(_python_snippets()) == tags.count("python") >= 5


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_python_snippets())))
def test_python_snippet_runs(index, tmp_path):
  """Each snippet as a user would paste it: a fresh Python process, no TF_CONFIG."""
  env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
  env["TF_CPP_MIN_LOG_LEVEL"] = "3"
  result = subprocess.run([sys.executable, "-c", _python_snippets()[index]], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
