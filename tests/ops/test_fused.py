"""The fused element-wise steps against NumPy (eager)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_adacomp.ops import fused


@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
def test_all_finite_matches_numpy(bad):
  rng = np.random.default_rng(0)
  arrays = [rng.standard_normal([7, 3]).astype(np.float32),
            rng.standard_normal([5]).astype(np.float64),
            np.float16(rng.standard_normal([2, 2]))]
  if bad is not None:
    arrays[1][3] = bad
  want = all(np.all(np.isfinite(a)) for a in arrays)
  got = fused.all_finite([tf.constant(a) for a in arrays] + [None])
  assert bool(got) is want


def test_all_finite_of_nothing_is_true():
  assert bool(fused.all_finite([None, None])) and bool(fused.all_finite([]))


@pytest.mark.parametrize("flag", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_add_if_matches_numpy_bit_for_bit(flag, dtype):
  rng = np.random.default_rng(1)
  before = rng.standard_normal([33, 17]).astype(dtype)
  update = (rng.standard_normal([33, 17]) * 1e-3).astype(np.float32)
  got = fused.add_if(tf.constant(flag), tf.constant(before), tf.constant(update)).numpy()
  want = before + update.astype(dtype) if flag else before
  assert got.dtype == dtype
  np.testing.assert_array_equal(got, want)
