"""The dense warm-up step's payloads: float32 gradients sent as int32 words.

In a warm-up step (``dense`` true) a compact bucket sends its float32 gradients instead
of the compressed payload (``_maybe_dense``, ``_dense_bits``), decoded by
``_dense_totals``; ``_decode`` picks one or the other. ``buckets`` decides an exchange's
buckets once, the warm-up bucket included (``_narrow_on_the_wire``: which summable
gradients need it), for ``Exchange.compress`` and the hierarchy alike.
"""

import tensorflow as tf


def _dense_bits(grads):
  """Float32 gradients as int32 words, joined: the payload of a dense (warm-up) step."""
  return tf.concat([tf.bitcast(tf.reshape(tf.cast(g, tf.float32), [-1]), tf.int32)
                    for g in grads], 0)


def _maybe_dense(dense, grads, payload, used, states, new_states):
  """Payload, used words and states of a bucket in a step that may be a dense warm-up.

  One buffer wide enough for both the compressed payload and the float32 gradients;
  a dense step keeps the previous states (nothing was held back).
  """
  dense_words = _dense_bits(grads)
  width = max(int(payload.shape[0]), int(dense_words.shape[0]))
  pad = lambda t: tf.pad(t, [[0, width - int(t.shape[0])]])  # noqa: E731
  payload = tf.where(dense, pad(dense_words), pad(payload))
  used = tf.where(dense, int(dense_words.shape[0]), used)
  new_states = [tuple(tf.where(dense, old, new) for old, new in zip(state, new_state))
                for state, new_state in zip(states, new_states)]
  return payload, used, new_states


def _decode(compressor, rows, plans, dense):
  """The sums of the contributions of a bucket's ``rows``, one per gradient, from
  compressed payloads or (warm-up) float32 words."""
  width = compressor.width(plans)
  if dense is None:
    return compressor.decompress(rows[:, :width], plans)
  return tf.cond(dense, lambda: _dense_totals(rows, plans),
                 lambda: compressor.decompress(rows[:, :width], plans))


def _dense_totals(rows, plans):
  """The sums of a warm-up step's float32 ``rows`` (``_dense_bits``), one per gradient
  of ``plans``, added in float32 in replica order and cast to each gradient's dtype."""
  values = tf.bitcast(rows[:, :sum(plan.num_elements for plan in plans)], tf.float32)
  total = values[0]
  for r in range(1, int(rows.shape[0])):  # replica order: bit-identical everywhere
    total += values[r]
  sums, start = [], 0
  for plan in plans:
    sums.append(tf.cast(tf.reshape(total[start:start + plan.num_elements], plan.shape),
                        plan.dtype))
    start += plan.num_elements
  return sums


def buckets(compressor, plans, present, dense):
  """The buckets of one exchange, decided from the plans alone (``Exchange.compress``
  fills them; ``hierarchical._layout`` rebuilds their widths on a device that compressed
  nothing): ``(compact, warm)``, the compressor's buckets of the present compact
  gradients (tuples of indices into ``plans``) and the warm-up bucket (a tuple, empty
  without a warm-up or a narrow summable gradient).

  Args:
    compressor: the exchange's compressor.
    plans: one plan per gradient.
    present: the indices of the gradients that are not None.
    dense: None (no warm-up) or the warm-up flag.
  """
  compact = [i for i in present if not plans[i].summable]
  grouped = [tuple(compact[j] for j in group)
             for group in compressor.buckets([plans[i] for i in compact])]
  warm = tuple(i for i in present
               if dense is not None and _narrow_on_the_wire(compressor, plans[i]))
  return grouped, warm


def _narrow_on_the_wire(compressor, plan) -> bool:
  """Whether a summable ``plan``'s payload is narrower than float32 (a cast compressor's
  ``wire_dtype``, or a half-precision gradient sent as it is): such a gradient needs the
  warm-up bucket to be summed as float32 in a warm-up step. Decided from the plan alone,
  as ``buckets`` decides. An empty
  tensor has nothing to sum (and would make a bucket of width 0, too narrow for its one
  word)."""
  if not plan.summable or not plan.num_elements:
    return False
  wire = None if plan.dense else getattr(compressor, "wire_dtype", None)
  return tf.as_dtype(wire or plan.dtype).size < 4
