"""The suite's own scheduling (tests/conftest.py): the heaviest files start first."""

import pathlib

import pytest

import conftest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_heavy_file_listed_exists_once():
  # A renamed or removed file would silently fall back to its place in collection order.
  listed = conftest.HEAVY_FILES_FIRST
  assert len(set(listed)) == len(listed), listed
  missing = [path for path in listed if not (ROOT / path).is_file()]
  assert not missing, missing


def test_the_parts_share_out_every_file_once_heaviest_first():
  files = [f"tests/test_{i}.py" for i in range(7)]
  parts = [conftest.files_of_part(files, k, 3) for k in (1, 2, 3)]
  assert sorted(sum(parts, [])) == sorted(files)  # each file in exactly one part
  assert [part[0] for part in parts] == files[:3]  # each part starts with a heavy one
  assert conftest.files_of_part(files, 1, 1) == files


@pytest.mark.parametrize("value", ["0/3", "4/3", "3", "a/b", "1/0", "-1/2"])
def test_a_bad_part_is_refused_naming_it(value):
  with pytest.raises(pytest.UsageError, match=f"Received: --part={value}"):
    conftest.parse_part(value)
