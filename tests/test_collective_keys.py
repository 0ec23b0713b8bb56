"""The collective key space (tf_adacomp/collective_keys.py): the strategies' group keys and
the hierarchies' never overlap, and each owner's keys fall in its own range."""

import pytest
import tensorflow as tf

from tf_adacomp import collective_keys
from tf_adacomp import hierarchy as hierarchy_lib

CPUS = [f"/cpu:{i}" for i in range(2)]


def test_the_ranges_cover_distinct_keys_all_int32():
  ranges = collective_keys.key_ranges()
  assert ranges[0] == ("tensorflow", 1, collective_keys.KEY_BLOCK - 1)
  assert len(ranges) == 1 + 2 * collective_keys.BLOCKS
  for before, after in zip(ranges, ranges[1:]):
    assert before.first <= before.last < after.first, (before, after)
  assert ranges[-1].last <= 2**31 - 1


def _owner(key, ranges=None):
  """The range of ``key`` (keys of no range: None) among ``ranges`` (default: a fresh
  ``collective_keys.key_ranges()``; a test that looks up many keys passes it once)."""
  ranges = collective_keys.key_ranges() if ranges is None else ranges
  found = [r for r in ranges if r.first <= key <= r.last]
  assert len(found) <= 1, found
  return found[0] if found else None


def test_the_bases_handed_out_are_todays_keys_in_their_own_ranges():
  # The same keys as before collective_keys was their one home (training bit-identical,
  # every worker of a job agreeing): the n-th strategy (n = 1, 2, ...) from block
  # n % 20,000 + 1, the n-th hierarchy (n = 0, 1, ...) half-way into that block.
  strategies = collective_keys._strategies  # pylint: disable=protected-access
  hierarchies = collective_keys._hierarchies  # pylint: disable=protected-access
  ranges = collective_keys.key_ranges()  # once: 40,001 ranges
  owner = lambda key: _owner(key, ranges)  # noqa: E731
  try:
    collective_keys._strategies = iter(range(19_998, 20_002))  # pylint: disable=protected-access
    collective_keys._hierarchies = iter(range(19_998, 20_002))  # pylint: disable=protected-access
    for n in range(19_998, 20_002):
      base = collective_keys.next_strategy_key_base()
      assert base == (n % 20_000 + 1) * 100_000
      assert owner(base + 1).owner == "strategy"
      assert owner(base + collective_keys.STRATEGY_KEYS) == owner(base + 1)
      first = collective_keys.next_hierarchy_key_base()
      assert first == (n % 20_000 + 1) * 100_000 + 50_000
      last = first + collective_keys.MAX_HIERARCHY_WORKERS  # the leaders' group
      assert owner(first).owner == "hierarchy" and owner(last) == owner(first)
  finally:
    collective_keys._strategies = strategies  # pylint: disable=protected-access
    collective_keys._hierarchies = hierarchies  # pylint: disable=protected-access


def test_a_strategy_and_a_hierarchy_made_now_use_keys_of_their_own_ranges():
  strategy = tf.distribute.MirroredStrategy(CPUS)
  group = strategy.extended._collective_keys.get_group_key(CPUS)  # pylint: disable=protected-access
  assert _owner(group).owner == "strategy"
  hierarchy = hierarchy_lib.Hierarchy(3, 2)
  low = hierarchy._key_base  # pylint: disable=protected-access
  assert _owner(low).owner == "hierarchy"
  assert _owner(low + hierarchy.workers) == _owner(low)  # the leaders' group


def test_a_hierarchy_with_more_workers_than_its_keys_is_refused():
  too_many = collective_keys.MAX_HIERARCHY_WORKERS + 1
  with pytest.raises(ValueError, match=f"`workers` must be at most {too_many - 1}. "
                                       f"Received: workers={too_many}"):
    hierarchy_lib.Hierarchy(too_many, 1)
