"""Independent NumPy reference for Adasum (docs/algorithms.md#adasum); imports nothing of
tf_adacomp. The tree is built level by level from neighbouring pairs, not by halving as
the library does, so the two agree only if both follow the documented order."""

import numpy as np


def np_pair(a, b):
  """Adasum of two arrays, in float64, written from the paper's formula."""
  a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
  dot, aa, bb = a @ b, a @ a, b @ b
  ca = 1.0 if aa == 0 else 1.0 - dot / (2.0 * aa)
  cb = 1.0 if bb == 0 else 1.0 - dot / (2.0 * bb)
  return ca * a + cb * b


def np_adasum(values):
  """The documented order: fold replicas beyond the largest power of two, then halves."""
  values = [np.asarray(v, np.float64).ravel() for v in values]
  power = 1
  while power * 2 <= len(values):
    power *= 2
  level = [np_pair(values[i], values[power + i]) if power + i < len(values) else values[i]
           for i in range(power)]
  while len(level) > 1:  # pairs of neighbours, level by level: the same as halving
    level = [np_pair(level[j], level[j + 1]) for j in range(0, len(level), 2)]
  return level[0]
