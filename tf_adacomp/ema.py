"""The inner optimizer's moving average of the weights (``use_ema=True``), taken after the
exchange.

A Keras optimizer with ``use_ema=True`` updates its moving average of the weights in
``apply``, right after its step, and every ``ema_overwrite_frequency`` steps writes it
into the weights (``finalize_variable_values`` does at the end of ``fit``). Under the
update exchange each replica's inner optimizer steps its own copy of the weights before
the exchange, so that average would follow each replica's own weights: the replicas'
averages, and the weights written from them, would drift apart for good. (And under any
``MirroredStrategy`` Keras' own overwrite fails, Keras 3.15: a ``merge_call`` inside a
``cond``.) Here the inner optimizer's own update and overwrite are held back while the
wrapper runs its step (``deferred``) and carried out after the exchange
(``update_after_exchange``), with either exchange, on the weights every replica holds
then: Keras' average of the weights the replicas share, equal on every replica, and on
one replica Keras' own bit for bit.

The Keras internals read here (keras/src/optimizers/base_optimizer.py, Keras 3.15), each
named once below and checked by tests/test_ema.py: the two methods that ``apply`` calls
for the average (``UPDATE``, ``OVERWRITE``), replaced on the inner optimizer instance (as
the wrapper replaces its all-reduce), and its averages (``AVERAGES``).
"""

import contextlib
import threading

import keras
import tensorflow as tf

from tf_adacomp.compat import patches

UPDATE = "_update_model_variables_moving_average"
OVERWRITE = "_overwrite_model_variables_with_average_value"
AVERAGES = "_model_variables_moving_average"

# Per thread: MirroredStrategy traces each replica's step in a thread of its own, and one
# replica's local step may still be running (waiting in a merge_call) when another's ends.
_state = threading.local()


def _wrap_deferred(original):
  """``original`` (the optimizer's bound method), doing nothing inside ``deferred()``."""

  def hook(*args, **kwargs):
    if getattr(_state, "deferring", False):
      return None
    return original(*args, **kwargs)

  return hook


_MISSING = ("{type} has no `{attribute}` in Keras " + keras.__version__
            + ": tf_adacomp.ema needs updating for it.")

# The instance patches of ``defer`` (``compat.patches``), named by what they replace.
DEFERRED = tuple(f"Optimizer.{name}" for name in (UPDATE, OVERWRITE))
for _name, _attribute in zip(DEFERRED, (UPDATE, OVERWRITE)):
  patches.register(patches.InstancePatch(name=_name, attribute=_attribute,
                                         wrap=_wrap_deferred, missing=_MISSING))
del _name, _attribute


def defer(optimizer) -> None:
  """Makes ``optimizer``'s own average update and overwrite do nothing inside
  ``deferred()``, in the thread that entered it; elsewhere (``finalize_variable_values``,
  a callback) they run as before. Idempotent.

  The instance patches ``DEFERRED`` (``compat.patches.patch_instance``): the class and
  every other optimizer keep Keras' methods.

  Raises:
    RuntimeError: ``optimizer`` lacks one of the methods (a Keras release that renamed
      them).
  """
  for name in DEFERRED:
    patches.patch_instance(optimizer, name)


@contextlib.contextmanager
def deferred():
  """Within it (in this thread), a ``defer``-ed optimizer's ``apply`` leaves its average
  and the weights' overwrite alone."""
  previous = getattr(_state, "deferring", False)
  _state.deferring = True
  try:
    yield
  finally:
    _state.deferring = previous


def update_after_exchange(optimizer, stepped, assign_per_replica) -> None:
  """Keras' average update (and overwrite, every ``ema_overwrite_frequency`` steps) of
  ``optimizer``, on the weights as they are now, where ``stepped``.

  Called in a replica context after the exchange, once ``optimizer.iterations`` counts
  this step (Keras' own update sees it before the count: ``iterations - 1`` here).

  Args:
    optimizer: the built inner optimizer, with ``use_ema=True``.
    stepped: a bool tensor; whether this step happened (False: a skipped step leaves the
      average and the weights as they are).
    assign_per_replica: ``(variables, values)`` -> None; sets this replica's copies.
  """
  variables = optimizer._trainable_variables  # pylint: disable=protected-access
  averages = getattr(optimizer, AVERAGES)
  before = optimizer.iterations - 1
  for variable, average in zip(variables, averages):
    if average is None:
      continue
    # Keras' expression (base_optimizer._update_model_variables_moving_average), so that
    # one replica rounds as Keras does.
    momentum = keras.ops.multiply(keras.ops.cast(keras.ops.not_equal(before, 0),
                                                 variable.dtype), optimizer.ema_momentum)
    value = keras.ops.add(keras.ops.multiply(momentum, average),
                          keras.ops.multiply(keras.ops.subtract(1, momentum), variable))
    average.assign(tf.where(stepped, value, tf.convert_to_tensor(average)))
  if optimizer.ema_overwrite_frequency:
    overwrite = tf.logical_and(
        stepped, tf.equal((before + 1) % optimizer.ema_overwrite_frequency, 0))
    pairs = [(v, a) for v, a in zip(variables, averages) if a is not None]
    assign_per_replica([v for v, _ in pairs], [
        tf.where(overwrite, tf.convert_to_tensor(a), tf.convert_to_tensor(v))
        for v, a in pairs])


class AfterExchange:
  """A wrapper's step (``tf_adacomp.steps``) followed by the inner optimizer's EMA
  update on the exchanged weights (``update_after_exchange``), where the step was taken
  (``iterations`` moved on). The inner optimizer must have been ``defer``-ed.

  Args:
    step: the step; its ``inner.optimizer`` has ``use_ema=True``.
  """

  def __init__(self, step):
    self.step = step
    self.guard = step.guard

  def __call__(self, grads, variables, indices, dense):
    optimizer = self.step.inner.optimizer
    before = tf.convert_to_tensor(optimizer.iterations)
    self.step(grads, variables, indices, dense)
    update_after_exchange(optimizer, tf.not_equal(optimizer.iterations, before),
                          self.guard.assign_per_replica)
