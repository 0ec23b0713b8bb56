"""``Exchange``, the compressed exchange of one compressor and one reduction, and
``replica_exchange``, its entry point for custom training loops (see the package doc)."""

from typing import List, Optional, Sequence, Union

import tensorflow as tf

from tf_adacomp import hierarchy as hierarchy_lib
from tf_adacomp import stats
from tf_adacomp.compressors import base
from tf_adacomp.compressors import cast
from tf_adacomp.compressors import registry
from tf_adacomp.exchange import hierarchical
from tf_adacomp.exchange.reduction import Reduction
from tf_adacomp.exchange.reduction import get_reduction
from tf_adacomp.exchange.warm_up import _decode
from tf_adacomp.exchange.warm_up import _dense_bits
from tf_adacomp.exchange.warm_up import _dense_totals
from tf_adacomp.exchange.warm_up import _maybe_dense
from tf_adacomp.exchange import warm_up
from tf_adacomp.exchange.wire import Exchanged
from tf_adacomp.exchange.wire import Incoming
from tf_adacomp.exchange.wire import Outgoing
from tf_adacomp.exchange.wire import checked_lengths
from tf_adacomp.exchange.wire import gathered_rows


class Exchange:
  """The compressed exchange of one compressor and one reduction (see the package doc).

  Holds only hyper-parameters; compressor states (residues) are passed in and returned,
  and their owner (an optimizer's per-replica variables, a cross-device op's per-device
  variables, a simulation's per-learner variables) decides where they live.

  Args:
    compressor: a ``Compressor``, a registered name or a serialized compressor.
    reduction: "sum" (default), "adasum" or a ``Reduction``.

  Raises:
    ValueError: unknown compressor or reduction.
  """

  def __init__(self, compressor="adacomp", reduction: Union[str, Reduction] = "sum"):
    self.compressor = registry.get_compressor(compressor)
    self.reduction = get_reduction(reduction)

  def sends_exactly(self, plan: base.TensorPlan) -> bool:
    """Whether this exchange sums a gradient of ``plan`` exactly: sent whole, as it is
    (``"none"``, or a tensor below the compressor's ``min_size``), with no state, and
    summed (not Adasum). Such a gradient may take the strategy's own all-reduce
    instead (an ``IndexedSlices`` then stays one: ``CompressedOptimizer``)."""
    exact = plan.dense or isinstance(self.compressor, cast.NoCompression)
    return exact and plan.summable and self.reduction.sums_payloads

  # --- Stage 1: on each replica ------------------------------------------------------

  def compress(self, plans: Sequence[base.TensorPlan], grads: Sequence[Optional[tf.Tensor]],
               states: Sequence[tuple], dense=None) -> Outgoing:
    """Compresses one replica's gradients.

    Args:
      plans: one ``TensorPlan`` per gradient.
      grads: this replica's gradients (None entries are skipped).
      states: each gradient's compressor state on this replica.
      dense: optional scalar bool tensor; when true, compact payloads are replaced by
        the float32 gradient (a warm-up step) and the states are kept as they are. The
        same collectives run either way, so replicas never diverge in what they call.
        Summable payloads narrower than float32 (fp16, bf16) still go to the
        all-reduce, and their float32 gradients go in one more compact bucket, the
        warm-up bucket (last in ``gathered``), whose total replaces the half-precision
        sum in a warm-up step; after warm-up it sends one word, unread (8 bytes with
        its length).

    Returns:
      An ``Outgoing``.
    """
    summable, gathered, shares, new_states = {}, {}, {}, list(states)
    present = [i for i, grad in enumerate(grads) if grad is not None]
    compact, warm = warm_up.buckets(self.compressor, plans, present, dense)
    # A summable gradient is a bucket of one, its payload all-reduced, not gathered.
    for bucket in [(i,) for i in present if plans[i].summable] + compact:
      bucket_grads = [grads[i] for i in bucket]
      bucket_states = [states[i] for i in bucket]
      bucket_plans = [plans[i] for i in bucket]
      payload, bucket_new = self.compressor.compress(bucket_grads, bucket_states, bucket_plans)
      if bucket_plans[0].summable:
        summable[bucket[0]], new_states[bucket[0]] = payload, bucket_new[0]
        continue
      share = self.compressor.nbytes(payload, bucket_plans)
      used = tf.cast(tf.reduce_sum(share) // 4, tf.int32)
      if dense is not None:
        payload, used, bucket_new = _maybe_dense(dense, bucket_grads, payload, used,
                                                 bucket_states, bucket_new)
        # A warm-up step sends float32 gradients: their bytes split by size.
        share = tf.where(dense, tf.constant([plans[i].dense_nbytes for i in bucket], tf.int64),
                         share)
      for i, new in zip(bucket, bucket_new):
        new_states[i] = new
      gathered[bucket] = (payload, used)
      shares[bucket] = share
    if warm:
      # The warm-up bucket: the float32 words of the narrow summable gradients, all of
      # them in a warm-up step (a compact bucket's usual route, so Adasum, the hierarchy
      # and the cross-device ops need nothing else). After warm-up one word, unread: a
      # buffer of 0 words would make an empty collective, which the collective kernels
      # do not survive (a segmentation fault in the hierarchy's all-gather).
      bucket = warm
      words = _dense_bits([grads[i] for i in bucket])
      gathered[bucket] = (words, tf.where(dense, int(words.shape[0]), 1))
      shares[bucket] = tf.where(dense, tf.constant([plans[i].dense_nbytes for i in bucket],
                                                   tf.int64), tf.zeros([len(bucket)], tf.int64))
      for i in bucket:
        new_states[i] = tuple(tf.where(dense, old, new)
                              for old, new in zip(states[i], new_states[i]))
    return Outgoing(summable, gathered, new_states, shares)

  # --- Stage 2: moving payloads -------------------------------------------------------

  def replica_exchange(self, plans, grads, states, dense=None,
                       hierarchy: Optional[hierarchy_lib.Hierarchy] = None) -> Exchanged:
    """The whole exchange in a replica context, with the strategy's collectives.

    Must be called in a replica context (inside ``strategy.run``, a Keras train step, or
    with no strategy) by every replica, with gradients in the same order.

    Args:
      plans, grads, states, dense: as for ``compress``.
      hierarchy: None (the flat exchange: every replica sends its payload to every
        other) or the ``hierarchy.Hierarchy`` of the strategy's replicas: the devices of
        each worker sum their gradients densely, the worker's first device compresses
        that sum with its state and exchanges one payload per worker with the other
        workers' first devices, and every device receives the decoded total (see
        ``hierarchical.hierarchical_exchange``).

    Returns:
      An ``Exchanged`` for this replica.

    Raises:
      RuntimeError: called in a cross-replica context.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
      raise RuntimeError("replica_exchange must be called in a replica context "
                         "(inside strategy.run or a Keras train step).")
    grads = [densified(g, plan) for g, plan in zip(grads, plans)]
    if hierarchy is not None:
      return hierarchical.hierarchical_exchange(self, hierarchy, plans, grads, states, dense)
    out = self.compress(plans, grads, states, dense)
    summed = summable_rows = data = lengths = None
    if out.summable and self.reduction.sums_payloads:
      summed = all_reduce_joined(ctx, list(out.summable.values()))
    elif out.summable:
      summable_rows = ctx.all_gather([p[None] for p in out.summable.values()], axis=0)
    if out.gathered:
      lengths = ctx.all_gather(out.lengths()[None], axis=0)
      data = ctx.all_gather(out.buffer(), axis=0)
    incoming = Incoming(ctx.num_replicas_in_sync, summed, summable_rows, data, lengths)
    sums = self.decode(plans, out, incoming, dense)
    return Exchanged(sums, out.states, self.nbytes(plans, out, incoming))

  def local_exchange(self, plans, grads: Sequence[Sequence], states: Sequence[Sequence],
                     devices: Sequence[str], targets: Sequence[str], dense=None):
    """The whole exchange in a cross-replica context, by copies between devices.

    Args:
      plans: one ``TensorPlan`` per gradient.
      grads: per replica, its gradients (as for ``compress``).
      states: per replica, each gradient's compressor state.
      devices: per replica, the device it compresses on.
      targets: the devices that receive the decoded totals.
      dense: as for ``compress``.

    Returns:
      ``(totals, exchanged)``: ``totals[t]`` the decoded totals on ``targets[t]`` (one
      per gradient, placed on that device); ``exchanged`` an ``Exchanged`` whose
      ``sums`` are ``totals[0]`` and whose ``states`` are the replicas' new states.
    """
    outs, buffers, lengths = [], [], []
    for replica_grads, replica_states, device in zip(grads, states, devices):
      with tf.device(device):  # compressed and trimmed where the gradient is
        replica_grads = [densified(g, plan) for g, plan in zip(replica_grads, plans)]
        out = self.compress(plans, replica_grads, replica_states, dense)
        outs.append(out)
        if out.gathered:
          buffers.append(out.buffer())
          lengths.append(out.lengths())
    first = outs[0]
    totals = []
    for target in targets:
      with tf.device(target):  # only payloads travel; each target decodes its own copy
        summed = summable_rows = data = stacked = None
        if first.summable and self.reduction.sums_payloads:
          summed = [tf.add_n([o.summable[i] for o in outs]) for i in first.summable]
        elif first.summable:
          summable_rows = [tf.stack([o.summable[i] for o in outs]) for i in first.summable]
        if first.gathered:
          stacked = tf.stack(lengths)
          data = tf.concat(buffers, axis=0)
        incoming = Incoming(len(outs), summed, summable_rows, data, stacked)
        totals.append(self.decode(plans, first, incoming, dense))
    with tf.device(targets[0]):
      counted = Incoming(len(outs), lengths=tf.stack(lengths) if first.gathered else None)
      nbytes = self.nbytes(plans, first, counted)
    return totals, Exchanged(totals[0], [o.states for o in outs], nbytes)

  # --- Stage 3: decoding and counting ---------------------------------------------------

  def decode(self, plans, out: Outgoing, incoming: Incoming,
             dense=None, stride=None) -> List[Optional[tf.Tensor]]:
    """Every gradient's decoded total from what all replicas sent.

    The gathered lengths are untrusted (``checked_lengths``): where they do not describe
    the gathered words, nothing is read from them and every total of a compact bucket
    (the warm-up bucket's included) is NaN, the mark of a corrupt payload, so that
    ``CompressedOptimizer`` skips the step on every replica (all receive the same
    lengths). In a warm-up step the gradients of the warm-up bucket (see ``compress``)
    get the float32 sum of their words instead of the half-precision one.

    Args:
      plans: one ``TensorPlan`` per gradient.
      out: this replica's ``Outgoing``: which gradients went which way, and the static
        widths of their payloads (every replica's are the same).
      incoming: what arrived from every replica.
      dense: as for ``compress``.
      stride: None (``incoming.data`` joins the replicas' buffers end to end) or a
        scalar: each replica's buffer starts ``stride`` words after the previous one's.

    Returns:
      One decoded total per gradient (None where ``out`` has no payload).
    """
    replicas = incoming.replicas
    sums = [None] * len(plans)
    for k, i in enumerate(out.summable):
      if incoming.summed is not None:
        (sums[i],) = self.compressor.decompress(incoming.summed[k], [plans[i]])
      else:
        rows = tf.ensure_shape(incoming.summable_rows[k], [replicas, *out.summable[i].shape])
        sums[i] = self.reduction.combine(
            [self.compressor.decompress(rows[r], [plans[i]])[0] for r in range(replicas)])
    if not out.gathered:
      return sums
    widths = [int(payload.shape[0]) for payload, _ in out.gathered.values()]
    # The lengths are checked once for all buckets: a wrong one shifts every later row,
    # so where they do not add up every compact total is marked, not only one bucket's.
    lengths, valid = checked_lengths(incoming.data, incoming.lengths, widths, replicas,
                                     stride)
    for k, bucket in enumerate(out.gathered):
      bucket_plans = [plans[i] for i in bucket]
      if bucket_plans[0].summable:  # the warm-up bucket (see ``compress``)
        totals = self._warm_up_totals(incoming.data, lengths, k, widths[k], replicas,
                                      stride, bucket_plans, [sums[i] for i in bucket], dense)
      else:
        rows = gathered_rows(incoming.data, lengths, k, widths[k], replicas, stride)
        totals = self.reduction.decode(
            lambda r, p=bucket_plans: _decode(self.compressor, r, p, dense), rows)
      for i, total in zip(bucket, totals):
        sums[i] = _marked(total, valid)
    return sums

  def _warm_up_totals(self, data, lengths, index, width, replicas, stride, plans, summed,
                      dense):
    """The totals of the warm-up bucket's gradients: in a warm-up step their float32
    words combined in replica order, else ``summed`` (what the summable route gave;
    None on a device that compressed nothing, in the hierarchy: zeros then). The rows
    are read in the warm-up branch only: after warm-up they would be zeros, and as
    large as the gradients."""
    summed = [tf.zeros(p.shape, p.dtype) if s is None else s for s, p in zip(summed, plans)]

    def warm_up():
      rows = gathered_rows(data, lengths, index, width, replicas, stride)
      return self.reduction.decode(lambda r: _dense_totals(r, plans), rows)

    return tf.cond(dense, warm_up, lambda: summed)

  def nbytes(self, plans, out: Outgoing, incoming: Incoming) -> list:
    """The bytes one replica sent for each gradient (None where it sent nothing).

    Compact payloads are counted from ``incoming.lengths``, the lengths every replica
    really sent: the gather pads each replica's buffer to the longest.
    """
    nbytes = [None] * len(plans)
    for i, payload in out.summable.items():
      nbytes[i] = self.compressor.nbytes(payload, [plans[i]])[0]
    if out.gathered:
      # Hostile lengths are refused by ``decode``; a negative one counts as none here.
      bucket_nbytes = stats.exchange_nbytes(tf.maximum(incoming.lengths, 0))
      for k, bucket in enumerate(out.gathered):
        split = stats.split_nbytes(bucket_nbytes[k], out.shares[bucket])
        for j, i in enumerate(bucket):
          # A gradient of the warm-up bucket sent its summable payload too.
          nbytes[i] = split[j] if nbytes[i] is None else nbytes[i] + split[j]
    return nbytes


def replica_exchange(compressor: base.Compressor, plans: Sequence[base.TensorPlan],
                     grads: Sequence[Optional[tf.Tensor]], states: Sequence[tuple],
                     dense=None, reduction: str = "sum", hierarchy=None) -> Exchanged:
  """Compresses this replica's gradients, exchanges payloads, decodes their totals.

  The entry point for custom training loops: call it inside ``strategy.run`` (or with no
  strategy) on every replica, with the gradients in the same order, and keep the
  returned states for the next step::

      exchanged = tf_adacomp.replica_exchange(compressor, plans, grads, states)
      # exchanged.sums: the summed gradients; exchanged.states: the new residues

  Args:
    compressor: the ``Compressor``.
    plans: one ``TensorPlan`` per gradient (``compressor.plan(shape, dtype, name)``).
    grads: this replica's gradients (None entries are passed through as None).
    states: each gradient's compressor state on this replica (``compressor.init(plan)``
      at first, then the previous step's ``states``).
    dense: optional scalar bool tensor; when true, compact payloads are sent as float32
      (a warm-up step) and the states are kept; half-precision payloads (fp16, bf16)
      are summed from float32 copies sent beside them (``Exchange.compress``).
    reduction: "sum" (the replicas' gradients are added) or "adasum" (combined with
      ``ops.adasum_reduce``; the caller scales the result as it needs).
    hierarchy: None (flat) or a ``tf_adacomp.hierarchy.Hierarchy``, e.g.
      ``tf_adacomp.hierarchy.resolve(strategy, None, None)`` made once before the
      training function is traced: one payload per worker (``Exchange.replica_exchange``).

  Returns:
    An ``Exchanged``.

  Raises:
    RuntimeError: called outside a replica context.
    ValueError: unknown ``reduction``.
  """
  return Exchange(compressor, reduction).replica_exchange(plans, grads, states, dense,
                                                         hierarchy)


def densified(grad, plan: base.TensorPlan):
  """``grad`` as a dense tensor of ``plan.shape``, its static shape set: an
  ``IndexedSlices`` summed into its rows, and one whose ``dense_shape`` is not static
  (``LossScaleOptimizer``'s unscaled slices) given the plan's shape, which the joined
  all-reduce and the compressors need."""
  if grad is None:
    return None
  dense = tf.convert_to_tensor(grad)
  if dense.shape.is_fully_defined():
    return dense
  return tf.ensure_shape(dense, plan.shape)


def _marked(total, valid):
  """``total``, or NaN everywhere where ``valid`` (a scalar bool) is false: the mark of a
  payload that cannot be trusted, which makes ``CompressedOptimizer`` skip the step."""
  return tf.where(valid, total, tf.constant(float("nan"), total.dtype))


def all_reduce_joined(ctx, tensors):
  """Sums ``tensors`` over replicas with one all-reduce per dtype: each group is
  flattened and joined first (Horovod's tensor fusion), then split back."""
  groups = {}
  for k, tensor in enumerate(tensors):
    groups.setdefault(tensor.dtype, []).append(k)
  summed = [None] * len(tensors)
  for ks in groups.values():
    joined = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                            tf.concat([tf.reshape(tensors[k], [-1]) for k in ks], 0))
    start = 0
    for k in ks:
      size = tensors[k].shape.num_elements()
      summed[k] = tf.reshape(joined[start:start + size], tensors[k].shape)
      start += size
  return summed
