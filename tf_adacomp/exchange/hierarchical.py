"""The hierarchical exchange: one payload per worker (``Exchange.replica_exchange`` with a
``hierarchy.Hierarchy``).

The devices of each worker sum their gradients densely, the worker's first device
compresses that sum with its state and exchanges one payload per worker with the other
workers' first devices, and every device receives the decoded total. The functions take
the ``Exchange`` whose compressor, reduction and stages (``compress``, ``decode``,
``nbytes``) they use.
"""

import tensorflow as tf

from tf_adacomp.compressors import base
from tf_adacomp.exchange import warm_up
from tf_adacomp.exchange.wire import Exchanged
from tf_adacomp.exchange.wire import Incoming
from tf_adacomp.exchange.wire import Outgoing
from tf_adacomp.exchange.wire import _padded_stride


def hierarchical_exchange(exchange, hierarchy, plans, grads, states, dense) -> Exchanged:
  """``exchange.replica_exchange`` with one payload per worker (``hierarchy`` has the
  groups); ``exchange`` is the ``Exchange`` whose stages it runs.

  1. Every device of a worker adds its gradients into a dense local sum (float32
     all-reduce over the worker's fast links). A device other than the first adds its
     residue too and returns a zero residue: the worker's error feedback lives on its
     first device, and a residue elsewhere (a restore spreads the saved total evenly
     over the devices) is handed over rather than lost.
  2. The first device compresses the local sum with its state and exchanges the
     payload with the other workers' first devices (``_leaders_exchange``): the flat
     exchange among workers, one row per worker. With Adasum a worker's contribution
     is its devices' mean, so that equal workers still give their mean.
  3. The worker's devices receive what arrived: the compact payloads (lengths and
     words, a few bits per element) by a local all-reduce to which the other devices
     add zeros, and each decodes them itself, as every replica of the flat exchange
     does; the summable payloads' decoded totals (fp16, bf16, none: dense anyway) by a
     dense local all-reduce of the first device's totals and zeros. Every device ends
     with the same bits.

  ``nbytes`` is what the worker sent over the network, on its first device (zeros on
  the others; ``bytes_sent`` reads the first replica's).
  """
  position = hierarchy.current_position()
  present = [i for i, grad in enumerate(grads) if grad is not None]
  new_states = list(states)
  contributions = []
  for i in present:
    grad, state = grads[i], states[i]
    where = base.residue_position(state, plans[i].shape)
    if not position.leads and where is not None:
      grad = grad + tf.cast(state[where], grad.dtype)
      new_states[i] = tuple(tf.zeros_like(s) if k == where else s
                            for k, s in enumerate(state))
    contributions.append(grad)
  local = hierarchy.local_sum(position, contributions)
  if not exchange.reduction.sums_payloads:  # Adasum: a worker contributes its mean
    local = [t / hierarchy.devices_per_worker for t in local]
  layout = _layout(exchange, plans, present, dense)
  sums, nbytes, decoded = [None] * len(plans), [None] * len(plans), None
  summable = [i for i in present if plans[i].summable]
  if position.leads:
    summed_grads = [None] * len(plans)
    for i, total in zip(present, local):
      summed_grads[i] = total
    out, incoming, leader_sums = _leaders_exchange(
        exchange, hierarchy, position, plans, summed_grads, states, dense)
    new_states = out.states
    nbytes = exchange.nbytes(plans, out, incoming)
    totals = [tf.cast(leader_sums[i], plans[i].dtype) for i in summable]
    lengths, data = incoming.lengths, incoming.data
  else:
    for i in present:
      nbytes[i] = tf.constant(0, tf.int64)
    with tf.control_dependencies(local):  # launched after the first local all-reduce
      totals = [tf.zeros(plans[i].shape, plans[i].dtype) for i in summable]
      lengths = data = None
      if layout.gathered:
        lengths = tf.zeros([hierarchy.workers, len(layout.gathered)], tf.int32)
  if layout.gathered:
    lengths = hierarchy.local_sum(position, [lengths])[0]
    # The leader's stride (the same lengths): the size of the data it gathered.
    stride = _padded_stride(lengths, [int(p.shape[0]) for p, _ in layout.gathered.values()])
    if data is None:
      data = tf.zeros([hierarchy.workers * stride], tf.int32)
    data = hierarchy.local_sum(position, [data])[0]
    incoming = Incoming(hierarchy.workers, data=data, lengths=lengths)
    decoded = exchange.decode(plans, layout, incoming, dense, stride=stride)
    for i in present:
      if not plans[i].summable:
        sums[i] = decoded[i]
  for i, total in zip(summable, hierarchy.local_sum(position, totals)):
    sums[i] = total
    if decoded is not None and decoded[i] is not None:  # in the warm-up bucket
      sums[i] = tf.where(dense, decoded[i], total)
  return Exchanged(sums, new_states, nbytes)


def _layout(exchange, plans, present, dense) -> Outgoing:
  """The compact buckets ``compress`` makes of the gradients ``present``, with payloads
  of their static widths (zeros): what ``decode`` needs to read rows on a device that
  compressed nothing. Summable gradients are left out, but for the warm-up bucket."""
  compact, warm = warm_up.buckets(exchange.compressor, plans, present, dense)
  gathered = {}
  for bucket in compact:
    bucket_plans = [plans[i] for i in bucket]
    width = exchange.compressor.width(bucket_plans)
    if dense is not None:  # _maybe_dense: wide enough for the float32 gradients
      width = max(width, sum(plan.num_elements for plan in bucket_plans))
    gathered[bucket] = (tf.zeros([width], tf.int32), None)
  if warm:
    width = sum(plans[i].num_elements for i in warm)
    gathered[warm] = (tf.zeros([width], tf.int32), None)
  return Outgoing({}, gathered, [], {})


def _leaders_exchange(exchange, hierarchy, position, plans, grads, states, dense):
  """The flat exchange among the workers' first devices (``replica_exchange``'s
  collectives, in the leaders' group): ``(out, incoming, sums)``, ``incoming.data``
  each worker's buffer padded to the longest."""
  out = exchange.compress(plans, grads, states, dense)
  summed = summable_rows = data = lengths = None
  if out.summable and exchange.reduction.sums_payloads:
    summed = hierarchy.leaders_sum(position, list(out.summable.values()))
  elif out.summable:
    summable_rows = [hierarchy.leaders_gather(position, p[None])
                     for p in out.summable.values()]
  stride = None
  if out.gathered:
    lengths = hierarchy.leaders_gather(position, out.lengths()[None])
    # The gather needs one shape from every worker: each buffer is padded to the
    # longest, and row r starts at r * stride. The lengths that arrived may not be
    # those sent: cut to the stride they give (then refused by decode), as every
    # worker computes the same stride from them.
    stride = _padded_stride(lengths, [int(p.shape[0]) for p, _ in out.gathered.values()])
    buffer = out.buffer()[:stride]
    data = hierarchy.leaders_gather(
        position, tf.pad(buffer, [[0, stride - tf.shape(buffer)[0]]]))
  incoming = Incoming(hierarchy.workers, summed, summable_rows, data, lengths)
  # The compact payloads are decoded by every device of the worker (the caller).
  summable_only = Outgoing(out.summable, {}, out.states, out.shares)
  return out, incoming, exchange.decode(plans, summable_only, incoming, dense)
