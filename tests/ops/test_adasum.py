"""ops.adasum against an independent NumPy reference (docs/algorithms.md#adasum)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_adacomp import ops

from adasum_reference import np_adasum
from adasum_reference import np_pair
import tiers


# The fast tier: 1, 3 (not a power of two) and 8 (three levels of the tree); the others
# (the same tree at other sizes) with --full.
@pytest.mark.parametrize("replicas", tiers.fast_only([1, 2, 3, 4, 5, 8], keep={0, 2, 5}))
def test_matches_numpy_reference(replicas):
  rng = np.random.default_rng(replicas)
  values = rng.standard_normal([replicas, 7, 5]).astype(np.float32)
  result = ops.adasum_reduce(values).numpy()
  assert result.shape == (7, 5) and result.dtype == np.float32
  np.testing.assert_allclose(result, np_adasum(values).reshape(7, 5).astype(np.float32),
                             rtol=1e-6, atol=1e-6)
  # A list of tensors is the same as the stacked rows.
  np.testing.assert_array_equal(ops.adasum_reduce(list(values)).numpy(), result)


# The fast tier: 3 and 4 (either kind of tree); 2 and 8 with --full.
@pytest.mark.parametrize("replicas", tiers.fast_only([2, 3, 4, 8], keep={1, 2}))
def test_orthogonal_inputs_add_up(replicas):
  values = np.zeros([replicas, 16], np.float32)
  for r in range(replicas):
    values[r, 2 * r] = r + 1.0
    values[r, 2 * r + 1] = -(r + 0.5)
  np.testing.assert_allclose(ops.adasum_reduce(values).numpy(), values.sum(0), rtol=1e-6)


# The fast tier: 3 and 4 (either kind of tree); 2, 5 and 8 with --full.
@pytest.mark.parametrize("replicas", tiers.fast_only([2, 3, 4, 5, 8], keep={1, 2}))
def test_equal_inputs_average(replicas):
  g = np.random.default_rng(0).standard_normal([10, 3]).astype(np.float32)
  np.testing.assert_allclose(ops.adasum_reduce(np.stack([g] * replicas)).numpy(), g, rtol=1e-6)


def test_zero_vectors():
  g = np.array([1.0, -2.0, 3.0], np.float32)
  zero = np.zeros(3, np.float32)
  np.testing.assert_array_equal(ops.adasum_reduce(np.stack([zero, g])).numpy(), g)
  np.testing.assert_array_equal(ops.adasum_reduce(np.stack([g, zero])).numpy(), g)
  np.testing.assert_array_equal(ops.adasum_reduce(np.stack([zero, zero, zero])).numpy(), zero)
  # Tiny but non-zero gradients still average with their equals (Horovod's 1e-8 would add).
  tiny = np.full(4, 1e-6, np.float32)
  np.testing.assert_allclose(ops.adasum_reduce(np.stack([tiny, tiny])).numpy(), tiny, rtol=1e-6)


def test_tree_order():
  assert ops.adasum_tree(1) == 0
  assert ops.adasum_tree(2) == (0, 1)
  assert ops.adasum_tree(3) == ((0, 2), 1)
  assert ops.adasum_tree(4) == ((0, 1), (2, 3))
  assert ops.adasum_tree(6) == (((0, 4), (1, 5)), (2, 3))
  assert ops.adasum_tree(8) == (((0, 1), (2, 3)), ((4, 5), (6, 7)))
  # Adasum is not associative: the order matters, and it is the documented one.
  rng = np.random.default_rng(3)
  a, b, c, d = rng.standard_normal([4, 50]).astype(np.float32)
  got = ops.adasum_reduce(np.stack([a, b, c, d])).numpy()
  np.testing.assert_allclose(got, np_pair(np_pair(a, b), np_pair(c, d)), rtol=1e-6, atol=1e-6)
  chain = np_pair(np_pair(np_pair(a, b), c), d)
  assert np.abs(got - chain).max() > 1e-3
  got3 = ops.adasum_reduce(np.stack([a, b, c])).numpy()
  np.testing.assert_allclose(got3, np_pair(np_pair(a, c), b), rtol=1e-6, atol=1e-6)


def test_float64_accumulation_and_dtypes():
  # A dot product whose small terms float32 accumulation would drop (1e8 + 0.0655):
  # with float64 values the result keeps them to 1e-12.
  n = 1 << 16
  a = np.full(n, 1e-3, np.float64)
  a[0] = 1e4
  b = a.copy()
  b[1:] *= -1.0
  np.testing.assert_allclose(ops.adasum_reduce(np.stack([a, b])).numpy(), np_adasum([a, b]),
                             rtol=1e-12, atol=1e-15)
  for dtype in (tf.float16, tf.bfloat16, tf.float32):
    values = tf.cast(np.stack([a[:8], b[:8] + 1]), dtype)
    result = ops.adasum_reduce(values)
    assert result.dtype == dtype
    reference = np_adasum(tf.cast(values, tf.float64).numpy())
    np.testing.assert_allclose(tf.cast(result, tf.float64).numpy(), reference, rtol=1e-2)


def test_non_finite_inputs_give_non_finite_results():
  values = np.ones([2, 4], np.float32)
  values[1, 2] = np.nan
  assert not np.isfinite(ops.adasum_reduce(values).numpy()).all()
  values[1, 2] = np.inf
  assert not np.isfinite(ops.adasum_reduce(values).numpy()).all()


def test_bad_arguments_name_the_value():
  with pytest.raises(ValueError, match=r"num_replicas=0"):
    ops.adasum_tree(0)
  with pytest.raises(ValueError, match=r"values=\[\]"):
    ops.adasum_reduce([])
  with pytest.raises(ValueError, match="shape"):
    ops.adasum_reduce(tf.zeros([0, 3]))
  with pytest.raises(TypeError, match="int32"):
    ops.adasum_reduce(tf.zeros([2, 3], tf.int32))
  with pytest.raises(ValueError, match=r"values\[i\]"):
    ops.adasum_reduce([tf.zeros([3]), tf.zeros([4])])
  with pytest.raises(TypeError, match="dtype"):
    ops.adasum_reduce([tf.zeros([3]), tf.zeros([3], tf.float64)])
