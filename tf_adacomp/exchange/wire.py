"""What travels in one exchange, and how the gathered buffers are read back.

``Outgoing`` (what one replica sends), ``Incoming`` (what arrives from every replica),
``Exchanged`` (the result); ``checked_lengths`` (the untrusted gathered lengths, checked),
``gathered_rows`` (one payload's rows out of the joined buffers) and ``_padded_stride``
(the length every buffer is padded to in the hierarchical exchange).
"""

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import tensorflow as tf


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
