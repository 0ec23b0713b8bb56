"""One XLA-compiled ``tf.function`` per kernel and static setting."""

import functools

import tensorflow as tf


@functools.lru_cache(maxsize=None)
def kernel(fn, **static):
  """``fn`` with its static arguments (bin size, capacity, shape, dtype) bound, compiled
  with XLA. Each traces once per input signature, so retracing warnings still mean
  something; the cache keeps compiled programs alive across calls."""
  return tf.function(functools.partial(fn, **static), jit_compile=True, autograph=False)
