"""Puts benchmarks/ on ``sys.path`` (its scripts import each other by plain name)."""

import os
import sys

BENCHMARKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                              "benchmarks")
BENCHMARKS_DIR = os.path.normpath(BENCHMARKS_DIR)
if BENCHMARKS_DIR not in sys.path:
  sys.path.insert(0, BENCHMARKS_DIR)


def run_script(script, *flags, env=None, timeout=600):
  """Runs ``benchmarks/<script>`` with ``flags`` (output captured); returns the
  completed process and its process id."""
  import subprocess  # pylint: disable=g-import-not-at-top
  with subprocess.Popen([sys.executable, os.path.join(BENCHMARKS_DIR, script), *flags],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        env=env) as process:
    try:
      stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      process.kill()
      raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout,
                                       stderr), process.pid


def namespaces_of(pid):
  """The network namespaces that process ``pid`` made with ``netns.LimitedNetwork`` (its
  tag, ``tfac<pid>``, then a letter) and that still exist. Not every ``tfac`` name: a
  test running beside it in another process may hold namespaces of its own."""
  import re  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  return [name for name in re.findall(r"^(\S+)", listed, re.M)
          if re.fullmatch(rf"tfac{pid}[a-z]\w*", name)]
