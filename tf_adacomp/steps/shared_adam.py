"""The update exchange with Adam's second moment shared by every replica
(``second_moment="shared"`` or ``"global"``; ``tf_adacomp.shared_moment`` has the
algorithm). The wrapper computes Adam's step itself.

- "local" (not here: ``steps.updates``): each replica divides its own first moment by
  its own second moment, and the mean of those steps is not Adam's step on the mean
  gradient (Adam is not linear in its gradient).
- "shared": every replica divides by the same second moment, the replicas' mean,
  averaged (a dense bfloat16 all-reduce, counted in the bytes) at steps 1, 2, 4, 8, ...
  (``second_moment_interval`` caps the interval: the default for "shared" and for
  ``precondition="after"``); the step is then linear in the first
  moment, and without compression every replica takes Adam's step on the mean gradient
  with that second moment (1-bit Adam's and 0/1 Adam's observation). Between averages
  each replica's step is clipped to Adam's own bound on a step (the shared moment is
  then older than the replica's, and an element first seen since the last average has
  none); at an average, and at every step with one replica, it is Adam's step
  unclipped.
- "global": as "shared", with the second moment of the mean gradient estimated from the
  replicas' own (a replica's smaller batch has R times its noise); it also keeps a
  moving average of each replica's squared first moment. Here only when averaged
  (``second_moment_interval`` "doubling" or an int); by default (0) each replica makes
  the estimate from its own moments and nothing is averaged (not here:
  ``steps.estimated_adam``).

An Embedding's sparse gradient adds its slices' squares, as Keras' Adam does (clipped by
``local_clipnorm`` it is dense, as Keras' ``global_clipnorm`` makes it). With one
replica "shared" and "global" are the plain inner optimizer.

``precondition="before"``: each replica's Adam step is compressed (the residue holds
steps). ``"after"``: each replica's first moment times the step size is compressed, and
the decoded mean is divided by ``sqrt(v) + epsilon`` on arrival (the same on every
replica, so the result is the same without compression); the residue then holds
momentum, whose large elements AdaComp sends first, where Adam's normalised steps are
flat.

A step whose gradient is not finite on some replica, or whose combined step is not,
changes nothing (weights, moments, residues, ``iterations``).

Also the arguments of that choice: ``resolve_second_moment``, ``default_second_moment``,
``resolve_interval``, ``check_precondition``.
"""

import tensorflow as tf

from tf_adacomp import shared_moment
from tf_adacomp.ops import checks
from tf_adacomp.ops import fused

# What ``second_moment=None`` means for an Adam or AdamW under the update exchange.
DEFAULT_SECOND_MOMENT = "global"
# ``second_moment_interval``'s schedule of averages at steps 1, 2, 4, 8, ... (no cap).
DOUBLING = "doubling"
# What ``second_moment_interval=None`` means, per second moment: "global" averages
# nothing (each replica's own estimate at every step: at Keras' accuracy on the LSTM and
# the small GPT, where the averages' age cost the LSTM 1.5-2 points, and no dense moment
# bytes; docs/convergence.md); "shared" has no estimate of its own and is averaged.
DEFAULT_INTERVAL = {"global": 0, "shared": DOUBLING}
PRECONDITIONS = ("before", "after")


class SharedMoment:
  """The step of the update exchange with a shared second moment.

  Args:
    guard, inner: as ``steps.updates.UpdateExchange``.
    second_moment: "shared" or "global".
    precondition: "before" or "after".
    interval: ``DOUBLING`` or the longest number of steps between averages.
    shared_velocities: per variable, the shared second moment (equal on every replica).
    moment_synced_at: int64 variable, the step of the last average (0: never).
    momentum_squares: with "global", per variable each replica's moment of m^2.
  """

  def __init__(self, guard, inner, second_moment, precondition, interval,
               shared_velocities, moment_synced_at, momentum_squares=None):
    self.guard = guard
    self.inner = inner
    self.second_moment = second_moment
    self.precondition = precondition
    self.interval = interval
    self.shared_velocities = shared_velocities
    self.moment_synced_at = moment_synced_at
    self.momentum_squares = momentum_squares

  def __call__(self, grads, variables, indices, dense):
    guard, inner = self.guard, self.inner.optimizer
    replicas, plans, states = guard.begin(indices)
    own = [self.inner.own_gradient(g, replicas) for g in grads]
    # Dense afterwards when clipped: Adam then adds the square of the clipped, summed
    # rows, as Keras does after its global_clipnorm.
    own = self.inner.clip(own)
    t = tf.cast(inner.iterations, tf.int64) + 1
    learning_rate = inner.learning_rate
    momentums, velocities = shared_moment.moment_slots(inner)
    present = [k for k, g in enumerate(own) if g is not None]
    indices_present = [indices[k] for k in present]
    slots = [inner._get_variable_index(variables[k]) for k in present]  # pylint: disable=protected-access
    # Per variable: the inner optimizer's first and second moments (this replica's),
    # the shared second moment and, for "global", this replica's moment of m^2.
    tracked = {"m": [momentums[j] for j in slots], "v": [velocities[j] for j in slots],
               "shared": [self.shared_velocities[i] for i in indices_present]}
    if self.second_moment == "global":
      tracked["w"] = [self.momentum_squares[i] for i in indices_present]
    old = {key: [tf.convert_to_tensor(x) for x in xs] for key, xs in tracked.items()}
    old_synced_at = tf.convert_to_tensor(self.moment_synced_at)
    # An Embedding's IndexedSlices gradient: Keras' Adam adds its slices' squares to v.
    sparse = [isinstance(own[k], tf.IndexedSlices) for k in present]
    new = {"m": [], "v": [], "w": []}
    for k, m, v, is_sparse in zip(present, old["m"], old["v"], sparse):
      square = shared_moment.sparse_square(own[k]) if is_sparse else None
      m, v = shared_moment.local_moments(m, v, own[k], inner.beta_1, inner.beta_2, square)
      new["m"].append(m)
      new["v"].append(v)
    for m, w in zip(new["m"], old.get("w", [])):
      new["w"].append(shared_moment.local_momentum_square(w, m, t, inner.beta_1, inner.beta_2))
    # Every replica must take the same branches: step only if all gradients are finite.
    stepped = guard.agree(own)
    if replicas == 1:  # the average of one is free: take it every step (plain Adam)
      sync = stepped
    else:
      on_schedule = shared_moment.is_sync_step(t, max_interval(self.interval))
      sync = tf.logical_and(stepped, tf.logical_or(on_schedule, tf.equal(old_synced_at, 0)))
    synced_at = tf.where(sync, t, old_synced_at)
    averaged = ["v", "w"] if "w" in tracked else ["v"]

    def average(values):
      # bfloat16 on the wire: float32's range (a second moment spans many decades),
      # 0.4% relative error, about 0.2% on Adam's step. One replica sends nothing.
      wire = tf.bfloat16 if replicas > 1 else values[0].dtype
      means = tf.distribute.get_replica_context().all_reduce(
          tf.distribute.ReduceOp.MEAN, [tf.cast(x, wire) for x in values])
      means = [tf.cast(x, v.dtype) for x, v in zip(means, values)]
      mean = dict(zip(averaged, (means[i * len(present):(i + 1) * len(present)]
                                 for i in range(len(averaged)))))
      # Sparse (slice-squared) moments add up across replicas: theirs is Keras' exactly.
      shared = [v / replicas if is_sparse else
                v if self.second_moment == "shared" else
                shared_moment.global_moment(v, w, replicas, inner.beta_1)
                for v, w, is_sparse in zip(mean["v"], mean.get("w", mean["v"]), sparse)]
      # Each replica's own moments restart from the replicas' mean (which they keep).
      guard.assign_per_replica(
          tracked["shared"] + [x for key in averaged for x in tracked[key]],
          shared + [x for key in averaged for x in mean[key]])
      return tf.constant(True)

    with tf.control_dependencies([x for xs in old.values() for x in xs]):
      guard.on_every_replica_if(sync, average, [x for key in averaged for x in new[key]])
    # Automatic control dependencies order these reads after the average.
    after = {key: [tf.convert_to_tensor(x) for x in tracked[key]]
             for key in ["shared"] + averaged}
    # The step, or with precondition="after" the step before its division by the shared
    # moment (the same on every replica, so it can follow the exchange).
    deltas = [None] * len(own)
    divisors = {}
    alpha = shared_moment.step_size(learning_rate, t, synced_at, inner.beta_1, inner.beta_2)
    bound = shared_moment.step_bound(alpha, inner.beta_1, inner.beta_2)
    # Each replica's step is bounded only where the shared moment is older than this
    # step: at an average (every step with one replica) it is Adam's step exactly.
    stale = tf.not_equal(synced_at, t)
    for k, m, v in zip(present, new["m"], after["shared"]):
      update = -tf.cast(alpha, m.dtype) * m
      divisors[k] = shared_moment.divisor(v, inner.epsilon)
      if self.precondition == "before":
        update = update / divisors[k]
      # "after" bounds the same quotient before it is sent (update / divisor, so the
      # two are equal without compression): the mean of bounded steps is bounded.
      update = tf.where(stale, shared_moment.clip(
          update, bound if self.precondition == "before" else bound * divisors[k]), update)
      deltas[k] = tf.where(stepped, update, tf.zeros_like(update))
    combined, exchanged = guard.exchange(plans, deltas, states, dense, mean=True)
    if self.precondition == "after":  # the same divisor on every replica: exact
      combined = [c if c is None else c / divisors[k] for k, c in enumerate(combined)]
    # Every byte counts: a sync step also sends the averaged moments, dense bfloat16
    # (with more than one replica: one replica's average sends nothing).
    nbytes = list(exchanged.nbytes)
    for k in present if replicas > 1 else ():
      size = len(averaged) * variables[k].shape.num_elements() * 2
      moment_bytes = tf.where(sync, tf.constant(size, tf.int64), tf.constant(0, tf.int64))
      nbytes[k] = (moment_bytes if nbytes[k] is None
                   else tf.cast(nbytes[k], tf.int64) + moment_bytes)
    finite = guard.settle(indices, states, exchanged.states, combined, nbytes,
                          stepped=stepped)
    targets, values = [], []
    for key in tracked:
      for i, variable in enumerate(tracked[key]):
        if key == "shared":
          value = after[key][i]
        elif key == "m":
          value = new[key][i]
        else:  # the replicas' mean after an average, this replica's own otherwise
          value = tf.where(sync, after[key][i], new[key][i])
        targets.append(variable)
        values.append(tf.where(finite, value, old[key][i]))
    pairs = [(variables[k], fused.add_if(
        finite, shared_moment.decayed(inner, variables[k], tf.convert_to_tensor(variables[k]),
                                      learning_rate),
        combined[k])) for k in present]
    guard.assign_per_replica(targets + [v for v, _ in pairs], values + [x for _, x in pairs])
    self.moment_synced_at.assign(tf.where(finite, synced_at, old_synced_at))
    inner.iterations.assign_add(tf.cast(finite, inner.iterations.dtype))


def resolve_second_moment(second_moment, exchange, reduction, inner_optimizer,
                          momentum_masking, local_steps=1):
  """The second moment ``second_moment`` asks for (None: ``default_second_moment``), or
  ValueError where it cannot apply."""
  if second_moment is None:
    return default_second_moment(inner_optimizer, exchange, reduction, momentum_masking,
                                 local_steps)
  if second_moment not in shared_moment.SECOND_MOMENTS:
    raise ValueError(f"`second_moment` must be one of {shared_moment.SECOND_MOMENTS} or "
                     f"None. Received: second_moment={second_moment!r}")
  if second_moment == "local":
    return second_moment
  if exchange != "updates" or reduction != "sum":
    raise ValueError(f"`second_moment={second_moment!r}` shares Adam's second moment in the "
                     "update exchange and needs exchange='updates' and reduction='sum'. "
                     f"Received: exchange={exchange!r}, reduction={reduction!r}")
  if momentum_masking:
    raise ValueError(f"`second_moment={second_moment!r}` does not take "
                     "momentum_masking=True. Received: momentum_masking=True")
  if local_steps > 1 and second_moment == "shared":
    raise ValueError(f"`second_moment={second_moment!r}` shares Adam's second moment at "
                     "every step; with local steps each replica estimates the global "
                     "batch's (\"global\") or keeps its own (\"local\"). Received: "
                     f"second_moment={second_moment!r}, local_steps={local_steps!r}")
  shared_moment.check_inner(inner_optimizer, second_moment)
  return second_moment


def default_second_moment(inner_optimizer, exchange="updates", reduction="sum",
                          momentum_masking=False, local_steps=1):
  """What ``second_moment=None`` means for this inner optimizer and exchange.

  ``DEFAULT_SECOND_MOMENT`` ("global") for an Adam or AdamW (without amsgrad,
  clipping, EMA, gradient accumulation or a loss scale factor set on it) under the mean
  update exchange: of the three it came closest to Keras' Adam on the character LSTM
  and the transformer (docs/convergence.md). With local steps too: each replica then
  divides by its own estimate of the global batch's second moment
  (``steps.estimated_adam``), which brought local Adam close to Keras' on the
  transformer and the LSTM (docs/convergence.md). "local" otherwise: other optimizers
  keep their own state, and their second moment, if any, stays each replica's.

  Args:
    inner_optimizer: the optimizer ``CompressedOptimizer`` wraps.
    exchange: "updates" or "gradients".
    reduction: "sum" or "adasum".
    momentum_masking: whether DGC's momentum masking is on.
    local_steps: steps per round (unused: "global" applies to rounds too).

  Returns:
    "global" or "local".
  """
  del local_steps
  if exchange != "updates" or reduction != "sum" or momentum_masking:
    return "local"
  try:
    shared_moment.check_inner(inner_optimizer)
  except ValueError:
    return "local"
  return DEFAULT_SECOND_MOMENT


def resolve_interval(interval, second_moment, precondition="before", local_steps=1):
  """``second_moment_interval`` checked and resolved (``CompressedOptimizer``'s docstring).

  Returns:
    0 (nothing averaged: each replica divides by its own estimate of the global batch's
    second moment, ``steps.estimated_adam``), ``DOUBLING`` (averages at steps 1, 2, 4,
    8, ...), an int >= 1 (as ``DOUBLING`` up to that interval, then every that many
    steps), or None where no moment is shared (``second_moment="local"``).
    None resolves to ``DEFAULT_INTERVAL[second_moment]``, except that
    ``precondition="after"`` (which divides by the shared moment) takes ``DOUBLING``.

  Raises:
    ValueError: a value not of these; 0 without "global"; an average with local steps
      (each replica estimates its own) or without a shared moment.
  """
  if interval is None:
    if second_moment == "global" and precondition == "after":
      return DOUBLING
    return DEFAULT_INTERVAL.get(second_moment)
  if checks.is_int(interval) and not isinstance(interval, bool) and interval == 0:
    if second_moment != "global":
      raise ValueError("`second_moment_interval=0` (each replica estimates the global "
                       "batch's second moment from its own; nothing is averaged) needs "
                       "second_moment='global'. Received: second_moment_interval=0, "
                       f"second_moment={second_moment!r}")
    return 0
  if not (isinstance(interval, str) and interval == DOUBLING):  # an array has no one truth
    try:
      interval = checks.positive_int(interval, "second_moment_interval")
    except (TypeError, ValueError) as error:
      raise ValueError(f"`second_moment_interval` must be None, 0, {DOUBLING!r} or an int "
                       f">= 1. Received: second_moment_interval={interval!r}") from error
  if local_steps > 1:
    raise ValueError("`second_moment_interval` is the longest interval between averages "
                     "of the shared second moment; with local steps each replica "
                     "estimates its own and nothing is averaged. "
                     f"Received: second_moment_interval={interval!r}, "
                     f"local_steps={local_steps!r}")
  if second_moment == "local":
    raise ValueError("`second_moment_interval` is the longest interval between averages "
                     "of the shared second moment and needs second_moment='shared' or "
                     "'global'. "
                     f"Received: second_moment_interval={interval!r}, "
                     f"second_moment={second_moment!r}")
  return interval


def max_interval(interval):
  """``shared_moment.is_sync_step``'s ``max_interval`` for a resolved interval."""
  return None if interval == DOUBLING else interval


def estimates_own_moment(second_moment, interval, local_steps) -> bool:
  """Whether each replica divides by its own estimate of the global batch's second
  moment (``steps.estimated_adam``), nothing averaged: "global" inside local steps, or
  with ``second_moment_interval=0``."""
  return second_moment == "global" and (local_steps > 1 or interval == 0)


def check_no_after_without_average(precondition, interval):
  """``precondition="after"`` refused with ``second_moment_interval=0``: there is no
  shared moment to divide the exchanged steps by."""
  if precondition == "after" and interval == 0:
    raise ValueError("`precondition='after'` divides the exchanged steps by the shared "
                     "second moment; with second_moment_interval=0 nothing is shared. "
                     "Received: precondition='after', second_moment_interval=0")
  return precondition


def check_precondition(precondition, second_moment, local_steps=1):
  """``precondition`` checked: one of ``PRECONDITIONS``; "after" with a moment shared
  at every step (not with local steps, whose replicas divide by their own)."""
  if precondition not in PRECONDITIONS:
    raise ValueError(f"`precondition` must be one of {PRECONDITIONS}. "
                     f"Received: precondition={precondition!r}")
  if precondition == "after" and local_steps > 1:
    raise ValueError("`precondition='after'` divides the exchanged steps by the shared "
                     "second moment; with local steps each replica divides its own steps. "
                     f"Received: precondition='after', local_steps={local_steps!r}")
  if precondition == "after" and second_moment == "local":
    raise ValueError("`precondition='after'` divides the exchanged steps by the shared "
                     "second moment and needs second_moment='shared' or 'global'. "
                     f"Received: precondition='after', second_moment={second_moment!r}")
  return precondition
