"""Byte accounting, the one place where the package counts bytes on the wire.

``exchange_nbytes`` is the byte model of the compressed exchange (``exchange``):
what one replica sends for each tensor, from the lengths that were really exchanged.
``summarize`` turns per-tensor bytes into per-kind totals and compression ratios (dense
float32 bytes / bytes sent), for the optimizer, the cross-device ops, the Keras callback,
the simulation and the examples' reports. docs/wire_format.md describes both.
"""

import math

import tensorflow as tf

LENGTH_NBYTES = 4  # each compact payload's length travels as one int32 word


def exchange_nbytes(lengths) -> tf.Tensor:
  """Bytes one replica sends for each compact payload of one exchange.

  All compact payloads of a replica travel joined in one buffer, gathered from every
  replica; the collective pads every replica's buffer to the longest (so each replica
  sends ``4 * max over replicas of its total words``), and the lengths travel in a second
  gather (4 bytes per payload). That total is split among the payloads in proportion to
  their longest copy (integer bytes; the remainder goes to the largest), so that the
  shares add up to exactly what one replica sends. With one replica, or with equal
  lengths on every replica, a payload's share is 4 bytes plus its own bytes.

  Args:
    lengths: int ``[replicas, payloads]``, the words of each replica's trimmed payloads
      (``payload_nbytes // 4``).

  Returns:
    int64 ``[payloads]``.
  """
  words = tf.cast(lengths, tf.int64)
  padded = 4 * tf.reduce_max(tf.reduce_sum(words, axis=1))
  longest = 4 * tf.reduce_max(words, axis=0)
  total = tf.reduce_sum(longest)
  share = tf.where(total > 0, padded * longest // tf.maximum(total, 1), tf.zeros_like(longest))
  remainder = padded - tf.reduce_sum(share)
  largest = tf.one_hot(tf.argmax(longest), tf.size(longest), dtype=tf.int64)
  return LENGTH_NBYTES + share + remainder * largest


def split_nbytes(nbytes, weights) -> tf.Tensor:
  """Splits one payload's ``nbytes`` among the tensors it carries, in proportion to
  ``weights`` (integer bytes; the remainder goes to the largest), so that the parts add
  up to exactly ``nbytes``. A payload of one tensor gives it all.

  Args:
    nbytes: int64 scalar, the bytes of one (bucket) payload.
    weights: int64 ``[tensors]``, e.g. each tensor's own bytes in the payload.

  Returns:
    int64 ``[tensors]``.
  """
  weights = tf.cast(weights, tf.int64)
  total = tf.reduce_sum(weights)
  part = tf.where(total > 0, nbytes * weights // tf.maximum(total, 1), tf.zeros_like(weights))
  largest = tf.one_hot(tf.argmax(weights), tf.size(weights), dtype=tf.int64)
  return part + (nbytes - tf.reduce_sum(part)) * largest


def summarize(plans_and_bytes):
  """Per variable kind and in total, from ``(TensorPlan, bytes sent)`` pairs.

  Args:
    plans_and_bytes: iterable of ``(plan, nbytes)``, bytes one replica sent for that
      tensor in one step, everything counted.

  Returns:
    ``{kind: {"dense_bytes", "sent_bytes", "ratio"}}`` with a ``"total"`` entry; the
    ratio is dense float32 bytes / bytes sent (NaN before anything was sent).
  """
  summary = {}
  for plan, nbytes in plans_and_bytes:
    for kind in (plan.kind, "total"):
      entry = summary.setdefault(kind, {"dense_bytes": 0, "sent_bytes": 0})
      entry["dense_bytes"] += plan.dense_nbytes
      entry["sent_bytes"] += nbytes
  for entry in summary.values():
    entry["dense_bytes"], entry["sent_bytes"] = (float(entry["dense_bytes"]),
                                                 float(entry["sent_bytes"]))
    entry["ratio"] = ratio(entry["dense_bytes"], entry["sent_bytes"])
  return summary


def ratio(dense_bytes, sent_bytes) -> float:
  """Compression ratio: dense float32 bytes / bytes sent; NaN when nothing was sent."""
  return dense_bytes / sent_bytes if sent_bytes else math.nan


def adacomp_elements(num_elements: int, nbytes: float) -> float:
  """How many elements an AdaComp payload of ``nbytes`` (one replica's share from
  ``exchange_nbytes``) carries: the inverse of the byte model.

  A payload is 3 header words and ``count`` codes of ``index_bits(n) + 1`` bits (position
  and sign), plus the 4-byte length word (docs/wire_format.md). Exact to within one word
  for one replica or equal lengths; with unequal lengths the share includes part of the
  padding, so this reads slightly high (the longest replica's count, at most).
  """
  from tf_adacomp.ops import adacomp as adacomp_ops  # pylint: disable=g-import-not-at-top
  bits = adacomp_ops.index_bits(num_elements) + 1
  words = (nbytes - LENGTH_NBYTES) / 4 - 3
  return min(num_elements, max(words, 0.0) * 32 / bits)


def gather_nbytes(lengths):
  """The bytes of one joined, padded all-gather, from its ``[replicas, payloads]`` lengths
  (words), in NumPy: ``(sent, padded)``, float64 ``[replicas]`` the bytes each replica
  contributed (its words and one length word per payload) and the bytes every replica
  sends on the wire (the longest contribution: the collective pads to it). The total of
  ``exchange_nbytes`` over the payloads is ``padded``.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  lengths = np.asarray(lengths, np.int64)
  header = LENGTH_NBYTES * lengths.shape[1]
  words = lengths.sum(axis=1)
  return (4 * words + header).astype(np.float64), float(4 * words.max() + header)
