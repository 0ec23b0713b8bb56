"""The suite's own scheduling (tests/conftest.py): the heaviest files start first."""

import pathlib

import conftest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_heavy_file_listed_exists_once():
  # A renamed or removed file would silently fall back to its place in collection order.
  listed = conftest.HEAVY_FILES_FIRST
  assert len(set(listed)) == len(listed), listed
  missing = [path for path in listed if not (ROOT / path).is_file()]
  assert not missing, missing
