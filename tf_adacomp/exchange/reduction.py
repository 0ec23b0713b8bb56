"""How the replicas' decoded contributions combine: ``Reduction``, a sum or their Adasum."""

from typing import List, Sequence

import tensorflow as tf

from tf_adacomp.ops import adasum as adasum_ops


class Reduction:
  """How the replicas' decoded contributions combine: a sum or their Adasum.

  ``combine`` gives a total in the reduction's own units: for "sum" the sum of the
  contributions, for "adasum" their Adasum (equal contributions give their mean,
  orthogonal ones their sum). ``to_sum`` and ``to_mean`` turn that total into what a SUM
  or a MEAN reduction of ``replicas`` contributions should return.
  """

  name: str = ""
  # Whether summable payloads may be added by an all-reduce before decoding.
  sums_payloads: bool = True

  def combine(self, tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """The replicas' contributions combined, in replica order (the same on every replica).

    Args:
      tensors: one decoded tensor per replica, of one shape and dtype.

    Returns:
      Their total, in this reduction's units.
    """
    raise NotImplementedError

  def decode(self, decode_rows, rows: tf.Tensor) -> List[tf.Tensor]:
    """Decodes one bucket's rows and combines them, gradient by gradient.

    Args:
      decode_rows: ``decode_rows(r)`` decodes ``[r, words]`` payload rows of the bucket
        into the sum of their contributions, one tensor per gradient.
      rows: the bucket's ``[replicas, words]`` payload rows.

    Returns:
      One combined total per gradient of the bucket.
    """
    raise NotImplementedError

  def to_sum(self, total, replicas: int):
    """What a SUM reduction of ``replicas`` contributions returns, from ``combine``'s total."""
    raise NotImplementedError

  def to_mean(self, total, replicas: int):
    """What a MEAN reduction of ``replicas`` contributions returns, from ``combine``'s total."""
    raise NotImplementedError

  def __repr__(self):
    return f"Reduction({self.name!r})"


class _Sum(Reduction):
  name = "sum"
  sums_payloads = True

  def combine(self, tensors):
    total = tensors[0]
    for t in tensors[1:]:  # replica order: bit-identical everywhere
      total += t
    return total

  def decode(self, decode_rows, rows):
    return decode_rows(rows)  # the compressor sums the rows in replica order

  def to_sum(self, total, replicas):
    return total

  def to_mean(self, total, replicas):
    return total / replicas


class _Adasum(Reduction):
  name = "adasum"
  sums_payloads = False

  def combine(self, tensors):
    return adasum_ops.adasum_reduce(list(tensors))

  def decode(self, decode_rows, rows):
    per_row = [decode_rows(rows[r:r + 1]) for r in range(int(rows.shape[0]))]
    return [self.combine(list(tensors)) for tensors in zip(*per_row)]

  def to_sum(self, total, replicas):
    return total * replicas

  def to_mean(self, total, replicas):
    return total


SUM = _Sum()
ADASUM = _Adasum()
_REDUCTIONS = {r.name: r for r in (SUM, ADASUM)}
REDUCTIONS = tuple(_REDUCTIONS)  # the names: ("sum", "adasum")


def get_reduction(reduction) -> Reduction:
  """The ``Reduction`` named ``reduction`` ("sum" or "adasum"; a ``Reduction`` passes).

  Raises:
    ValueError: any other value, named in the message.
  """
  if isinstance(reduction, Reduction):
    return reduction
  if isinstance(reduction, str) and reduction in _REDUCTIONS:
    return _REDUCTIONS[reduction]
  raise ValueError(f"`reduction` must be one of {REDUCTIONS}. Received: reduction={reduction!r}")


def check_reduction(reduction) -> str:
  """The name of ``reduction`` ("sum" or "adasum"; a ``Reduction`` gives its name).

  Raises:
    ValueError: any other value, named in the message.
  """
  return get_reduction(reduction).name
