"""The suite's CPU log (tests/conftest.py, ``TF_ADACOMP_CPU_LOG=FILE``): each test's
CPU-seconds, its own process's and those of the processes it started."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import conftest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BURN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass"


def test_a_waited_for_child_counts_as_children_and_a_loop_as_own():
  before = conftest.cpu_seconds()
  subprocess.run([sys.executable, "-c", BURN.format(seconds=0.3)], check=True)
  exec(BURN.format(seconds=0.2), {})  # pylint: disable=exec-used
  after = conftest.cpu_seconds()
  record = json.loads(conftest.cpu_record("t", before, after, 1.0))
  assert record["children"] >= 0.3, record
  assert 0.2 <= record["own"] < 0.3 + 0.2, record  # the child's CPU is not the test's own
  assert record["test"] == "t" and record["pid"] == os.getpid() and record["wall"] == 1.0


@pytest.mark.slow  # a pytest process of its own
def test_the_log_has_a_line_for_each_test_it_ran(tmp_path):
  log = tmp_path / "cpu.jsonl"
  env = dict(os.environ, TF_ADACOMP_CPU_LOG=str(log))
  wanted = f"{pathlib.Path(__file__).name}::test_a_waited_for_child_counts_as_children_and_a_loop_as_own"
  result = subprocess.run(
      [sys.executable, "-m", "pytest", f"tests/{wanted}", "-q", "-n", "0",
       "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300, check=False)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  lines = [json.loads(line) for line in log.read_text().splitlines()]
  assert [line["test"] for line in lines] == [f"tests/{wanted}"]
  assert lines[0]["children"] >= 0.3 and lines[0]["own"] >= 0.2, lines

