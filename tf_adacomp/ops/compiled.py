"""One XLA-compiled ``tf.function`` per kernel and static setting, traced once per input
signature for every device of a graph."""

import functools

import tensorflow as tf

from tf_adacomp.ops import variant


def kernel(fn, **static):
  """``fn`` with its static arguments (bin size, capacity, shape, dtype) bound, compiled
  with XLA. The cache keeps compiled programs alive across calls. A form forced with
  ``variant.forced`` gets programs of its own (a trace keeps the form it was built in).

  Under a distribution strategy ``tf.function`` traces a function once per device (the
  device is part of its cache key), though a kernel's trace names no device: its ops run
  where its call is placed. A step of 4 replicas traced every kernel 4 times, and the
  kernels' traces were about a quarter of the time spent building steps. Here, in a
  graph, a kernel called with tensors is traced once per input signature, and every
  device calls that trace (tests/ops/test_compiled.py); eagerly, ``tf.function``
  decides as before."""
  return _kernel(fn, variant.forced_form(), **static)


@functools.lru_cache(maxsize=None)
def _kernel(fn, form, **static):
  del form  # part of the cache key only

  # The static arguments are bound here, not in the signature: a concrete function takes
  # the tensors alone.
  def bound(*tensors):
    return fn(*tensors, **static)

  bound.__name__ = fn.__name__  # the name in the graph and in XLA's logs

  return _SharedTrace(tf.function(bound, jit_compile=True, autograph=False))


class _SharedTrace:
  """A ``tf.function`` whose graph-mode traces are shared by every device."""

  def __init__(self, function):
    self.function = function
    self._traces = {}  # input signature -> concrete function

  def __call__(self, *args):
    flat = tf.nest.flatten(args)
    if tf.executing_eagerly() or not all(_graph_tensor(t) for t in flat):
      return self.function(*args)
    key = (repr(tf.nest.map_structure(lambda _: None, args)),
           tuple((t.dtype, tuple(t.shape.as_list()) if t.shape.rank is not None else None)
                 for t in flat))
    if key not in self._traces:
      self._traces[key] = self.function.get_concrete_function(*args)
    return self._traces[key](*args)


def _graph_tensor(value) -> bool:
  """A symbolic tensor (not a variable, not a Python value): what a shared trace takes."""
  return isinstance(value, tf.Tensor) and not isinstance(value, tf.Variable) and hasattr(
      value, "graph")


def programs() -> int:
  """How many compiled kernels (kernel, static setting and form) this process made."""
  return _kernel.cache_info().currsize
