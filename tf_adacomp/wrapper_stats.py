"""What the optimizer wrappers report of their last step: bytes per variable, the
compression summary, the bytes of the shared Adam moment's average, and whether the
all-gather is past its crossover (with the thread that checks it once, unasked)."""

import threading
import time
from typing import Optional
import weakref

import numpy as np

from tf_adacomp import compile_log
from tf_adacomp import scaling
from tf_adacomp import stats

_SCALING_PAUSE_MAX_S = 30.0


class ByteCounts:
  """``variable_bytes`` and ``compression_stats`` of a wrapper whose ``build`` sets
  ``plans`` and ``bytes_sent`` (and whose ``_is_built()`` says so: Keras' ``built``)."""

  def _is_built(self):
    return self.built

  def variable_bytes(self):
    """``[(plan, bytes one replica sent for that variable in the last step)]``."""
    if not self._is_built():
      return []
    return list(zip(self.plans, (int(b) for b in self.bytes_sent.numpy())))

  def compression_stats(self):
    """Bytes of the last step per variable kind and in total (``tf_adacomp.stats``)."""
    return stats.summarize(self.variable_bytes()) if self._is_built() else {}


class Reports(ByteCounts):
  """``ByteCounts``, and what the Keras 3 wrapper reports besides."""

  def moment_bytes(self):
    """Of ``variable_bytes()``, what the last step's average of Adam's moments sent.

    With the shared second moment (``second_moment="shared"`` or ``"global"``) the
    replicas average their moments, dense bfloat16, at steps 1, 2, 4, 8, ...: those bytes
    are counted in ``variable_bytes()`` beside the compressed exchange's, and
    ``CompressionStats`` keeps them out of the compression ratio.

    Returns:
      Bytes per variable, in ``variable_bytes()``'s order (zeros at a step that averaged
      nothing, and always with local steps, whose replicas estimate their own), or None
      without a shared second moment.
    """
    return moment_bytes(self)

  def check_scaling(self, warn: bool = True) -> Optional[bool]:
    """Whether the all-gather of this exchange has more senders than pays (scaling.py).

    The compact payloads (AdaComp, top-k, FFT) go to every sender: each receives one
    per sender and step, and past ``scaling.crossover_senders`` senders that is more
    bytes than a dense ring all-reduce would move. The senders are the workers with the
    hierarchical exchange, the replicas otherwise; the payload is what the last step
    sent. A thread started by ``build`` calls this once, after the first compressed
    exchange, so that a job past the crossover is told
    (``scaling.AllGatherScalingWarning``) without asking.

    Args:
      warn: a bool; whether a True result also warns.

    Returns:
      True past the crossover, False before it, None when it cannot tell (not built,
      one sender, no compact payload, a warm-up step or a step that sent nothing).
    """
    return check_scaling(self, warn)


def moment_bytes(optimizer):
  """``CompressedOptimizer.moment_bytes`` (its docstring says what it returns)."""
  if not optimizer.built or optimizer.second_moment not in ("shared", "global"):
    return None
  if optimizer.estimates_own_moment:  # nothing is averaged
    return [0] * len(optimizer.plans)
  replicas = optimizer._distribution_strategy.num_replicas_in_sync  # pylint: disable=protected-access
  synced = (int(optimizer.moment_synced_at.numpy())
            == int(optimizer.inner_optimizer.iterations.numpy()))
  if replicas == 1 or not synced:
    return [0] * len(optimizer.plans)
  averaged = 2 if optimizer.second_moment == "global" else 1  # v, and m^2 for "global"
  # The step counts averaged * elements * 2 bytes for each variable that had a gradient;
  # one without sent nothing at all, so the smaller of the two is what was sent.
  return [min(int(sent), averaged * plan.shape.num_elements() * 2)
          for plan, sent in zip(optimizer.plans, optimizer.bytes_sent.numpy())]


def check_scaling(optimizer, warn: bool = True) -> Optional[bool]:
  """``CompressedOptimizer.check_scaling`` (its docstring says what it returns)."""
  if not optimizer.built:
    return None
  senders = (optimizer.hierarchy.workers if optimizer.hierarchy is not None
             else optimizer._distribution_strategy.num_replicas_in_sync)  # pylint: disable=protected-access
  gathered = [i for i, plan in enumerate(optimizer.plans) if not plan.summable]
  if senders < 2 or not gathered or int(optimizer.iterations.numpy()) <= optimizer.start_step:
    return None
  # The dense average of Adam's moments at steps 1, 2, 4, ... is an all-reduce, not
  # part of the all-gather: only the compressed payload counts. (Read twice over if a
  # step ended in between: the thread of watch_scaling reads during training.)
  for _ in range(3):
    step = int(optimizer.iterations.numpy())
    sent = optimizer.bytes_sent.numpy() - np.asarray(optimizer.moment_bytes() or 0, np.int64)
    if int(optimizer.iterations.numpy()) == step:
      break
  payload = int(sum(sent[i] for i in gathered))
  if payload == 0:
    return None
  dense = sum(optimizer.plans[i].dense_nbytes for i in gathered)
  return scaling.check_allgather(senders, payload, dense, warn=warn)


def watch_scaling(optimizer) -> Optional[threading.Thread]:
  """Starts a daemon thread that calls ``optimizer.check_scaling()`` once it can tell
  (after the first compressed exchange), or None where it never could (one replica)."""
  if optimizer._distribution_strategy.num_replicas_in_sync < 2:  # pylint: disable=protected-access
    return None
  reference = weakref.ref(optimizer)  # the thread must not keep the optimizer alive

  def watch():
    deadline = time.monotonic() + compile_log.GIVE_UP_S
    pause = compile_log.POLL_S
    while time.monotonic() < deadline:
      watched = reference()
      if watched is None:
        return
      try:
        if watched.check_scaling() is not None:
          return
      except Exception:  # pylint: disable=broad-except
        return  # the optimizer's variables are gone (its strategy ended)
      del watched
      time.sleep(pause)
      # Longer and longer pauses: an optimizer built but not yet (or never) stepped
      # costs a wake-up every 30 s at most, not every half second.
      pause = min(2 * pause, _SCALING_PAUSE_MAX_S)

  thread = threading.Thread(target=watch, daemon=True, name="tf_adacomp_scaling_check")
  thread.start()
  return thread
