"""The gradient exchange (``exchange="gradients"``): the replicas' gradients compressed
(residues of their own), exchanged, decoded and summed, and the sum handed to the inner
optimizer, whose own dense all-reduce is switched off, so no gradient-sized tensor
crosses devices. A step whose summed gradient is not finite (e.g. a float16 overflow)
changes nothing: the residues are kept and the inner optimizer is not called.

An Embedding's ``IndexedSlices`` gradient that the exchange would send as it is
(``"none"``, or below the compressor's ``min_size``) takes the strategy's own all-reduce
where the inner optimizer steps on slices (Keras 3's): it joins the replicas' slices as
Keras does, and the inner Adam adds the slices' squares to its second moment, as Keras',
where the dense sum would give it the square of the summed duplicate rows.
"""

import tensorflow as tf



class GradientExchange:
  """The step of the gradient exchange.

  Args:
    guard: the wrapper's ``steps.guard.Guard``.
    inner: the wrapper's inner optimizer adapter (``steps.inner``); its ``clip`` (the
      wrapper's ``local_clipnorm``) applies to each replica's own mean gradient before it
      enters its residue.
  """

  def __init__(self, guard, inner):
    self.guard = guard
    self.inner = inner

  def __call__(self, grads, variables, indices, dense):
    """One step on this replica's ``grads`` (Keras' loss divided by the replica count)
    for ``variables`` (at ``indices`` of the guard's plans); ``dense``: None or whether
    this is a warm-up step."""
    guard = self.guard
    ctx = tf.distribute.get_replica_context()
    replicas, plans, states = guard.begin(indices)
    engine = guard.engine
    keeps_slices = self.inner.keeps_slices
    # One replica whose exchange sends every gradient as it is: the sum is its own
    # gradient, and the clip waits for the inner step, as Keras' global_clipnorm, the
    # documented equivalent, clips inside its own step.
    clip_after = keeps_slices and replicas == 1 and all(
        engine.sends_exactly(p) for p, g in zip(plans, grads) if g is not None)
    if not clip_after:
      grads = self.inner.clip(grads, replicas)  # each replica's own mean: grads * replicas
    slices = [k for k, g in enumerate(grads)
              if keeps_slices and isinstance(g, tf.IndexedSlices)
              and engine.sends_exactly(plans[k])]
    rest = [None if k in slices else g for k, g in enumerate(grads)]
    if any(g is not None for g in rest):
      sums, exchanged = guard.exchange(plans, rest, states, dense, mean=False)
      new_states, nbytes = exchanged.states, list(exchanged.nbytes)
    else:  # nothing for the compressed exchange
      sums, new_states, nbytes = list(rest), list(states), [None] * len(rest)
    if slices:
      gathered = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [grads[k] for k in slices])
      for k, total in zip(slices, gathered):
        sums[k] = total
        nbytes[k] = _slices_nbytes(grads[k])
    finite = guard.settle(indices, states, new_states, sums, nbytes)
    if clip_after:
      step = lambda summed: self.inner.own_step(summed, variables)  # noqa: E731
    else:
      step = lambda summed: self.inner.step(summed, variables)  # noqa: E731
    guard.on_every_replica_if(finite, step, sums)


def _slices_nbytes(grad: tf.IndexedSlices):
  """The bytes of one replica's ``IndexedSlices`` on the wire: its values and indices."""
  return (tf.cast(tf.size(grad.values), tf.int64) * grad.values.dtype.size
          + tf.cast(tf.size(grad.indices), tf.int64) * grad.indices.dtype.size)
