"""The update exchange (``exchange="updates"``; Horovod's Adasum "delta" mode,
generalised): each replica first takes the inner optimizer's step on its own mean
gradient (its gradient times the replica count, since Keras divides every replica's loss
by it) with its own optimizer state (momentum, Adam moments); the updates ``delta =
weights after - weights before`` are compressed with error feedback, exchanged, and
every replica sets ``weights = before + mean(decoded deltas)`` (with
``reduction="adasum"``: ``before + Adasum(decoded deltas)``).

For SGD with momentum this is Deep Gradient Compression's momentum correction (Lin et
al., ICLR 2018): the velocity is accumulated locally and what the residue holds back is
velocity, not gradient. A step whose own gradient is not finite on some replica changes
nothing anywhere (one all-reduced flag); a combined update that is not finite leaves
weights and residues as they were, but the inner optimizers' states have taken their
step.

``finish`` is a round's end, shared with local steps (``steps.local_rounds``): the
pseudo-updates exchanged, DGC's momentum masking (``steps.momentum_masking``), and the
anchor moved by their mean or by an outer optimizer (DiLoCo's; ``local_steps.Predictive``,
whose prediction the replicas first take out of what they send), and where the inner
Adam's first moments are inferred from the mean (``infer_first_moments``), each
replica's set to the one that would have moved the weights that far.
"""

import tensorflow as tf

from tf_adacomp import local_steps as local_steps_lib
from tf_adacomp.ops import fused
from tf_adacomp.steps import momentum_masking


class UpdateExchange:
  """The step of the update exchange, one exchange per step.

  Args:
    guard: the wrapper's ``steps.guard.Guard``.
    inner: the wrapper's inner optimizer adapter (``steps.Inner``).
    masking: whether DGC's momentum factor masking is on.
    outer_optimizer: "average" or a built Keras optimizer stepping the anchor on the
      pseudo-gradient (its own all-reduce switched off).
    infer_first_moments: whether a round's end sets each replica's Adam first moments
      from the replicas' mean pseudo-update (``inner.infer_first_moments``, an
      ``EstimatedGlobalAdam``'s); for rounds of local steps whose pseudo-updates are sent
      whole (uncompressed or cast to half precision) only, where the mean is what the
      replicas stepped.
  """

  local_steps = 1

  def __init__(self, guard, inner, masking=False, outer_optimizer="average",
               infer_first_moments=False):
    self.guard = guard
    self.inner = inner
    self.masking = masking
    self.outer_optimizer = outer_optimizer
    self.infer_first_moments = infer_first_moments

  def __call__(self, grads, variables, indices, dense):
    """One step on this replica's ``grads`` for ``variables`` (at ``indices``)."""
    guard = self.guard
    replicas, plans, states = guard.begin(indices)
    # This replica's mean gradient. An Embedding's IndexedSlices stay slices where the
    # inner optimizer steps on them (Keras 3's: Adam adds the slices' squares). A clip
    # (in own_step) leaves a gradient that is not finite not finite, so the unclipped
    # one decides.
    own = [self.inner.own_gradient(g, replicas) for g in grads]
    # Every replica must take the same branch: step only if all gradients are finite.
    stepped = guard.agree(own)
    anchors = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
    with tf.control_dependencies(anchors):
      guard.on_every_replica_if(stepped, lambda local: self.inner.own_step(local, variables),
                                own)
    # Automatic control dependencies order these reads after the local step.
    self.finish(variables, indices, plans, states, anchors,
                [None if g is None else tf.convert_to_tensor(v) - a
                 for g, v, a in zip(grads, variables, anchors)], dense, stepped)

  def finish(self, variables, indices, plans, states, anchors, deltas, dense, stepped,
             masks=None, whole_round=True):
    """A round's end: the replicas' updates ``deltas`` (weights minus ``anchors``)
    compressed, exchanged and combined; the outer optimizer (or the mean) moves the
    anchor and every replica adopts it. ``stepped``: whether every replica took its
    step. ``masks``: None, or per variable None (trained by this step) or whether that
    idle variable joins the round (its delta is zero where not): one that joins gets
    the mean without the outer optimizer's step; one that does not keeps its weights
    and residues. ``whole_round``: whether every replica's deltas span the round's
    steps from one anchor (a bool tensor; not where one re-anchored): the first moments
    are inferred only then.

    Returns:
      The bool tensor ``finite``: whether the round's combined update was applied.
    """
    guard = self.guard
    masks = [None] * len(variables) if masks is None else list(masks)
    predicted = [None] * len(variables)
    if isinstance(self.outer_optimizer, local_steps_lib.Predictive):
      # What every replica predicts is not sent; the outer step adds it back. Idle
      # variables take the mean and no outer step: nothing is predicted for them.
      predicted = [None if d is None or masks[k] is not None
                   else self.outer_optimizer.prediction(indices[k], d.dtype)
                   for k, d in enumerate(deltas)]
      deltas = [d if p is None else d - p for d, p in zip(deltas, predicted)]
    # The mean of the replicas' updates (or their Adasum).
    combined, exchanged = guard.exchange(plans, deltas, states, dense, mean=True)
    finite = guard.settle(indices, states, exchanged.states, combined, exchanged.nbytes,
                          stepped=stepped,
                          masks=None if all(m is None for m in masks) else masks)
    if self.masking:
      sent_step = finite if dense is None else tf.logical_and(finite, tf.logical_not(dense))
      momentum_masking.mask(guard, self.inner.optimizer, variables, states, deltas,
                            exchanged.states, sent_step)
    present = [k for k, c in enumerate(combined) if c is not None]
    if self.infer_first_moments:
      # From the replicas' mean pseudo-update (the prediction added back), before the
      # outer step moves the anchor; idle variables' moments were not stepped.
      trained = [k for k in present if masks[k] is None]
      self.inner.infer_first_moments(
          [variables[k] for k in trained],
          [combined[k] if predicted[k] is None else combined[k] + predicted[k]
           for k in trained],
          self.local_steps, tf.logical_and(finite, whole_round))
    # Idle variables take the mean whatever the outer optimizer: they are not trained.
    stepped_outer = ([] if isinstance(self.outer_optimizer, str)  # "average"
                     else [k for k in present if masks[k] is None])
    averaged = [k for k in present if k not in stepped_outer]
    if averaged:
      guard.assign_per_replica(
          [variables[k] for k in averaged],
          [fused.add_if(finite, anchors[k], combined[k]) if masks[k] is None
           else tf.where(masks[k], fused.add_if(finite, anchors[k], combined[k]),
                         tf.convert_to_tensor(variables[k])) for k in averaged])
    if stepped_outer:
      self._outer_step([variables[k] for k in stepped_outer],
                       [anchors[k] for k in stepped_outer],
                       [combined[k] for k in stepped_outer], finite)
    return finite

  def _outer_step(self, variables, anchors, updates, finite):
    """The outer optimizer's step from the anchors on the pseudo-gradient ``-updates``
    (the same on every replica); a round that is not finite leaves the anchors and the
    outer optimizer's state as they were."""
    outer, guard = self.outer_optimizer, self.guard
    old_state = [tf.convert_to_tensor(x) for x in outer.variables]
    with tf.control_dependencies(old_state):
      guard.assign_per_replica(variables, anchors)
    gradients = [tf.where(finite, -u, tf.zeros_like(u)) for u in updates]
    outer.apply(gradients, variables)
    # Automatic control dependencies order these reads after the outer step.
    guard.assign_per_replica(
        list(variables) + list(outer.variables),
        [tf.where(finite, tf.convert_to_tensor(v), a) for v, a in zip(variables, anchors)]
        + [tf.where(finite, tf.convert_to_tensor(x), old)
           for x, old in zip(outer.variables, old_state)])


def without_non_finite_slots(guard, optimizer, finite):
  """A skipped round (``finite`` false): a replica whose own steps went non-finite keeps
  going from the anchor with the finite part of ``optimizer``'s state."""
  slots = [x for x in optimizer.variables if tf.as_dtype(x.dtype).is_floating]
  if not slots:
    return
  # Only where the round was skipped: a finite round makes no pass over the slots.
  guard.on_every_replica_if(
      tf.logical_not(finite),
      lambda own: guard.assign_per_replica(
          slots, [local_steps_lib.without_non_finite(x) for x in own]),
      [tf.convert_to_tensor(x) for x in slots])
