"""Runs one test file under pytest: the ``main`` of the Bazel ``py_test`` targets (BUILD)."""

import sys

import pytest

if __name__ == "__main__":
  sys.exit(pytest.main([*sys.argv[1:], "-q", "-p", "no:cacheprovider"]))
