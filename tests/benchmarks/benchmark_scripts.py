"""Puts benchmarks/ on ``sys.path`` (its scripts import each other by plain name)."""

import os
import sys

BENCHMARKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                              "benchmarks")
BENCHMARKS_DIR = os.path.normpath(BENCHMARKS_DIR)
if BENCHMARKS_DIR not in sys.path:
  sys.path.insert(0, BENCHMARKS_DIR)
