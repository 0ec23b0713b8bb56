"""One XLA-compiled ``tf.function`` per kernel and static setting."""

import functools

import tensorflow as tf

from tf_adacomp.ops import variant


def kernel(fn, **static):
  """``fn`` with its static arguments (bin size, capacity, shape, dtype) bound, compiled
  with XLA. Each traces once per input signature and device, so retracing warnings still
  mean something; the cache keeps compiled programs alive across calls. A form forced
  with ``variant.forced`` gets programs of its own (a trace keeps the form it was built
  in)."""
  return _kernel(fn, variant.forced_form(), **static)


@functools.lru_cache(maxsize=None)
def _kernel(fn, form, **static):
  del form  # part of the cache key only
  return tf.function(functools.partial(fn, **static), jit_compile=True, autograph=False)


def programs() -> int:
  """How many compiled kernels (kernel, static setting and form) this process made."""
  return _kernel.cache_info().currsize
