"""The compressed exchange: compress, gather compact payloads, decode and sum.

Two forms of the same exchange:

- ``replica_exchange`` runs in a replica context (inside ``strategy.run`` or a Keras
  train step) and uses the strategy's own collectives: ``all_reduce`` for summable
  payloads and ``all_gather`` for the others. It works under every strategy, including
  ``MultiWorkerMirroredStrategy`` over gRPC, and without one.
- ``local_exchange`` runs in a cross-replica context on per-device values (what a
  ``tf.distribute.CrossDeviceOps`` receives) and moves payloads between devices with
  plain copies.

Non-summable payloads have a static buffer length but only their used words are sent:
every replica trims its payloads, all payloads of a step travel in one all-gather with
their lengths in another (the collective pads every replica's buffer to the longest),
and each replica rebuilds the ``[replicas, words]`` rows and decodes them in replica
order, so that all replicas compute bit-identical sums.

With ``reduction="adasum"`` every payload is all-gathered (summable ones too: Adasum
needs each replica's tensor, not their sum), each replica's row is decoded on its own,
and the decoded tensors are combined with ``ops.adasum_reduce`` (same tree, same order, on
every replica).
"""

from typing import NamedTuple, Optional, Sequence

import tensorflow as tf

from tf_adacomp.compressors import base
from tf_adacomp.ops import adacomp as adacomp_ops
from tf_adacomp.ops import adasum as adasum_ops

REDUCTIONS = ("sum", "adasum")


def check_reduction(reduction) -> str:
  """Returns ``reduction`` if it is one of ``REDUCTIONS``, else raises ValueError naming it."""
  if reduction not in REDUCTIONS:
    raise ValueError(f"`reduction` must be one of {REDUCTIONS}. Received: reduction={reduction!r}")
  return reduction


class Exchanged(NamedTuple):
  """Result of an exchange, one entry per gradient (None where the gradient is None).

  Attributes:
    sums: the decoded sum over replicas of every gradient (with ``reduction="adasum"``,
      their Adasum).
    states: every gradient's new compressor state on this replica.
    nbytes: int64 scalars, the bytes one replica sends for each gradient (its payload,
      padded to the longest of any replica, plus 4 bytes of length).
  """
  sums: list
  states: list
  nbytes: list


def _used_words(compressor, payload, plan):
  return tf.cast(compressor.payload_nbytes(payload, plan) // 4, tf.int32)


def _dense_bits(grad):
  """A float32 gradient as int32 words: the payload of a dense (warm-up) step."""
  return tf.bitcast(tf.reshape(tf.cast(grad, tf.float32), [-1]), tf.int32)


def _rows(data, lengths, index: int, width: int, replicas: int):
  """The ``[replicas, width]`` payload rows of gradient ``index`` from gathered buffers.

  Args:
    data: 1-D int32, every replica's concatenated trimmed payloads, in replica order.
    lengths: int32 ``[replicas, gradients]``, the words of each trimmed payload.
    index: which gradient.
    width: the static payload length; rows are zero-padded to it.
    replicas: the number of replicas (collectives may not give it statically).
  """
  replica_start = tf.cumsum(tf.reduce_sum(lengths, axis=1), exclusive=True)
  start = replica_start + tf.cumsum(lengths, axis=1, exclusive=True)[:, index]
  length = lengths[:, index]
  longest = tf.reduce_max(length)
  offset = tf.range(longest)[None, :]
  valid = offset < length[:, None]
  rows = tf.where(valid, tf.gather(data, tf.where(valid, start[:, None] + offset, 0)), 0)
  rows = tf.pad(rows, [[0, 0], [0, width - longest]])
  return tf.ensure_shape(rows, [replicas, width])


def replica_exchange(compressor: base.Compressor, plans: Sequence[base.TensorPlan],
                     grads: Sequence[Optional[tf.Tensor]], states: Sequence[tuple],
                     dense=None, reduction: str = "sum") -> Exchanged:
  """Compresses this replica's gradients, exchanges payloads, decodes their sums.

  Must be called in a replica context by every replica, with gradients in the same
  order.

  Args:
    compressor: the ``Compressor``.
    plans: one ``TensorPlan`` per gradient.
    grads: this replica's gradients (None entries are passed through as None).
    states: each gradient's compressor state on this replica.
    dense: optional scalar bool tensor; when true, non-summable gradients are sent
      dense as float32 (a warm-up step) and their states are kept as they are. The
      same collectives run either way, so replicas never diverge in what they call.
    reduction: "sum" (the replicas' gradients are added) or "adasum" (combined with
      ``ops.adasum_reduce``; the caller scales the result as it needs).

  Returns:
    An ``Exchanged``.

  Raises:
    RuntimeError: called outside a replica context.
    ValueError: unknown ``reduction``.
  """
  adasum = check_reduction(reduction) == "adasum"
  ctx = tf.distribute.get_replica_context()
  if ctx is None:
    raise RuntimeError("replica_exchange must be called in a replica context "
                       "(inside strategy.run or a Keras train step).")
  sums = [None] * len(grads)
  new_states, nbytes = list(states), [None] * len(grads)
  summable, gathered = {}, {}
  for i, (grad, plan, state) in enumerate(zip(grads, plans, states)):
    if grad is None:
      continue
    payload, new_states[i] = compressor.compress(grad, state, plan)
    if plan.summable:
      summable[i] = payload
      nbytes[i] = compressor.payload_nbytes(payload, plan)
    else:
      used = _used_words(compressor, payload, plan)
      if dense is not None:
        payload, used, new_states[i] = _maybe_dense(dense, grad, payload, used, state,
                                                    new_states[i])
      gathered[i] = (payload, used)

  replicas = ctx.num_replicas_in_sync
  if summable and adasum:
    # One batched all-gather of every payload, then Adasum of the decoded rows.
    gathered_rows = ctx.all_gather([p[None] for p in summable.values()], axis=0)
    for (i, payload), rows in zip(summable.items(), gathered_rows):
      rows = tf.ensure_shape(rows, [replicas, *payload.shape])  # collectives lose it
      sums[i] = adasum_ops.adasum_reduce(
          [compressor.decompress(rows[r], plans[i]) for r in range(replicas)])
  elif summable:
    reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(summable.values()))
    for i, total in zip(summable, reduced):
      sums[i] = compressor.decompress(total, plans[i])

  if gathered:
    lengths = tf.stack([used for _, used in gathered.values()])
    buffer = tf.concat([payload[:used] for payload, used in gathered.values()], axis=0)
    all_lengths = ctx.all_gather(lengths[None], axis=0)
    all_data = ctx.all_gather(buffer, axis=0)
    for k, (i, (payload, _)) in enumerate(gathered.items()):
      rows = _rows(all_data, all_lengths, k, int(payload.shape[0]), replicas)
      if adasum:
        sums[i] = adasum_ops.adasum_reduce(
            [_decode(compressor, rows[r:r + 1], plans[i], dense) for r in range(replicas)])
      else:
        sums[i] = _decode(compressor, rows, plans[i], dense)
      nbytes[i] = adacomp_ops.exchange_nbytes(4 * all_lengths[:, k])
  return Exchanged(sums, new_states, nbytes)


def _maybe_dense(dense, grad, payload, used, state, new_state):
  """Payload, used words and state of a step that may be a dense warm-up step.

  One buffer wide enough for both the compressed payload and the float32 gradient;
  a dense step keeps the previous state (nothing was held back).
  """
  dense_words = _dense_bits(grad)
  width = max(int(payload.shape[0]), int(dense_words.shape[0]))
  pad = lambda t: tf.pad(t, [[0, width - int(t.shape[0])]])  # noqa: E731
  payload = tf.where(dense, pad(dense_words), pad(payload))
  used = tf.where(dense, int(dense_words.shape[0]), used)
  new_state = tuple(tf.where(dense, old, new) for old, new in zip(state, new_state))
  return payload, used, new_state


def _decode(compressor, rows, plan, dense):
  if dense is None:
    return compressor.decompress(rows, plan)
  n = plan.num_elements

  def decode_dense():
    values = tf.bitcast(rows[:, :n], tf.float32)
    total = values[0]
    for r in range(1, int(rows.shape[0])):  # replica order: bit-identical everywhere
      total += values[r]
    return tf.cast(tf.reshape(total, plan.shape), plan.dtype)

  width = compressor.payload_width(plan)
  return tf.cond(dense, decode_dense, lambda: compressor.decompress(rows[:, :width], plan))
