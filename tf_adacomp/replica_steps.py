"""Steps that every replica takes together: helpers shared by the Keras 3 and the
tf_keras optimizer wrappers (``optimizer.py``, ``tf_keras.py``)."""

import contextlib

import tensorflow as tf


def on_every_replica_if(flag, fn, values):
  """Calls ``fn(values)`` in every replica if ``flag`` (the same on every replica):
  ``cond_on_every_replica`` with nothing returned. ``fn`` may call an inner optimizer,
  whose updates need a merge_call under MirroredStrategy.

  Args:
    flag: a boolean scalar tensor, equal on every replica.
    fn: a function of ``values``, called in a replica context.
    values: what ``fn`` is given (per replica).
  """
  def run(own):
    fn(own)
    return tf.constant(True)

  cond_on_every_replica(flag, run, lambda own: tf.constant(False), values)


def cond_on_every_replica(flag, true_fn, false_fn, values):
  """``true_fn(values)`` if ``flag`` else ``false_fn(values)``, in every replica: each
  replica's own result (the branches may run collectives; ``flag`` is the same on every
  replica).

  Where the strategy needs a merge_call for a collective (MirroredStrategy on CPUs; an
  inner optimizer's updates need one too), the cond is taken in cross-replica context
  (as Keras' own LossScaleOptimizer does), and each replica receives its own part of the
  branch's results. Each replica's own tensors must reach the branches through
  ``values``: under MirroredStrategy the branches run for every replica from one
  thread, and a tensor a branch closed over would be the first replica's on every
  replica.

  Args:
    flag: a boolean scalar tensor, equal on every replica.
    true_fn, false_fn: functions of ``values``, called in a replica context, that return
      the same structure of tensors.
    values: a structure of this replica's tensors.
  """
  if tf.__internal__.distribute.strategy_supports_no_merge_call():
    return tf.cond(flag, lambda: true_fn(values), lambda: false_fn(values))

  def in_cross_replica(distribution, flag, values):
    flag = distribution.experimental_local_results(flag)[0]
    return tf.cond(
        flag, lambda: distribution.extended.call_for_each_replica(true_fn, args=(values,)),
        lambda: distribution.extended.call_for_each_replica(false_fn, args=(values,)))

  return tf.distribute.get_replica_context().merge_call(in_cross_replica,
                                                        args=(flag, values))


def switch_on_every_replica(index, branches, values):
  """``branches[index](values)`` in every replica: ``cond_on_every_replica`` with more
  than two branches (``index``, an int32 scalar, the same on every replica), one
  ``tf.switch_case`` where several conds would each be taken in cross-replica context.

  Args:
    index: an int32 scalar tensor in ``[0, len(branches))``, equal on every replica.
    branches: functions of ``values``, called in a replica context, that return the
      same structure of tensors.
    values: a structure of this replica's tensors.
  """
  if tf.__internal__.distribute.strategy_supports_no_merge_call():
    return tf.switch_case(index, [lambda b=b: b(values) for b in branches])

  def in_cross_replica(distribution, index, values):
    index = distribution.experimental_local_results(index)[0]
    return tf.switch_case(index, [
        lambda b=b: distribution.extended.call_for_each_replica(b, args=(values,))
        for b in branches])

  return tf.distribute.get_replica_context().merge_call(in_cross_replica,
                                                        args=(index, values))


def first_local(value, strategy):
  """This worker's first replica's component of ``value`` (``value`` itself where it is
  not distributed)."""
  if isinstance(value, tf.distribute.DistributedValues):
    return strategy.experimental_local_results(value)[0]
  return value


def all_replicas_finite(finite, *counts):
  """Whether ``finite`` (this replica's bool) holds on every replica, and the sums over
  the replicas of ``counts`` (float32 scalars), in one all-reduce: the one place where
  the replicas agree on a step (``steps.guard``, ``compat.loss_scale``), so that every
  replica takes the same branch around a collective.

  Returns:
    A bool tensor, or with ``counts`` a tuple (that bool, the list of summed counts).
  """
  not_finite = tf.cast(tf.logical_not(tf.convert_to_tensor(finite)), tf.float32)
  ctx = tf.distribute.get_replica_context()
  if not counts:
    return tf.equal(ctx.all_reduce(tf.distribute.ReduceOp.SUM, not_finite), 0.0)
  flags = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.stack([not_finite, *counts]))
  return tf.equal(flags[0], 0.0), [flags[k] for k in range(1, len(counts) + 1)]


def clip_by_global_norm(tensors, clipnorm):
  """``tensors`` clipped to the global norm ``clipnorm`` as Keras 3's ``global_clipnorm``
  clips them (None entries kept), so that one replica with ``local_clipnorm=c`` is the
  inner optimizer with ``global_clipnorm=c`` bit for bit.

  Keras' arithmetic (keras/src/optimizers/base_optimizer.py ``clip_by_global_norm``): each
  tensor scaled by ``clipnorm * min(1 / norm, 1 / clipnorm)`` (not ``min(1, clipnorm /
  norm)``, which rounds otherwise), where an ``IndexedSlices`` (an Embedding's gradient)
  counts its slices' squares (``global_norm``) and comes back dense, the duplicate rows
  summed. A non-finite norm leaves the tensors as they are (Keras makes them NaN): the
  step is then skipped anyway.

  Args:
    tensors: gradients (tensors, ``tf.IndexedSlices`` or None).
    clipnorm: a Python float > 0.

  Returns:
    The clipped gradients, dense.
  """
  if all(t is None for t in tensors):
    return list(tensors)
  scale = clip_scale(tensors, clipnorm)
  return [None if t is None else tf.convert_to_tensor(t) * tf.cast(scale, t.dtype)
          for t in tensors]


def global_norm(tensors):
  """The global norm of ``tensors`` (None entries skipped), a float32 scalar, in Keras 3's
  order of operations (``base_optimizer.global_norm``): the sum of each tensor's squares,
  those sums stacked and summed, the square root. An ``IndexedSlices`` adds its slices'
  squares (Keras squares the slices, then makes the squares dense), not the squares of
  its summed duplicate rows."""
  squares = []
  for t in tensors:
    if t is None:
      continue
    if isinstance(t, tf.IndexedSlices):
      t = tf.convert_to_tensor(tf.IndexedSlices(tf.square(tf.cast(t.values, tf.float32)),
                                                t.indices, t.dense_shape))
    else:
      t = tf.square(tf.cast(t, tf.float32))
    squares.append(tf.reduce_sum(t))
  return tf.sqrt(tf.reduce_sum(tf.stack(squares)))


def clip_scale(tensors, clipnorm):
  """Keras' factor of ``global_clipnorm``, ``clipnorm * min(1 / global_norm, 1 / clipnorm)``
  (``clip_by_global_norm``), a float32 scalar: 1 if there are no tensors, or if the
  norm is not finite (the step is then skipped anyway)."""
  if all(t is None for t in tensors):
    return tf.constant(1.0)
  norm = global_norm(tensors)
  # As Keras: 1 / clipnorm in Python (double), then float32; clipnorm * (...) likewise.
  scale = clipnorm * tf.minimum(1.0 / norm, 1.0 / clipnorm)
  return tf.where(tf.math.is_finite(norm), scale, 1.0)


def assign_per_replica(strategy, variables, values):
  """Sets each replica's copy of each ``tf.Variable`` to that replica's value (for
  weights the values are equal on all replicas; for optimizer slots they may differ).

  Args:
    strategy: the strategy the variables belong to.
    variables: distributed ``tf.Variable`` objects.
    values: one tensor per variable, this replica's.
  """
  def assign(distribution, values):
    for variable, value in zip(variables, values):
      distribution.extended.update(variable, lambda var, x: var.assign(x), args=(value,),
                                   group=False)

  tf.__internal__.distribute.interim.maybe_merge_call(assign, strategy, values)


def one_value_per_replica(next_creator, **kwargs):
  """A variable creator: a floating variable gets on-read synchronization and ``mean``
  aggregation (each replica keeps its own copy; a checkpoint or a cross-replica read
  gets the mean of the copies, and a restore sets every copy). Others are left as they
  are (a step counter is the same on every replica)."""
  dtype = kwargs.get("dtype")
  initial = kwargs.get("initial_value")
  if dtype is None and initial is not None and not callable(initial):
    dtype = getattr(initial, "dtype", None)
  if dtype is None or tf.as_dtype(dtype).is_floating:
    kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
    kwargs["aggregation"] = tf.VariableAggregation.MEAN
  return next_creator(**kwargs)


def first_replica_variables(strategy, initial_values):
  """Variables made while a step is traced, of which each replica keeps its own copy
  (``ON_READ``) and a cross-replica read gives the first replica's
  (``ONLY_FIRST_REPLICA``): for a state that is the same on every replica, or that only
  its own replica reads. Lifted out of the function (``init_scope``) into ``strategy``'s
  scope. Nothing tracks them: the caller keeps them where no checkpoint looks.

  Args:
    strategy: the ``tf.distribute.Strategy`` of the step, or None (the default).
    initial_values: ``[(name, initial_value), ...]``, each ``initial_value`` a callable
      taking no argument (called in ``init_scope``, eagerly) or a Python value.

  Returns:
    The ``tf.Variable`` objects, in the order of ``initial_values``.
  """
  with tf.init_scope(), (strategy.scope() if strategy else contextlib.nullcontext()):
    return [tf.Variable(initial_value, trainable=False, name=name,
                        synchronization=tf.VariableSynchronization.ON_READ,
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            for name, initial_value in initial_values]
