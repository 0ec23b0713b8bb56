"""How the compressed all-gather scales with the number of senders, against a ring.

The compressed exchange (``exchange.Exchange.replica_exchange``) all-gathers every
sender's compact payload to every sender: each receives ``senders - 1`` payloads per
step and decodes one row per sender. A dense ring all-reduce receives
``2 (senders - 1) / senders`` times the dense gradient, which stays under twice the
gradient however many senders there are. So past some number of senders the all-gather
receives more bytes than the dense ring, however small each payload is:

    (N - 1) p  >  2 (N - 1) / N d   <=>   N  >  2 d / p      (N >= 2)

with ``p`` the bytes one sender sends per step (as ``stats.exchange_nbytes`` counts
them, the ``bytes_sent`` of the package) and ``d`` the dense bytes (4 per float32
element). ``crossover_senders`` gives that N; ``check_allgather`` warns
(``AllGatherScalingWarning``) at or past it. docs/scaling.md has the measured figures,
the model built on them and its command (``benchmarks/scaling.py``).

Every function takes plain numbers and needs no TensorFlow.
"""

import fractions
import math
import numbers
import warnings

__all__ = ["AllGatherScalingWarning", "allgather_bytes_received", "check_allgather",
           "crossover_senders", "ring_allreduce_bytes_received"]


class AllGatherScalingWarning(UserWarning):
  """The compressed all-gather receives more bytes per step than a dense ring would."""


def _senders(value, name: str = "senders") -> int:
  """``value`` as an int >= 1 (not a bool), or ValueError naming it and the value."""
  if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
      or value < 1):
    raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
  return int(value)


def _nbytes(value, name: str, positive: bool = False):
  """``value`` as a finite real number >= 0 (> 0 with ``positive``), or ValueError."""
  if (isinstance(value, bool) or not isinstance(value, numbers.Real)
      or not math.isfinite(value) or value < 0 or (positive and value == 0)):
    bound = "> 0" if positive else ">= 0"
    raise ValueError(f"`{name}` must be a finite number of bytes {bound}. "
                     f"Received: {name}={value!r}")
  return value


def _exact(value) -> fractions.Fraction:
  """A real number as the exact fraction it holds (a float's binary value, not its repr)."""
  if isinstance(value, numbers.Rational):
    return fractions.Fraction(int(value.numerator), int(value.denominator))
  return fractions.Fraction(float(value))


def allgather_bytes_received(senders, payload_bytes):
  """Bytes one sender receives per step from an all-gather of compact payloads.

  Args:
    senders: the senders of the all-gather, an int >= 1 (the replicas of a flat
      exchange; the workers of a hierarchical one).
    payload_bytes: bytes one sender sends per step (``bytes_sent``, as
      ``stats.exchange_nbytes`` counts it: padding and length words included), >= 0.

  Returns:
    ``(senders - 1) * payload_bytes``.

  Raises:
    ValueError: ``senders`` not an integer >= 1, or ``payload_bytes`` negative, not
      finite or not a number; the message names the argument and the value received.
  """
  senders = _senders(senders)
  return (senders - 1) * _nbytes(payload_bytes, "payload_bytes")


def ring_allreduce_bytes_received(senders, dense_bytes):
  """Bytes one sender receives per step from a ring all-reduce of ``dense_bytes``.

  A ring all-reduce is a reduce-scatter then an all-gather, each moving
  ``(senders - 1) / senders`` of the tensor into every sender.

  Args:
    senders: the members of the ring, an int >= 1.
    dense_bytes: bytes of the tensor all-reduced (4 per float32 element; 2 for a
      bfloat16 cast), >= 0.

  Returns:
    ``2 * (senders - 1) / senders * dense_bytes`` (a float).

  Raises:
    ValueError: ``senders`` not an integer >= 1, or ``dense_bytes`` negative, not
      finite or not a number; the message names the argument and the value received.
  """
  senders = _senders(senders)
  return 2 * (senders - 1) / senders * _nbytes(dense_bytes, "dense_bytes")


def crossover_senders(dense_bytes, payload_bytes) -> int:
  """The fewest senders (>= 2) at which the all-gather receives more than the ring.

  ``allgather_bytes_received(N, payload_bytes) > ring_allreduce_bytes_received(N,
  dense_bytes)`` holds, for N >= 2, exactly when ``N > 2 * dense_bytes /
  payload_bytes``; this is the smallest such integer, computed exactly (no rounding of
  the quotient, so a quotient that is an integer counts as a tie, not a loss).

  Args:
    dense_bytes: bytes of the dense gradient a ring would all-reduce, > 0.
    payload_bytes: bytes one sender sends per step in the all-gather, > 0.

  Returns:
    An int >= 2: 2 when the payload is larger than the dense gradient.

  Raises:
    ValueError: either argument not a finite number > 0; the message names it and the
      value received.
  """
  dense = _exact(_nbytes(dense_bytes, "dense_bytes", positive=True))
  payload = _exact(_nbytes(payload_bytes, "payload_bytes", positive=True))
  return max(2, math.floor(2 * dense / payload) + 1)


def check_allgather(senders, payload_bytes, dense_bytes, warn=True) -> bool:
  """Whether ``senders`` have reached the all-gather's crossover; warns if so.

  Args:
    senders: the senders of the all-gather, an int >= 1.
    payload_bytes: bytes one sender sends per step (``bytes_sent``), > 0.
    dense_bytes: bytes of the dense gradient (4 per float32 element), > 0.
    warn: a bool; when True (the default) a result of True also issues an
      ``AllGatherScalingWarning`` that gives the senders, the crossover, the bytes each
      exchange receives per step and the remedies.

  Returns:
    True when ``senders >= crossover_senders(dense_bytes, payload_bytes)``: each sender
    receives more bytes per step from the all-gather than it would from a dense ring
    all-reduce. False otherwise (one sender never reaches it).

  Raises:
    ValueError: ``senders`` not an integer >= 1, a byte count not a finite number > 0,
      or ``warn`` not a bool; the message names the argument and the value received.
  """
  senders = _senders(senders)
  crossover = crossover_senders(dense_bytes, payload_bytes)
  if not isinstance(warn, bool):
    raise ValueError(f"`warn` must be a bool. Received: warn={warn!r}")
  if senders < crossover:
    return False
  if warn:
    gathered = allgather_bytes_received(senders, payload_bytes)
    ring = ring_allreduce_bytes_received(senders, dense_bytes)
    warnings.warn(
        f"The compressed all-gather has {senders} senders, at or past its crossover of "
        f"{crossover} (payload {payload_bytes:,.0f} bytes per sender per step, dense "
        f"gradient {dense_bytes:,.0f} bytes): each sender receives {gathered:,.0f} bytes "
        f"per step, where a dense ring all-reduce would receive {ring:,.0f}, and decodes "
        f"{senders} payloads. Remedies: the hierarchical exchange (fewer senders: one "
        f"per worker), local_steps=H (an exchange every H steps), or a summable "
        f"compressor such as \"bf16\", whose all-reduce scales like the dense one "
        f"(docs/scaling.md).", AllGatherScalingWarning, stacklevel=2)
  return True
