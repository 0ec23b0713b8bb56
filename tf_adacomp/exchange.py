"""The compressed exchange, in one place: compress, move, decode, combine, count bytes.

Every compressed exchange of the package runs through ``Exchange``, whose work is split
in three stages, so that only the middle one depends on how payloads travel:

1. ``Exchange.compress``, on each replica: its gradients become payloads and new
   compressor states. Summable payloads (dense tensors, e.g. a float16 cast) are kept
   whole (and all-reduced joined, one buffer per dtype); compact payloads (AdaComp, FFT,
   top-k) come one per bucket (``Compressor.buckets``: AdaComp fuses the tensors of one
   bin size into one payload, the others send one per tensor), are trimmed to their used
   words and joined in one buffer, with their lengths in a second one (``Outgoing``).
2. Moving them: in a replica context with the strategy's collectives
   (``Exchange.replica_exchange``: one ``all_reduce`` of the summable payloads and two
   ``all_gather`` calls, lengths and data; this works under every strategy, including
   ``MultiWorkerMirroredStrategy`` over gRPC, and without one), or in a cross-replica
   context by copying each replica's buffers to each destination device
   (``Exchange.local_exchange``, used by ``CompressedAllReduce`` and by
   ``simulate.SimulatedLearners``).
3. ``Exchange.decode``: from what arrived (``Incoming``: every replica's buffers and
   lengths, or the summed summable payloads), the ``[replicas, words]`` rows of each
   tensor are rebuilt and decoded in replica order, so that every replica (and every
   destination device) computes bit-identical results; the ``Reduction`` combines them.

What one replica sent is counted from the lengths that were really exchanged, by
``stats.exchange_nbytes`` (the one byte model of the package; docs/wire_format.md).

With ``reduction="adasum"`` every payload travels to every replica (summable ones too:
Adasum needs each replica's tensor, not their sum), each replica's row is decoded on its
own, and the decoded tensors are combined with ``ops.adasum_reduce`` (same tree, same
order, on every replica).
"""

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import tensorflow as tf

from tf_adacomp import hierarchy as hierarchy_lib
from tf_adacomp import stats
from tf_adacomp.compressors import base
from tf_adacomp.compressors import cast
from tf_adacomp.compressors import registry
from tf_adacomp.ops import adasum as adasum_ops


# --- Reductions ------------------------------------------------------------------------


class Reduction:
  """How the replicas' decoded contributions combine: a sum or their Adasum.

  ``combine`` gives a total in the reduction's own units: for "sum" the sum of the
  contributions, for "adasum" their Adasum (equal contributions give their mean,
  orthogonal ones their sum). ``to_sum`` and ``to_mean`` turn that total into what a SUM
  or a MEAN reduction of ``replicas`` contributions should return.
  """

  name: str = ""
  # Whether summable payloads may be added by an all-reduce before decoding.
  sums_payloads: bool = True

  def combine(self, tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """The replicas' contributions combined, in replica order (the same on every replica).

    Args:
      tensors: one decoded tensor per replica, of one shape and dtype.

    Returns:
      Their total, in this reduction's units.
    """
    raise NotImplementedError

  def decode(self, decode_rows, rows: tf.Tensor) -> List[tf.Tensor]:
    """Decodes one bucket's rows and combines them, gradient by gradient.

    Args:
      decode_rows: ``decode_rows(r)`` decodes ``[r, words]`` payload rows of the bucket
        into the sum of their contributions, one tensor per gradient.
      rows: the bucket's ``[replicas, words]`` payload rows.

    Returns:
      One combined total per gradient of the bucket.
    """
    raise NotImplementedError

  def to_sum(self, total, replicas: int):
    """What a SUM reduction of ``replicas`` contributions returns, from ``combine``'s total."""
    raise NotImplementedError

  def to_mean(self, total, replicas: int):
    """What a MEAN reduction of ``replicas`` contributions returns, from ``combine``'s total."""
    raise NotImplementedError

  def __repr__(self):
    return f"Reduction({self.name!r})"


class _Sum(Reduction):
  name = "sum"
  sums_payloads = True

  def combine(self, tensors):
    total = tensors[0]
    for t in tensors[1:]:  # replica order: bit-identical everywhere
      total += t
    return total

  def decode(self, decode_rows, rows):
    return decode_rows(rows)  # the compressor sums the rows in replica order

  def to_sum(self, total, replicas):
    return total

  def to_mean(self, total, replicas):
    return total / replicas


class _Adasum(Reduction):
  name = "adasum"
  sums_payloads = False

  def combine(self, tensors):
    return adasum_ops.adasum_reduce(list(tensors))

  def decode(self, decode_rows, rows):
    per_row = [decode_rows(rows[r:r + 1]) for r in range(int(rows.shape[0]))]
    return [self.combine(list(tensors)) for tensors in zip(*per_row)]

  def to_sum(self, total, replicas):
    return total * replicas

  def to_mean(self, total, replicas):
    return total


SUM = _Sum()
ADASUM = _Adasum()
_REDUCTIONS = {r.name: r for r in (SUM, ADASUM)}
REDUCTIONS = tuple(_REDUCTIONS)  # the names: ("sum", "adasum")


def get_reduction(reduction) -> Reduction:
  """The ``Reduction`` named ``reduction`` ("sum" or "adasum"; a ``Reduction`` passes).

  Raises:
    ValueError: any other value, named in the message.
  """
  if isinstance(reduction, Reduction):
    return reduction
  if isinstance(reduction, str) and reduction in _REDUCTIONS:
    return _REDUCTIONS[reduction]
  raise ValueError(f"`reduction` must be one of {REDUCTIONS}. Received: reduction={reduction!r}")


def check_reduction(reduction) -> str:
  """The name of ``reduction`` ("sum" or "adasum"; a ``Reduction`` gives its name).

  Raises:
    ValueError: any other value, named in the message.
  """
  return get_reduction(reduction).name


# --- The engine ------------------------------------------------------------------------


class Outgoing(NamedTuple):
  """What one replica sends in one exchange.

  Attributes:
    summable: ``{index: payload}``, dense payloads that may be added by an all-reduce.
    gathered: ``{bucket: (payload, used)}``, one compact int32 payload of static length
      per bucket (a tuple of gradient indices), and the number of its words that are
      used (only those are sent).
    states: every gradient's new compressor state on this replica.
    shares: ``{bucket: int64 [len(bucket)]}``, the weights by which the bytes of each
      bucket are split among its gradients.
  """
  summable: Dict[int, tf.Tensor]
  gathered: Dict[Tuple[int, ...], Tuple[tf.Tensor, tf.Tensor]]
  states: list
  shares: Dict[Tuple[int, ...], tf.Tensor]

  def buffer(self) -> tf.Tensor:
    """The used words of every compact payload, joined (int32, 1-D)."""
    return tf.concat([payload[:used] for payload, used in self.gathered.values()], axis=0)

  def lengths(self) -> tf.Tensor:
    """int32 ``[compact payloads]``: the words of each in ``buffer()``."""
    return tf.stack([used for _, used in self.gathered.values()])


class Incoming(NamedTuple):
  """What arrives from every replica in one exchange: the input of ``Exchange.decode``.

  Only the fields of the routes ``Outgoing`` used are set; the others are None.

  Attributes:
    replicas: the number of replicas that sent (collectives may not give it statically).
    summed: the summable payloads added over replicas, in ``Outgoing.summable`` order
      (when the reduction ``sums_payloads``).
    summable_rows: ``[replicas, ...]`` summable payloads, one per ``Outgoing.summable``
      entry (when it does not: Adasum needs each replica's tensor).
    data: 1-D int32, every replica's ``Outgoing.buffer()`` joined in replica order.
    lengths: int32 ``[replicas, compact payloads]``, every replica's
      ``Outgoing.lengths()``.
  """
  replicas: int
  summed: Optional[List[tf.Tensor]] = None
  summable_rows: Optional[List[tf.Tensor]] = None
  data: Optional[tf.Tensor] = None
  lengths: Optional[tf.Tensor] = None


class Exchanged(NamedTuple):
  """Result of an exchange, one entry per gradient (None where the gradient is None).

  Attributes:
    sums: the decoded total over replicas of every gradient, in the reduction's units
      (``Reduction.combine``: the sum, or with Adasum their Adasum).
    states: every gradient's new compressor state on this replica (a list per replica
      from ``local_exchange``).
    nbytes: int64 scalars, the bytes one replica sent for each gradient
      (``stats.exchange_nbytes``: all that crossed the wire, padding and lengths included).
  """
  sums: list
  states: list
  nbytes: list


class Exchange:
  """The compressed exchange of one compressor and one reduction (see module doc).

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
    compact, warm = [], []
    for i, (grad, plan, state) in enumerate(zip(grads, plans, states)):
      if grad is None:
        continue
      if not plan.summable:
        compact.append(i)
        continue
      summable[i], new_states[i] = self.compressor.compress(grad, state, plan)
      if dense is not None and _narrow_on_the_wire(self.compressor, plan):
        warm.append(i)
    for group in self.compressor.buckets([plans[i] for i in compact]):
      bucket = tuple(compact[j] for j in group)
      bucket_grads = [grads[i] for i in bucket]
      bucket_states = [states[i] for i in bucket]
      payload, bucket_new = self.compressor.compress_bucket(
          bucket_grads, bucket_states, [plans[i] for i in bucket])
      share = self.compressor.bucket_nbytes(payload, [plans[i] for i in bucket])
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
      bucket = tuple(warm)
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
        ``_hierarchical_exchange``).

    Returns:
      An ``Exchanged`` for this replica.

    Raises:
      RuntimeError: called in a cross-replica context.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
      raise RuntimeError("replica_exchange must be called in a replica context "
                         "(inside strategy.run or a Keras train step).")
    grads = [_densified(g, plan) for g, plan in zip(grads, plans)]
    if hierarchy is not None:
      return self._hierarchical_exchange(hierarchy, plans, grads, states, dense)
    out = self.compress(plans, grads, states, dense)
    summed = summable_rows = data = lengths = None
    if out.summable and self.reduction.sums_payloads:
      summed = _all_reduce_joined(ctx, list(out.summable.values()))
    elif out.summable:
      summable_rows = ctx.all_gather([p[None] for p in out.summable.values()], axis=0)
    if out.gathered:
      lengths = ctx.all_gather(out.lengths()[None], axis=0)
      data = ctx.all_gather(out.buffer(), axis=0)
    incoming = Incoming(ctx.num_replicas_in_sync, summed, summable_rows, data, lengths)
    sums = self.decode(plans, out, incoming, dense)
    return Exchanged(sums, out.states, self.nbytes(plans, out, incoming))

  def _hierarchical_exchange(self, hierarchy, plans, grads, states, dense) -> Exchanged:
    """``replica_exchange`` with one payload per worker (``hierarchy`` has the groups).

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
    if not self.reduction.sums_payloads:  # Adasum: a worker contributes its mean
      local = [t / hierarchy.devices_per_worker for t in local]
    layout = self._layout(plans, present, dense)
    sums, nbytes, decoded = [None] * len(plans), [None] * len(plans), None
    summable = [i for i in present if plans[i].summable]
    if position.leads:
      summed_grads = [None] * len(plans)
      for i, total in zip(present, local):
        summed_grads[i] = total
      out, incoming, leader_sums = self._leaders_exchange(
          hierarchy, position, plans, summed_grads, states, dense)
      new_states = out.states
      nbytes = self.nbytes(plans, out, incoming)
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
      decoded = self.decode(plans, layout, incoming, dense, stride=stride)
      for i in present:
        if not plans[i].summable:
          sums[i] = decoded[i]
    for i, total in zip(summable, hierarchy.local_sum(position, totals)):
      sums[i] = total
      if decoded is not None and decoded[i] is not None:  # in the warm-up bucket
        sums[i] = tf.where(dense, decoded[i], total)
    return Exchanged(sums, new_states, nbytes)

  def _layout(self, plans, present, dense) -> Outgoing:
    """The compact buckets ``compress`` makes of the gradients ``present``, with payloads
    of their static widths (zeros): what ``decode`` needs to read rows on a device that
    compressed nothing. Summable gradients are left out, but for the warm-up bucket."""
    compact = [i for i in present if not plans[i].summable]
    warm = [i for i in present if dense is not None
            and _narrow_on_the_wire(self.compressor, plans[i])]
    gathered = {}
    for group in self.compressor.buckets([plans[i] for i in compact]):
      bucket = tuple(compact[j] for j in group)
      bucket_plans = [plans[i] for i in bucket]
      width = self.compressor.bucket_width(bucket_plans)
      if dense is not None:  # _maybe_dense: wide enough for the float32 gradients
        width = max(width, sum(plan.num_elements for plan in bucket_plans))
      gathered[bucket] = (tf.zeros([width], tf.int32), None)
    if warm:
      width = sum(plans[i].num_elements for i in warm)
      gathered[tuple(warm)] = (tf.zeros([width], tf.int32), None)
    return Outgoing({}, gathered, [], {})

  def _leaders_exchange(self, hierarchy, position, plans, grads, states, dense):
    """The flat exchange among the workers' first devices (``replica_exchange``'s
    collectives, in the leaders' group): ``(out, incoming, sums)``, ``incoming.data``
    each worker's buffer padded to the longest."""
    out = self.compress(plans, grads, states, dense)
    summed = summable_rows = data = lengths = None
    if out.summable and self.reduction.sums_payloads:
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
    return out, incoming, self.decode(plans, summable_only, incoming, dense)

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
        replica_grads = [_densified(g, plan) for g, plan in zip(replica_grads, plans)]
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
        sums[i] = self.compressor.decompress(incoming.summed[k], plans[i])
      else:
        rows = tf.ensure_shape(incoming.summable_rows[k], [replicas, *out.summable[i].shape])
        sums[i] = self.reduction.combine(
            [self.compressor.decompress(rows[r], plans[i]) for r in range(replicas)])
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
      nbytes[i] = self.compressor.payload_nbytes(payload, plans[i])
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


# --- Helpers ---------------------------------------------------------------------------


def checked_lengths(data, lengths, widths, replicas: int, stride=None):
  """The gathered ``lengths`` if they add up, else zeros, and whether they did.

  The lengths come from other replicas: nothing guarantees that they describe ``data``.
  They add up when every length is in ``[0, width]`` of its payload and, with ``stride``
  None (buffers joined end to end), all of them add up to ``tf.size(data)``; with a
  ``stride`` (buffers padded to one length, replica r's at ``r * stride``), ``stride >=
  0``, each replica's lengths add up to at most ``stride`` and ``replicas * stride`` is
  ``tf.size(data)``. Then every word they name lies in its own replica's part of
  ``data``; otherwise a negative length would silently shift every later replica's rows
  and one too large would read past ``data``. Every replica receives the same lengths, so
  all of them reach the same verdict. A few scalar ops, no dynamic shape (XLA can
  compile it).

  Args:
    data: 1-D, every replica's joined payload words, in replica order.
    lengths: int32 ``[replicas, payloads]``, the words of each replica's payloads.
    widths: the width of each payload, the most words it may have (a sequence of ints
      or an int32 ``[payloads]`` tensor).
    replicas: the number of replicas (static).
    stride: None or a scalar, as for ``gathered_rows``.

  Returns:
    ``(lengths, valid)``: int32 ``[replicas, payloads]``, ``lengths`` where they add up,
    zeros where they do not (nothing is then read); a scalar bool, whether they did.
  """
  lengths = tf.convert_to_tensor(lengths, tf.int32)
  widths = tf.convert_to_tensor(widths, tf.int32)
  in_range = tf.reduce_all(tf.logical_and(lengths >= 0, lengths <= widths[None, :]))
  # In int64: hostile lengths near 2^31 would wrap an int32 sum back into range.
  per_replica = tf.reduce_sum(tf.cast(lengths, tf.int64), axis=1)
  size = tf.cast(tf.size(data), tf.int64)
  if stride is None:
    adds_up = tf.equal(tf.reduce_sum(per_replica), size)
  else:
    stride = tf.cast(stride, tf.int64)
    adds_up = tf.logical_and(
        tf.logical_and(stride >= 0, tf.equal(replicas * stride, size)),
        tf.reduce_all(per_replica <= stride))
  valid = tf.logical_and(in_range, adds_up)
  return tf.where(valid, lengths, tf.zeros_like(lengths)), valid


def gathered_rows(data, lengths, index: int, width: int, replicas: int, stride=None):
  """The ``[replicas, width]`` payload rows of payload ``index`` from gathered buffers.

  Lengths that do not add up (``checked_lengths``, with this payload's ``width``) read
  nothing: every row is zeros. The caller who must tell that from empty payloads calls
  ``checked_lengths`` itself (``Exchange.decode`` does, and marks the step).

  Args:
    data: 1-D int32, every replica's joined trimmed payloads, in replica order.
    lengths: int32 ``[replicas, payloads]``, the words of each trimmed payload.
    index: which payload.
    width: the static payload length; rows are zero-padded to it.
    replicas: the number of replicas (collectives may not give it statically).
    stride: None (the replicas' buffers are joined end to end) or a scalar: replica r's
      buffer starts at ``r * stride`` (buffers padded to one length).

  Returns:
    int32 ``[replicas, width]``: row r holds replica r's payload, then zeros.
  """
  lengths = tf.convert_to_tensor(lengths, tf.int32)
  # Only this payload's width is known here (the others' are bounded by int32 alone);
  # every index read below is then inside ``data`` and the padding below is >= 0.
  widths = tf.where(tf.equal(tf.range(tf.shape(lengths)[1]), index), width, 2**31 - 1)
  lengths, _ = checked_lengths(data, lengths, widths, replicas, stride)
  if stride is None:
    replica_start = tf.cumsum(tf.reduce_sum(lengths, axis=1), exclusive=True)
  else:
    replica_start = tf.range(tf.shape(lengths)[0]) * tf.cast(stride, tf.int32)
  start = replica_start + tf.cumsum(lengths, axis=1, exclusive=True)[:, index]
  length = lengths[:, index]
  longest = tf.reduce_max(length)
  offset = tf.range(longest)[None, :]
  valid = offset < length[:, None]
  rows = tf.where(valid, tf.gather(data, tf.where(valid, start[:, None] + offset, 0)), 0)
  rows = tf.pad(rows, [[0, 0], [0, width - longest]])
  return tf.ensure_shape(rows, [replicas, width])


def _padded_stride(lengths, widths: Sequence[int]):
  """The words of the longest replica buffer, from gathered ``lengths``: what each
  buffer is padded to in the hierarchical exchange. Clipped to ``[1, sum(widths)]`` (no
  honest buffer is longer, or empty), so that hostile lengths cannot ask for a negative
  padding, an allocation of gigabytes or an empty all-gather (which crashes the
  collective kernels); ``checked_lengths`` then refuses them."""
  longest = tf.reduce_max(tf.reduce_sum(tf.cast(lengths, tf.int64), axis=1))
  return tf.cast(tf.clip_by_value(longest, 1, max(1, sum(widths))), tf.int32)


def _densified(grad, plan: base.TensorPlan):
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


def _all_reduce_joined(ctx, tensors):
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
  width = compressor.bucket_width(plans)
  if dense is None:
    return compressor.decompress_bucket(rows[:, :width], plans)
  return tf.cond(dense, lambda: _dense_totals(rows, plans),
                 lambda: compressor.decompress_bucket(rows[:, :width], plans))


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


def _narrow_on_the_wire(compressor, plan) -> bool:
  """Whether a summable ``plan``'s payload is narrower than float32 (a cast compressor's
  ``wire_dtype``, or a half-precision gradient sent as it is): such a gradient needs the
  warm-up bucket to be summed as float32 in a warm-up step. Decided from the plan alone,
  so that ``compress`` and ``_layout`` make the same buckets. An empty tensor has nothing
  to sum (and would make a bucket of width 0, too narrow for its one word)."""
  if not plan.summable or not plan.num_elements:
    return False
  wire = None if plan.dense else getattr(compressor, "wire_dtype", None)
  return tf.as_dtype(wire or plan.dtype).size < 4
