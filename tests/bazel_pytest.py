"""Runs one test file under pytest: the ``main`` of the Bazel ``py_test`` targets (BUILD).

Every test of the file runs (``--full``), in this one process: Bazel runs one target per
file, so pyproject.toml's ``-n 2`` (pytest-xdist, not a Bazel requirement) is dropped.
"""

import sys

import pytest

if __name__ == "__main__":
  sys.exit(pytest.main([*sys.argv[1:], "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                        "--full"]))
