"""A training step's logs averaged across workers only where the step exchanges.

Under a multi-worker ``MultiWorkerMirroredStrategy``, Keras averages each step's logs
(the loss and the metrics' results) over every replica of every worker after every
step (``compat.keras_multi_worker.mean_over_replicas``): one cross-worker collective
per step. With rounds of local steps (``CompressedOptimizer(local_steps=H)``) nothing
else crosses workers inside a round, so that collective is the one cross-worker cost a
local step pays: its latency, on every step (docs/performance.md measures it).

So the step of a wrapper with local steps marks the function it is traced in
(``average_only_when``): there, the logs are averaged at a round's end, and on other
steps every worker logs the last average, held in variables of its own. Every worker
sees the same logs at every step, at most H - 1 steps old: callbacks that stop
training or save on a logged value (``TerminateOnNaN``, ``EarlyStopping``,
``ModelCheckpoint(save_freq=N)``) decide the same on all of them, where a worker that
stopped alone would leave the others waiting in a collective. The first step of a
function averages too (nothing is held yet). The logs of an epoch's end are Keras' own
(it reads the metrics then, averaged at that moment), and so are evaluation's.

Any other reduction, any other function (``evaluate``'s, ``predict``'s) and every
strategy but multi-worker MWMS are left to Keras and ``mean_over_replicas``.
"""

import weakref

import keras
import tensorflow as tf

from tf_adacomp import replica_steps

# The function graphs whose step asked for it -> the condition (a callable returning
# a boolean tensor, the same on every worker) and the holder of the held values.
_MARKED = weakref.WeakKeyDictionary()
_HELD = "_tf_adacomp_held_logs"


def average_only_when(condition, holder) -> None:
  """Marks the function being traced: its logs are averaged across workers only where
  ``condition()`` is true (or nothing is held yet); elsewhere the last average.

  Call while a training step is traced (``tf.function``); outside a function, nothing.

  Args:
    condition: a callable taking no argument and returning a scalar boolean tensor, the
      same on every replica of every worker (for example, whether the optimizer's
      ``iterations`` end a round); called where the logs are reduced, after the step.
    holder: an object whose ``__dict__`` keeps the held values' variables (out of Keras'
      and TensorFlow's tracking: nothing is saved).
  """
  if not tf.inside_function():
    return
  _MARKED[tf.compat.v1.get_default_graph()] = (condition, holder)


def marked() -> bool:
  """Whether the function being traced was marked by ``average_only_when``."""
  return tf.inside_function() and tf.compat.v1.get_default_graph() in _MARKED


def mean_or_held(values, strategy, mean):
  """``mean(values, strategy)`` where the function is not marked, or its condition
  holds; else the values it last returned there (in a marked function).

  Args:
    values: the step's logs (a structure of per-replica rank-known tensors).
    strategy: the ``tf.distribute.Strategy`` they were made under.
    mean: a callable ``mean(values, strategy)`` returning their average over every
      replica of every worker (``compat.keras_multi_worker.mean_over_replicas``).

  Returns:
    The structure of ``values``, averaged now or held from the last average.
  """
  entry = _MARKED.get(tf.compat.v1.get_default_graph()) if tf.inside_function() else None
  leaves = keras.tree.flatten(values)
  specs = [_spec(leaf, strategy) for leaf in leaves]
  if (entry is None or not leaves
      or not all(s is not None and s.shape.is_fully_defined() for s in specs)):
    return mean(values, strategy)
  condition, holder = entry
  held, valid = _held(holder, specs, strategy)

  def average():
    means = keras.tree.flatten(mean(values, strategy))
    stored = [h.assign(m) for h, m in zip(held, means)] + [valid.assign(True)]
    with tf.control_dependencies(stored):
      return [tf.identity(m) for m in means]

  def last():
    return [tf.identity(h) for h in held]

  now = tf.logical_or(condition(), tf.logical_not(tf.convert_to_tensor(valid)))
  return keras.tree.pack_sequence_as(values, tf.cond(now, average, last))


def _spec(value, strategy):
  """The shape and dtype of a replica's ``value`` (None for what is not a tensor)."""
  value = replica_steps.first_local(value, strategy)
  if not tf.is_tensor(value):
    return None
  return tf.TensorSpec(value.shape, value.dtype)


def _held(holder, specs, strategy):
  """The held values' variables for logs of ``specs`` and whether they hold an average,
  made on first use: each replica's own (``ON_READ``), read from the first, as the
  averages are equal on all."""
  key = tuple((tuple(s.shape), s.dtype.name) for s in specs)
  made = holder.__dict__.setdefault(_HELD, {})
  if key not in made:
    *logs, valid = replica_steps.first_replica_variables(
        strategy, [("held_log", lambda s=s: tf.zeros(s.shape, s.dtype)) for s in specs]
        + [("held_log_valid", False)])
    made[key] = (logs, valid)
  return made[key]
