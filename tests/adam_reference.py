"""Independent NumPy reference for each replica's estimate of the global batch's second
moment (tf_adacomp/shared_moment.py, ``global_moment``); imports nothing of tf_adacomp."""

import numpy as np


def np_global_moment(v, w, replicas, beta_1):
  """G^2 + S / R from v = G^2 + S and w = G^2 + c S, clipped to [v / R, v]."""
  c = (1 - beta_1) / (1 + beta_1)
  signal, noise = (w - c * v) / (1 - c), (v - w) / (1 - c)
  return np.clip(signal + noise / replicas, v / replicas, v)
