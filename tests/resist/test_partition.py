"""ResIST partitions: the same table on every replica, every block covered, balanced."""

import numpy as np
import pytest

from tf_adacomp import resist
from tf_adacomp.resist import partition


@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("stages", [(2, 2, 2), (8, 8, 8), (0, 3, 5), (1, 1, 1)])
def test_every_block_has_exactly_one_holder_and_every_stage_is_balanced(replicas, stages):
  for round_index in range(20):
    held = resist.deal(stages, replicas, round_index, seed=3)
    assert held.shape == (replicas, sum(stages)) and held.dtype == bool
    np.testing.assert_array_equal(held.sum(axis=0), 1)
    start = 0
    for count in stages:  # a floor-or-ceil share of every stage
      share = held[:, start:start + count].sum(axis=1)
      assert set(share) <= {count // replicas, -(-count // replicas)}
      start += count
    assert held.sum(axis=1).max() - held.sum(axis=1).min() <= 1


def test_every_replica_deals_the_same_table_from_the_seed_and_round():
  # Each replica computes its table on its own (a fresh call): no communication needed.
  tables = [resist.deal((5, 5, 5), 4, 7, seed=11) for _ in range(4)]
  for table in tables[1:]:
    np.testing.assert_array_equal(table, tables[0])
  rounds = {resist.deal((5, 5, 5), 4, r, seed=11).tobytes() for r in range(10)}
  assert len(rounds) == 10  # a new partition every round
  assert not np.array_equal(resist.deal((5, 5, 5), 4, 7, seed=12), tables[0])


def test_min_blocks_adds_random_extra_blocks():
  stages = (3, 3, 3)
  for round_index in range(20):
    held = resist.deal(stages, 4, round_index, seed=0, min_blocks=4)
    assert held.sum(axis=1).min() >= 4
    assert held.sum(axis=0).min() >= 1  # still every block held
    plain = resist.deal(stages, 4, round_index, seed=0)
    assert np.all(held[plain])  # the dealt blocks stay; extras come on top
  assert resist.deal(stages, 4, 0, min_blocks=9).all()


def test_local_sgd_table_and_inference_scale():
  assert partition.everything(6, 3).all() and partition.everything(6, 3).shape == (3, 6)
  assert resist.inference_scale(4, 6) == 0.25
  assert resist.inference_scale(4, 6, min_blocks=3) == 0.5  # max(1/S, min/num)
  assert resist.inference_scale(2, 0) == 1.0
  assert resist.inference_scale(1, 6) == 1.0


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(replicas=0), ValueError, "replicas=0"),
    (dict(round_index=-1), ValueError, "round_index=-1"),
    (dict(seed=-2), ValueError, "seed=-2"),
    (dict(min_blocks=7), ValueError, "min_blocks=7"),
    (dict(replicas=2.0), TypeError, "replicas=2.0"),
    (dict(blocks_per_stage=(2, -1)), ValueError, r"blocks_per_stage=\(2, -1\)"),
    (dict(blocks_per_stage="22"), TypeError, "blocks_per_stage='22'"),
])
def test_bad_arguments_are_named(kwargs, error, match):
  arguments = dict(blocks_per_stage=(2, 2, 2), replicas=2, round_index=0, seed=0)
  arguments.update(kwargs)
  with pytest.raises(error, match=match):
    resist.deal(**arguments)
  if "min_blocks" in kwargs:
    with pytest.raises(ValueError, match="min_blocks=7"):
      resist.inference_scale(2, 6, min_blocks=7)
