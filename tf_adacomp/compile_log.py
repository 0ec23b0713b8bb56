"""One log line when a compressed step starts compiling its XLA kernels, one when done.

The first compressed step compiles one XLA program per kernel and static setting
(``ops.compiled.kernel``): tens of seconds on CPU for a small model, during which nothing
else tells the user why the first step stalls. ``FirstCompile`` counts the
programs a step's tracing created and logs (``tf_adacomp.log``, at INFO):

- eager (the kernels compiled while the step ran): one line with their number and the
  time since ``start()``;
- traced in a ``tf.function`` (Keras' ``model.fit``, custom loops): a line when tracing
  ends (compilation starts with the function's first run), then a daemon thread waits
  for ``done()`` to turn true (a step counter moved: the first step, compilation
  included, is over) and logs how long it took. It gives up silently after
  ``GIVE_UP_S``.

Only the count of the kernel cache is read (``functools.lru_cache.cache_info``); nothing
runs in the step itself.
"""

import threading
import time

import tensorflow as tf

from tf_adacomp import log
from tf_adacomp.ops import compiled

POLL_S = 0.5
GIVE_UP_S = 3600.0


def programs() -> int:
  """How many XLA programs (kernels and static settings) this process has created."""
  return compiled.programs()


class FirstCompile:
  """Logs the compilation of the first compressed step of one object.

  Args:
    what: who compiles, for the message ("CompressedOptimizer").
    done: a callable, true once the first step has run (read from another thread).
  """

  def __init__(self, what: str, done):
    self.what = what
    self._done = done
    self._programs = None
    self._started = None
    self.thread = None  # the waiting thread, if any (tests join it)

  @tf.autograph.experimental.do_not_convert
  def start(self):
    """Before the first step's kernels are created (tracing or eager)."""
    if self._programs is None:
      self._programs = programs()
      self._started = time.monotonic()

  @tf.autograph.experimental.do_not_convert
  def traced(self):
    """After the first step's kernels were created; logs once."""
    if self._programs is None or self._started is None:
      return
    count = programs() - self._programs
    started, self._started = self._started, None
    if count <= 0:
      return
    if tf.executing_eagerly():
      log.info("%s compiled %d XLA programs for its first compressed "
                     "step in %.1f s.", self.what, count, time.monotonic() - started)
      return
    log.info("%s's first compressed step compiles %d XLA programs "
                   "(once per bucket or shape; seconds to tens of seconds on CPU)...", self.what, count)
    if not tf.compat.v1.executing_eagerly_outside_functions():
      return  # TF1 graph mode: nothing to wait on from here
    begun = time.monotonic()
    self.thread = threading.Thread(target=self._wait, args=(count, begun), daemon=True,
                                   name="tf_adacomp_compile_log")
    self.thread.start()

  def _wait(self, count, begun):
    while time.monotonic() - begun < GIVE_UP_S:
      try:
        if self._done():
          log.info("%s compiled %d XLA programs and ran its first "
                         "compressed step in %.1f s.", self.what, count,
                         time.monotonic() - begun)
          return
      except Exception:  # pylint: disable=broad-except
        return  # the object is gone (or never ran): no line rather than a traceback
      time.sleep(POLL_S)
