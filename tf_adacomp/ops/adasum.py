"""Adasum (Maleki et al., MLSys 2021): adaptive summation of replicas' tensors, with XLA.

For two tensors (docs/algorithms.md#adasum), with dot products and squared norms taken
over the whole tensor and accumulated in float64:

    Adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

Orthogonal tensors add up, equal tensors average, and a coefficient is 1 where its
squared norm is 0 (then that tensor is zero and the other passes through unchanged).
Horovod treats squared norms below 1e-8 as zero; here the test is exactly 0, because a
float64 sum of squares of float16/32 values cannot underflow, and a small but non-zero
gradient (a layer with tiny weights) must still average with its equals rather than add.

Several replicas combine along a binary tree:
``Adasum(g[0:n]) = Adasum(Adasum(g[0:n/2]), Adasum(g[n/2:n]))`` for ``n = 2^j``, the
order of Horovod's recursive halving. Horovod refuses other replica counts. Here, with
``n = 2^j + r`` (``0 < r < 2^j``), the ``r`` extra replicas are folded in first:
replica ``2^j + i`` is combined into replica ``i`` (``i < r``), then the ``2^j`` results
go through the tree. Equal inputs still average and orthogonal inputs still add up, for
any ``n``; every replica evaluates the same tree on the same values in the same order,
so all get bit-identical results.

The sum of pairs is also evaluated in float64 and rounded once to the inputs' dtype.
"""

from typing import List, Sequence, Union

import tensorflow as tf

from tf_adacomp.ops import checks
from tf_adacomp.ops import compiled

Tree = Union[int, tuple]


def adasum_tree(num_replicas: int) -> Tree:
  """The order of combination for ``num_replicas`` values, as nested pairs of indices.

  For example ``adasum_tree(4) == ((0, 1), (2, 3))`` and
  ``adasum_tree(3) == ((0, 2), 1)`` (replica 2 folded into replica 0 first).

  Args:
    num_replicas: int >= 1.

  Returns:
    An int (one replica) or a pair ``(left, right)`` of subtrees.

  Raises:
    ValueError: ``num_replicas`` is not an integer >= 1.
  """
  n = checks.positive_int(num_replicas, "num_replicas")
  power = 1 << (n.bit_length() - 1)  # the largest power of two <= n
  leaves: List[Tree] = [(i, power + i) if power + i < n else i for i in range(power)]

  def halves(items):
    if len(items) == 1:
      return items[0]
    middle = len(items) // 2
    return (halves(items[:middle]), halves(items[middle:]))

  return halves(leaves)


def _pair(a, b):
  """Adasum of two flat float64 tensors."""
  dot = tf.reduce_sum(a * b)
  a_sq, b_sq = tf.reduce_sum(a * a), tf.reduce_sum(b * b)
  # divide_no_nan: a zero norm gives 0 (coefficient 1) rather than 0/0; NaN and inf
  # inputs still give NaN, so callers' finiteness checks see them.
  a_coeff = 1.0 - 0.5 * tf.math.divide_no_nan(dot, a_sq)
  b_coeff = 1.0 - 0.5 * tf.math.divide_no_nan(dot, b_sq)
  return a_coeff * a + b_coeff * b


def _combine(values, tree: Tree):
  if isinstance(tree, int):
    return values[tree]
  return _pair(_combine(values, tree[0]), _combine(values, tree[1]))


def _adasum(stacked, tree: Tree):
  rows = tf.cast(tf.reshape(stacked, [int(stacked.shape[0]), -1]), tf.float64)
  values = [rows[i] for i in range(int(stacked.shape[0]))]
  total = _combine(values, tree)
  return tf.reshape(tf.cast(total, stacked.dtype), stacked.shape[1:])


def adasum_reduce(values: Union[tf.Tensor, Sequence[tf.Tensor]]) -> tf.Tensor:
  """Combines replicas' tensors with Adasum along the tree of ``adasum_tree``.

  Args:
    values: a float tensor ``[replicas, ...]`` (one row per replica, in replica order),
      or a list of same-shape float tensors.

  Returns:
    A tensor of the rows' shape and dtype: equal rows give their mean, orthogonal rows
    their sum. Non-finite inputs give a non-finite result.

  Raises:
    TypeError: the values are not floating-point.
    ValueError: no values, shapes differ, or shapes are not static.
  """
  if isinstance(values, (list, tuple)):
    if not values:
      raise ValueError("`values` must hold at least one tensor. Received: values=[]")
    values = [checks.float_tensor(v, "values") for v in values]
    for v in values[1:]:
      checks.same_shape(values[0], v, "values[0]", "values[i]")
      if v.dtype != values[0].dtype:
        raise TypeError(f"`values` must share one dtype. Received: {values[0].dtype.name} "
                        f"and {v.dtype.name}")
    values = tf.stack(values)
  else:
    values = checks.float_tensor(values, "values")
    if values.shape.rank == 0 or values.shape[0] == 0:
      raise ValueError(f"`values` must be [replicas, ...] with at least one replica. "
                       f"Received: values with shape {values.shape}")
  replicas = int(values.shape[0])
  if replicas == 1:
    return values[0]
  return compiled.kernel(_adasum, tree=adasum_tree(replicas))(values)
