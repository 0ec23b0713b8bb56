"""Which replica trains which residual block in a ResIST round: pure NumPy, no state.

Every replica calls ``deal`` with the same seed and round index and gets the same table:
the partition costs no communication. Blocks are numbered stage by stage (the order of
``model.partitionable_blocks``); the permutation is drawn per stage and the stages are
dealt one after the other, round-robin, from a random first replica, so that every
replica gets a floor-or-ceil share of every stage (blocks of the deeper stages are
larger: a per-stage share balances parameters and compute, not only block counts).
"""

from typing import Sequence

import numpy as np

from tf_adacomp.ops import checks


def _check_stages(blocks_per_stage):
  if isinstance(blocks_per_stage, (str, bytes)) or not hasattr(blocks_per_stage, "__len__"):
    raise TypeError("`blocks_per_stage` must be a sequence of ints. "
                    f"Received: blocks_per_stage={blocks_per_stage!r}")
  for count in blocks_per_stage:
    if not checks.is_int(count) or count < 0:
      raise ValueError("`blocks_per_stage` must hold ints >= 0. "
                       f"Received: blocks_per_stage={blocks_per_stage!r}")
  return [int(c) for c in blocks_per_stage]


def deal(blocks_per_stage: Sequence[int], replicas: int, round_index: int, seed: int = 0,
         min_blocks: int = 0) -> np.ndarray:
  """The partition of one round: which replica holds which partitionable block.

  Args:
    blocks_per_stage: the number of partitionable blocks of each stage, in order (e.g.
      ``(2, 2, 2)`` for ResNet-20: every stage's first block is shared).
    replicas: S, the number of replicas (>= 1).
    round_index: the round (>= 0); with ``seed`` it seeds the permutation.
    seed: a seed shared by all replicas (>= 0).
    min_blocks: the minimum number of partitionable blocks of every sub-ResNet; a replica
      dealt fewer gets random extra blocks (which other replicas also hold). 0 to
      ``sum(blocks_per_stage)``.

  Returns:
    A bool array ``[replicas, num_blocks]``: ``held[r, k]`` is true when replica ``r``
    trains block ``k`` this round. Every block has at least one holder; without
    ``min_blocks``, exactly one.

  Raises:
    TypeError: a count that is not an int, or ``blocks_per_stage`` not a sequence.
    ValueError: a count out of range (named, with the value).
  """
  stages = _check_stages(blocks_per_stage)
  checks.typed_int(replicas, "replicas", 1)
  checks.typed_int(round_index, "round_index", 0)
  checks.typed_int(seed, "seed", 0)
  checks.typed_int(min_blocks, "min_blocks", 0)
  num_blocks = sum(stages)
  if min_blocks > num_blocks:
    raise ValueError(f"`min_blocks` must be <= the number of partitionable blocks "
                     f"({num_blocks}). Received: min_blocks={min_blocks}")
  rng = np.random.default_rng([seed, round_index])
  starts = np.cumsum([0] + stages[:-1])
  order = np.concatenate([start + rng.permutation(count)
                          for start, count in zip(starts, stages)] or [np.zeros(0, int)])
  owner = (rng.integers(replicas) + np.arange(num_blocks)) % replicas
  held = np.zeros([replicas, num_blocks], bool)
  held[owner, order.astype(int)] = True
  for r in range(replicas):  # in replica order: the same draws on every replica
    missing = min_blocks - int(held[r].sum())
    if missing > 0:
      extra = rng.choice(np.flatnonzero(~held[r]), missing, replace=False)
      held[r, extra] = True
  return held


def everything(num_blocks: int, replicas: int) -> np.ndarray:
  """The table of local SGD: every replica holds every block."""
  checks.typed_int(num_blocks, "num_blocks", 0)
  checks.typed_int(replicas, "replicas", 1)
  return np.ones([replicas, num_blocks], bool)


def inference_scale(replicas: int, num_blocks: int, min_blocks: int = 0) -> float:
  """The test-time factor of the partitioned blocks' residual branches.

  ``1/S``: each block was trained in a sub-ResNet holding about ``1/S`` of them; with a
  minimum depth, ``max(1/S, min_blocks / num_blocks)`` (Dun et al. 2022). 1.0 without
  partitionable blocks.

  Raises:
    TypeError, ValueError: a count out of range (named, with the value).
  """
  checks.typed_int(replicas, "replicas", 1)
  checks.typed_int(num_blocks, "num_blocks", 0)
  checks.typed_int(min_blocks, "min_blocks", 0)
  if min_blocks > num_blocks:
    raise ValueError(f"`min_blocks` must be <= num_blocks={num_blocks}. "
                     f"Received: min_blocks={min_blocks}")
  if num_blocks == 0:
    return 1.0
  return max(1.0 / replicas, min_blocks / num_blocks)
