"""Rounds of local steps (``local_steps=H`` > 1, the update exchange; DiLoCo, SparseLoCo;
``tf_adacomp.local_steps`` has the algorithm and its helpers).

Each replica takes H steps of the inner optimizer on its own data from the round's
anchor; nothing crosses devices until the round's last step, whose pseudo-updates
(local weights minus anchor) are exchanged (``UpdateExchange.finish``). Weights set
between steps re-anchor the round; a variable built with but no longer trained ("idle":
a layer frozen since, or no gradient) joins the exchange of a round in which this
replica stepped it.
"""

import tensorflow as tf

from tf_adacomp import local_steps as local_steps_lib
from tf_adacomp import step_logs
from tf_adacomp.steps import updates


class LocalRounds(updates.UpdateExchange):
  """The step of the update exchange with rounds of ``local_steps`` steps.

  Args:
    guard, inner, outer_optimizer, infer_first_moments: as ``UpdateExchange``.
    local_steps: int > 1, the steps of a round.
    anchors: per variable the optimizer was built with, its anchor (the weights every
      replica held when the round began; equal on all).
    variables: the variables the optimizer was built with, in the guard's order.
  """

  def __init__(self, guard, inner, local_steps, anchors, variables,
               outer_optimizer="average", infer_first_moments=False):
    super().__init__(guard, inner, masking=False, outer_optimizer=outer_optimizer,
                     infer_first_moments=infer_first_moments)
    self.local_steps = local_steps
    self.anchors = anchors
    self.variables = variables

  def __call__(self, grads, variables, indices, dense):
    guard, iterations = self.guard, self.inner.optimizer.iterations
    replicas, plans, states = guard.begin(indices)
    own = [self.inner.own_gradient(g, replicas) for g in grads]
    state = local_steps_lib.round_state(self, len(self.variables))
    done = tf.cast(iterations, tf.int64)  # the steps before this one
    trained = [k for k, g in enumerate(grads) if g is not None]
    stepping, at = [variables[k] for k in trained], [indices[k] for k in trained]
    idle = [i for i in range(len(guard.plans)) if i not in set(at)]
    idle_variables = [self.variables[i] for i in idle]
    anchors, joins = self._start_round(state, done, stepping, at, idle)
    with tf.control_dependencies(anchors + joins):
      self.inner.own_step(own, variables)
    round_end = local_steps_lib.is_round_end(iterations, self.local_steps)
    # Across workers the logs too are averaged at rounds' ends only (multi-worker MWMS).
    step_logs.average_only_when(
        lambda: local_steps_lib.is_round_end(iterations, self.local_steps), self)
    # What this step left, for the next step to tell a `set_weights` from (at a round's
    # end the exchange sets the weights, and the next round begins anew).
    tf.cond(round_end, lambda: tf.constant(False),
            lambda: local_steps_lib.record_step(state, at, stepping,
                                                tf.cast(iterations, tf.int64)))
    guard.record_bytes(indices, [None] * len(indices), traced=False)  # unless a round ends

    def finish(own, with_idle):
      own_states, own_anchors, own_joins = own
      # Automatic control dependencies order these reads after the local step.
      deltas = [tf.convert_to_tensor(v) - a for v, a in zip(stepping, own_anchors)]
      if not with_idle:
        return self._finish_round(stepping, at, [plans[k] for k in trained], own_states,
                                  own_anchors, deltas, dense)
      # Read here, in each replica: its own copies.
      idle_anchors = [tf.convert_to_tensor(self.anchors[i]) for i in idle]
      return self._finish_round(
          stepping + idle_variables, at + idle,
          [plans[k] for k in trained] + [guard.plans[i] for i in idle],
          list(own_states) + guard.states(idle),
          list(own_anchors) + idle_anchors,
          deltas + [tf.where(j, tf.convert_to_tensor(v) - a, tf.zeros_like(a))
                    for j, v, a in zip(own_joins, idle_variables, idle_anchors)],
          dense, masks=[None] * len(at) + list(own_joins))

    # Each replica's own values go through the arguments: under MirroredStrategy the
    # function runs for every replica from one thread, and a closure would hand every
    # replica the first one's residues. The pseudo-updates are computed in the round's
    # last step only (a pass over the weights).
    values = ([states[k] for k in trained], anchors, joins)
    if not idle:
      guard.on_every_replica_if(round_end, lambda own: finish(own, False), values)
      return
    # Whether an idle variable joins is the same on every replica (all take the same steps).
    joined = tf.reduce_any(tf.stack(joins))
    guard.on_every_replica_if(tf.logical_and(round_end, tf.logical_not(joined)),
                              lambda own: finish(own, False), values)
    guard.on_every_replica_if(tf.logical_and(round_end, joined),
                              lambda own: finish(own, True), values)

  def _start_round(self, state, done, variables, indices, idle):
    """This replica's anchors for ``variables`` (at ``indices``), which the step after
    ``done`` steps trains, and for each ``idle`` variable (built with, not trained by
    this step) whether this replica stepped it in this round, so that it joins the
    round's exchange.

    A variable's anchor is set to its weights where it joins a round: at the round's
    first step, or at the first step of the round that trains it. On this replica it is
    set again where the weights are not what this replica's last local step left
    (``state``'s fingerprints): they were set from outside, and the round goes on from
    them; ``state.moved_at`` records it (``tf_adacomp.local_steps``). Without a record
    of the step before (the first step, a round's first, or after a restore, which set
    ``iterations``) anchors are set at a round's first step only.
    """
    position = tf.math.floormod(done, self.local_steps)
    begun = done - position  # the steps before this round
    known = tf.equal(tf.convert_to_tensor(state.recorded_at), done)
    stepped_at = tf.convert_to_tensor(state.stepped_at)
    prints = tf.convert_to_tensor(state.fingerprints)

    def jumps(weights, at, candidates):
      # Where `candidates`, whether the weights' fingerprints are not the recorded ones
      # (one pass over `weights`, taken only if any is a candidate).
      recorded = tf.gather(prints, at)
      now = tf.cond(tf.reduce_any(candidates),
                    lambda: local_steps_lib.fingerprints(weights), lambda: recorded)
      return tf.logical_and(candidates, tf.not_equal(now, recorded))

    anchors, jumped, joins = [], [], []
    if indices:
      at = tf.constant(indices, tf.int64)
      fresh = tf.where(known, tf.gather(stepped_at, at) <= begun,
                       tf.fill([len(indices)], tf.equal(position, 0)))
      jumped.append(jumps(variables, at, tf.logical_and(known, tf.logical_not(fresh))))
      for k, (i, variable) in enumerate(zip(indices, variables)):
        anchor, weight = self.anchors[i], tf.convert_to_tensor(variable)
        anchors.append(tf.cond(tf.logical_or(fresh[k], jumped[0][k]),
                               lambda a=anchor, w=weight: _assigned(a, w),
                               lambda a=anchor: tf.convert_to_tensor(a)))
    if idle:
      at = tf.constant(idle, tf.int64)
      joining = tf.logical_and(known, tf.gather(stepped_at, at) > begun)
      idle_variables = [self.variables[i] for i in idle]
      jumped.append(jumps(idle_variables, at, joining))
      for k, (i, variable) in enumerate(zip(idle, idle_variables)):
        anchor = self.anchors[i]
        anchored = tf.cond(jumped[-1][k],
                           lambda a=anchor, v=variable: _assigned(a, tf.convert_to_tensor(v)),
                           lambda a=anchor: tf.zeros(a.shape, a.dtype))
        with tf.control_dependencies([anchored]):
          joins.append(tf.identity(joining[k]))
    everywhere = list(indices) + list(idle)
    moved_at = tf.convert_to_tensor(state.moved_at)
    moved_at = tf.where(known, moved_at, tf.zeros_like(moved_at))  # a new round, or no record
    if everywhere:
      at = tf.constant(everywhere, tf.int64)
      moved_at = tf.tensor_scatter_nd_update(
          moved_at, at[:, None],
          tf.where(tf.concat(jumped, 0), done + 1, tf.gather(moved_at, at)))
    with tf.control_dependencies([state.moved_at.assign(moved_at)]):
      return [tf.identity(a) for a in anchors], joins

  def _finish_round(self, variables, indices, plans, states, anchors, deltas, dense,
                    masks=None):
    """The round's end (``UpdateExchange.finish``), after every replica has agreed
    whether its round was finite and whether one re-anchored a variable: where one did,
    every replica first takes the latest such anchor and measures its pseudo-update from
    it (``local_steps.adopt_latest_anchors``). A skipped round keeps only the finite
    part of each replica's inner optimizer state."""
    guard = self.guard
    moved = local_steps_lib.moved_in_round(
        local_steps_lib.round_state(self, len(self.variables)), indices,
        tf.cast(self.inner.optimizer.iterations, tf.int64) - self.local_steps)
    # One all-reduce: whether a replica's round went non-finite, and whether one
    # re-anchored a variable.
    stepped, (moves,) = guard.agree(deltas, tf.reduce_sum(moved))
    re_anchored = moves > 0.0
    anchor_variables = [self.anchors[i] for i in indices]
    guard.on_every_replica_if(
        re_anchored,
        lambda own: local_steps_lib.adopt_latest_anchors(anchor_variables, own[0], own[1]),
        (moved, anchors))

    def measured_again():
      # Automatic control dependencies order these reads after the adoption.
      new = [tf.convert_to_tensor(a) for a in anchor_variables]
      masked = [None] * len(variables) if masks is None else masks
      return new, [tf.convert_to_tensor(v) - a if m is None
                   else tf.where(m, tf.convert_to_tensor(v) - a, tf.zeros_like(a))
                   for v, a, m in zip(variables, new, masked)]

    anchors, deltas = tf.cond(re_anchored, measured_again,
                              lambda: (list(anchors), list(deltas)))
    # Nothing that is not finite enters a compressor (its residue is kept anyway). A
    # conditional, not a select: a finite round makes no pass over its deltas here.
    deltas = tf.cond(stepped, lambda: list(deltas),
                     lambda: [tf.zeros_like(d) for d in deltas])
    # A round re-anchored by `set_weights` took fewer steps from its anchor than H: the
    # first moments are not inferred from it (each replica keeps its own).
    finite = self.finish(variables, indices, plans, states, anchors, deltas, dense,
                         stepped, masks, whole_round=tf.logical_not(re_anchored))
    updates.without_non_finite_slots(guard, self.inner.optimizer, finite)
    return tf.constant(True)


def _assigned(variable, value):
  """Assigns ``value`` to ``variable`` (this replica's copy) and returns ``value``."""
  with tf.control_dependencies([variable.assign(value)]):
    return tf.identity(value)
