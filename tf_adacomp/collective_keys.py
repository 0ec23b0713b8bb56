"""The whole collective key space of a process: which group keys belong to whom.

TensorFlow's collectives (a strategy's, and the ``CollectiveReduceV2`` and
``CollectiveGatherV2`` of ``hierarchy.Hierarchy``) name their group by an int32 group
key. The runtime keeps the size and devices it first saw under a key for the whole
process: one key used by two groups of different devices aborts every later collective
of the process ("joining a group with size 2, but that group has size 3 (group_key=1)"),
and one key reused with another shape fails ("Shape mismatch in the collective instance
100"). Instance keys are resolved within their group, so only group keys need ranges of
their own; each owner counts its instance keys itself (a strategy from 100 up, a
hierarchy from a counter per group and member).

The group keys are cut into blocks of ``KEY_BLOCK`` (100,000) keys:

- block 0, keys 1 .. 99,999: TensorFlow's own numbering, from 1 up: a
  ``MultiWorkerMirroredStrategy`` (its workers must agree on its keys; a process makes
  one), a ``CollectiveAllReduce`` made by hand, a ``MirroredStrategy`` made before
  tf_adacomp was imported;
- block b (1 .. ``BLOCKS``), lower half, keys b * 100,000 + 1 .. b * 100,000 + 49,999
  (``STRATEGY_KEYS``): a ``MirroredStrategy`` (v2 or v1) made after the import, whose
  base is b * 100,000 (``next_strategy_key_base``, installed by ``tf_adacomp.distribute``):
  its groups count up from the base + 1, one per set of devices its collectives span (a
  few);
- block b, upper half, keys b * 100,000 + 50,000 (``HIERARCHY_OFFSET``) .. b * 100,000 +
  99,999: a ``hierarchy.Hierarchy`` (``next_hierarchy_key_base``): its local groups base
  .. base + workers - 1, one per worker, and its leaders' group base + workers (at most
  ``MAX_HIERARCHY_WORKERS`` workers).

The n-th strategy of the process (n = 1, 2, ...) takes block ``n % BLOCKS + 1``, the
n-th hierarchy (n = 0, 1, ...) block ``n % BLOCKS + 1`` too: each in its own half, so a
strategy and a hierarchy never share a key, whatever their numbers. After ``BLOCKS``
(20,000) of either, the blocks are used again (the oldest owner's keys are reused: group
keys are int32, and the last block ends at 2,000,099,999 < 2**31). TensorFlow's own
tests space their strategies' keys the same way
(tensorflow/python/distribute/strategy_combinations.py).

The workers of a multi-worker job must agree on their keys: the strategy keeps
TensorFlow's (block 0), and every worker makes its hierarchies in the same order (one
per optimizer), so the hierarchy counter below gives each the same keys on every worker.
"""

import itertools
from typing import List, NamedTuple

KEY_BLOCK = 100_000  # group keys per block
BLOCKS = 20_000  # blocks 1 .. BLOCKS are handed out; block 0 is TensorFlow's
HIERARCHY_OFFSET = 50_000  # a hierarchy's keys start this far into its block
# A hierarchy of w workers uses keys base .. base + w: all of them inside its block.
MAX_HIERARCHY_WORKERS = KEY_BLOCK - HIERARCHY_OFFSET - 1
# A strategy's groups: base + 1 .. base + STRATEGY_KEYS, below every hierarchy's.
STRATEGY_KEYS = HIERARCHY_OFFSET - 1
INT32_MAX = 2**31 - 1

_strategies = itertools.count(1)  # the first MirroredStrategy gets block 2, as before
_hierarchies = itertools.count()


def next_strategy_key_base() -> int:
  """The base of the next ``MirroredStrategy``: its first group key, minus one.

  ``compat.internals.own_collective_keys_per_strategy`` calls it once per strategy (v2
  and v1 share the counter, so they get different blocks too).
  """
  return (next(_strategies) % BLOCKS + 1) * KEY_BLOCK


def next_hierarchy_key_base() -> int:
  """The first group key of the next ``hierarchy.Hierarchy`` (its first worker's local
  group); the hierarchy uses this key up to this key + its number of workers."""
  return (next(_hierarchies) % BLOCKS + 1) * KEY_BLOCK + HIERARCHY_OFFSET


class KeyRange(NamedTuple):
  """Group keys ``first .. last`` (both included), and who uses them."""
  owner: str
  first: int
  last: int


def key_ranges() -> List[KeyRange]:
  """Every range of the key space (see the module doc), in key order: TensorFlow's block
  0, then for every block its strategy's half and its hierarchy's half."""
  ranges = [KeyRange("tensorflow", 1, KEY_BLOCK - 1)]
  for block in range(1, BLOCKS + 1):
    base = block * KEY_BLOCK
    ranges.append(KeyRange("strategy", base + 1, base + STRATEGY_KEYS))
    ranges.append(KeyRange("hierarchy", base + HIERARCHY_OFFSET,
                           base + HIERARCHY_OFFSET + MAX_HIERARCHY_WORKERS))
  return ranges


# The ranges do not overlap, and every key is an int32 (key_ranges lists them all;
# tests/test_collective_keys.py walks it): a strategy's keys end below its block's
# hierarchy's, which end below the next block, and the last block ends below 2**31.
assert STRATEGY_KEYS < HIERARCHY_OFFSET
assert HIERARCHY_OFFSET + MAX_HIERARCHY_WORKERS < KEY_BLOCK
assert BLOCKS * KEY_BLOCK + KEY_BLOCK - 1 <= INT32_MAX
