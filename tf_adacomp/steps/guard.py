"""The guarded step: what every exchange mode does around its exchange, written once.

Every replica takes the same branches (a collective inside a branch that one replica
skipped would hang the others), so a step is guarded in three moves, each here:

1. ``agree``: one all-reduce decides whether every replica's values are finite (and
   carries any other flag the step must agree on).
2. ``exchange`` then ``settle``: the compressed exchange, then whether its combined
   result is finite; the residues keep what the compressor left only where it is (the
   one residue owner: ``residues``), and the bytes one replica sent are counted.
3. ``on_every_replica_if`` / ``assign_per_replica``: the step is applied only if finite,
   on every replica's own copy.

Used by both optimizer wrappers (``tf_adacomp.optimizer``, ``tf_adacomp.tf_keras``)
through the exchange modes of ``tf_adacomp.steps``.
"""

from typing import Callable, List, Optional, Sequence

import tensorflow as tf

from tf_adacomp import replica_steps
from tf_adacomp.ops import fused


def read(variable):
  """This replica's value of ``variable`` (a Keras variable or a ``tf.Variable``)."""
  return tf.convert_to_tensor(_tf_variable(variable))


def _tf_variable(variable):
  """The ``tf.Variable`` behind a Keras variable (a ``tf.Variable`` is its own)."""
  return variable if isinstance(variable, tf.Variable) else variable.value


class Guard:
  """The guarded step's state of one optimizer wrapper, made by its ``build``.

  Args:
    engine: the ``exchange.Exchange`` (compressor and reduction).
    hierarchy: the wrapper's ``hierarchy.Hierarchy`` or None.
    plans: one compressor plan per variable the wrapper was built with.
    residues: per variable, the tuple of its compressor-state variables (one value per
      replica: ``on_read``, ``sum`` aggregation).
    bytes_sent: an int64 variable of ``len(plans)`` entries, the bytes of the last step.
    strategy: the strategy the variables belong to.
    on_traced: None or a function called once per traced step, after the exchange (the
      wrapper's first-compile log).
    choice: None, or the ``steps.choice.Choice`` that decides at each exchange whether
      it is compressed or dense (``dense_when_faster``).
  """

  def __init__(self, engine, hierarchy, plans, residues, bytes_sent, strategy,
               on_traced: Optional[Callable[[], None]] = None, choice=None):
    self.engine = engine
    self.hierarchy = hierarchy
    self.plans = plans
    self.residues = residues
    self.bytes_sent = bytes_sent
    self.strategy = strategy
    self._on_traced = on_traced
    self.choice = choice

  # --- 1. Agree ----------------------------------------------------------------------

  @staticmethod
  def agree(tensors, *counts):
    """Whether every replica's ``tensors`` are finite, and the sums over the replicas of
    ``counts`` (float scalars), in one all-reduce.

    Returns:
      A bool tensor, or with ``counts`` a tuple (that bool, the summed counts).
    """
    return replica_steps.all_replicas_finite(fused.all_finite(tensors), *counts)

  # --- 2. Exchange and settle --------------------------------------------------------

  def begin(self, indices):
    """What a step over the variables at ``indices`` starts from: ``(replicas, their
    plans, this replica's residues of them)``."""
    replicas = tf.distribute.get_replica_context().num_replicas_in_sync
    return replicas, [self.plans[i] for i in indices], self.states(indices)

  def states(self, indices) -> List[tuple]:
    """This replica's residues (compressor states) of the variables at ``indices``."""
    return [tuple(read(r) for r in self.residues[i]) for i in indices]

  def exchange(self, plans, values, states, dense, mean: bool):
    """The compressed exchange of ``values`` (None entries skipped) and their combination:
    the replicas' sum (``mean=False``; Keras divides each replica's loss by the replica
    count, so the sum of gradients is the mean gradient) or mean (``mean=True``: of
    updates), Adasum's where the reduction is.

    Returns:
      ``(combined, exchanged)``: one tensor (or None) per value, and the engine's
      ``Exchanged`` (new states, bytes).
    """
    replicas = tf.distribute.get_replica_context().num_replicas_in_sync

    def compressed(values, states):
      return self.engine.replica_exchange(plans, values, states, dense, self.hierarchy)

    exchanged = (compressed(values, states) if self.choice is None
                 else self.choice.exchange(plans, values, states, compressed))
    scale = self.engine.reduction.to_mean if mean else self.engine.reduction.to_sum
    return [None if s is None else scale(s, replicas) for s in exchanged.sums], exchanged

  def settle(self, indices, old_states, new_states, results, nbytes, stepped=None,
             masks=None, traced=True):
    """Whether this step's ``results`` are finite (and ``stepped``), with the residues
    kept accordingly and the bytes recorded.

    Args:
      indices: the variables' positions in ``plans``.
      old_states, new_states: their compressor states before and after the exchange.
      results: what the step would apply (None entries skipped).
      nbytes: per variable, the bytes this replica sent (None: nothing).
      stepped: None or a bool tensor that must also hold.
      masks: None, or per variable None or a bool tensor: where False the variable's
        residues stay as they were even in a finite step.
      traced: whether to tell ``on_traced`` (False for a step that exchanges nothing).

    Returns:
      The bool tensor ``finite``, equal on every replica.
    """
    finite = fused.all_finite(results)
    if stepped is not None:
      finite = tf.logical_and(stepped, finite)
    triples = [t for i, old, new in zip(indices, old_states, new_states)
               for t in zip(self.residues[i], old, new)]
    if masks is None and triples:
      # One conditional for all, not a select each: no pass that reads both states.
      kept = tf.cond(finite, lambda: [new for _, _, new in triples],
                     lambda: [old for _, old, _ in triples])
      for (variable, _, _), value in zip(triples, kept):
        variable.assign(value)
    else:
      masks = [None] * len(indices) if masks is None else masks
      for i, old, new, mask in zip(indices, old_states, new_states, masks):
        keep = finite if mask is None else tf.logical_and(finite, mask)
        for variable, old_value, new_value in zip(self.residues[i], old, new):
          variable.assign(tf.where(keep, new_value, old_value))
    self.record_bytes(indices, nbytes, traced)
    return finite

  def record_bytes(self, indices, nbytes, traced=True):
    """Sets ``bytes_sent``: ``nbytes`` at ``indices``, 0 elsewhere."""
    values = tf.tensor_scatter_nd_update(
        tf.zeros([len(self.plans)], tf.int64), [[i] for i in indices],
        [tf.zeros([], tf.int64) if b is None else tf.cast(b, tf.int64) for b in nbytes])
    self.bytes_sent.assign(values)
    if traced and self._on_traced is not None:
      self._on_traced()  # once per step, after the exchange created its kernels

  # --- 3. Apply ----------------------------------------------------------------------

  @staticmethod
  def on_every_replica_if(flag, fn, values):
    """Calls ``fn(values)`` in every replica if ``flag`` (``replica_steps``)."""
    replica_steps.on_every_replica_if(flag, fn, values)

  def assign_per_replica(self, variables: Sequence, values: Sequence):
    """Sets each replica's copy of each variable (Keras or ``tf.Variable``) to that
    replica's value."""
    replica_steps.assign_per_replica(self.strategy, [_tf_variable(v) for v in variables],
                                     values)
