"""The ResIST synchronisation: every parameter becomes its average over the replicas that held it.

Only what a replica trained travels. In a replica context each replica flattens the
shared variables and the variables of the blocks it held this round into one float32
buffer (variable length: it depends on the blocks held), with the length of every segment
(shared, block 0, block 1, ...; 0 for a block not held) beside it. Two all-gathers
(the lengths, then the buffers: the collective pads every buffer to the longest and
returns them back to back) give every replica all of them; each replica rebuilds the
``[replicas, words]`` rows of every segment (``exchange.gathered_rows``), sums the rows in
replica order (a row not held is zeros) and divides by the number of holders, so every
replica computes bit-identical averages. Each replica then sets its own copy of every
variable, with no further communication.

The optimizer's state is reset to zeros after each exchange (``reset_optimizer``), and
``local_gradients`` switches off a Keras optimizer's own all-reduce, so that between two
exchanges each replica trains its copy of the weights on its own data.
"""

import math
from typing import List, NamedTuple, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_adacomp import exchange
from tf_adacomp import stats

WORD_BYTES = 4  # float32 values and int32 lengths
# The rows of one segment out of the gathered buffers: the compressed exchange's own.
_rows = exchange.gathered_rows


class RoundBytes(NamedTuple):
  """What the exchange of one round cost, from the gathered lengths.

  Attributes:
    sent: float64 ``[replicas]``, the bytes each replica contributed: its trained
      parameters (float32) and its segment lengths (int32).
    padded: the bytes each replica sends on the wire, the same for all: TensorFlow's
      all-gather pads every buffer to the longest one.
  """
  sent: np.ndarray
  padded: float


def round_bytes(lengths) -> RoundBytes:
  """``RoundBytes`` of a round from its ``[replicas, segments]`` lengths (words), by the
  package's byte model (``stats.gather_nbytes``)."""
  sent, padded = stats.gather_nbytes(lengths)
  return RoundBytes(sent=sent, padded=padded)


def _tf_variable(variable):
  return variable.value if isinstance(variable, keras.Variable) else variable


def _size(variable):
  return math.prod(variable.shape)


class HolderAverage:
  """The exchange of one model's variables, traced once, run once per round.

  Args:
    strategy: the ``tf.distribute`` strategy the variables were made in.
    shared: variables every replica trains (averaged over all replicas).
    blocks: one list of variables per partitionable block (averaged over its holders).

  Raises:
    ValueError: a variable that is not floating point, or that appears twice.
  """

  def __init__(self, strategy, shared: Sequence, blocks: Sequence[Sequence]):
    self.strategy = strategy
    self.segments = [list(shared)] + [list(b) for b in blocks]
    seen = set()
    for segment in self.segments:
      for variable in segment:
        if id(variable) in seen:
          raise ValueError(f"A variable is in two segments. Received: {variable.path!r}")
        seen.add(id(variable))
        if not tf.as_dtype(variable.dtype).is_floating:
          raise ValueError(f"Only floating-point variables are averaged. "
                           f"Received: {variable.path!r} of dtype {variable.dtype}")
    self.words = [sum(_size(v) for v in segment) for segment in self.segments]
    self._function = tf.function(self._exchange)

  @property
  def num_blocks(self) -> int:
    """The number of partitionable blocks (segments after the shared one)."""
    return len(self.segments) - 1

  def __call__(self, held) -> np.ndarray:
    """Averages every variable over its holders on every replica.

    Args:
      held: bool ``[replicas, num_blocks]``, the round's partition (``partition.deal``);
        every block needs a holder.

    Returns:
      The gathered segment lengths in words, int ``[replicas, 1 + num_blocks]`` (the
      shared segment first): ``round_bytes`` turns them into bytes.

    Raises:
      ValueError: ``held`` of the wrong shape, or a block without a holder.
    """
    held = np.asarray(held, bool)
    replicas = self.strategy.num_replicas_in_sync
    if held.shape != (replicas, self.num_blocks) or not held.any(axis=0).all():
      raise ValueError(f"`held` must be bool [replicas, blocks] = [{replicas}, "
                       f"{self.num_blocks}] with a holder for every block. "
                       f"Received: held={held.astype(int).tolist()}")
    lengths = self._function(tf.constant(held.astype(np.float32)))
    return lengths.numpy()

  def _exchange(self, held):
    results = self.strategy.run(self._replica_average, args=(held,))
    averages, lengths = results
    variables = [v for segment in self.segments for v in segment]
    for variable, average in zip(variables, averages):
      # Each replica's own (identical) average to its own copy: no further collective.
      self.strategy.extended.update(_tf_variable(variable), _assign, args=(average,),
                                    group=False)
    return self.strategy.experimental_local_results(lengths)[0]

  def _replica_average(self, held):
    ctx = tf.distribute.get_replica_context()
    replicas = ctx.num_replicas_in_sync
    mine = tf.gather(held, ctx.replica_id_in_sync_group) > 0
    buffers, lengths = [], []
    for k, segment in enumerate(self.segments):
      flat = tf.concat([tf.reshape(tf.cast(_tf_variable(v), tf.float32), [-1])
                        for v in segment], axis=0) if segment else tf.zeros([0])
      length = tf.constant(self.words[k], tf.int32)
      if k:  # a block: sent only by its holders
        length = length * tf.cast(mine[k - 1], tf.int32)
      buffers.append(flat[:length])
      lengths.append(length)
    all_lengths = ctx.all_gather(tf.stack(lengths)[None], axis=0)
    all_data = ctx.all_gather(tf.concat(buffers, axis=0), axis=0)
    counts = tf.concat([[float(replicas)], tf.reduce_sum(held, axis=0)], axis=0)
    averages = []
    for k, segment in enumerate(self.segments):
      if not segment:
        continue
      rows = _rows(all_data, all_lengths, k, self.words[k], replicas)
      total = rows[0]
      for r in range(1, replicas):  # replica order: bit-identical on every replica
        total = total + rows[r]
      average = total / counts[k]
      for variable, part in zip(segment, tf.split(average, [_size(v) for v in segment])):
        averages.append(tf.cast(tf.reshape(part, variable.shape), variable.dtype))
    return averages, all_lengths


def _assign(variable, value):
  return variable.assign(value)


def reset_optimizer(optimizer: keras.optimizers.Optimizer) -> List:
  """Sets the optimizer's state (momentum, moments, ...) to zero on every replica.

  The step counter ``iterations`` and a learning-rate variable are kept.

  Returns:
    The variables that were reset.
  """
  keep = {id(optimizer.iterations)}
  rate = optimizer.learning_rate  # the variable itself, unless a schedule computes it
  if isinstance(rate, keras.Variable):
    keep.add(id(rate))
  reset = [v for v in optimizer.variables
           if id(v) not in keep and tf.as_dtype(v.dtype).is_floating]
  for variable in reset:
    variable.assign(tf.zeros(variable.shape, variable.dtype))  # every replica's copy
  return reset


def local_gradients(grads_and_vars):
  """Each replica's own mean gradient, not all-reduced (a Keras optimizer hook).

  Keras divides every replica's loss by the number of replicas (so that summing the
  replicas' gradients gives the global mean); multiplying by that number undoes it, and
  each replica steps on the mean gradient of its own batch.
  """
  ctx = tf.distribute.get_replica_context()
  replicas = ctx.num_replicas_in_sync if ctx is not None else 1
  out = []
  for grad, variable in grads_and_vars:
    if grad is not None and replicas > 1:
      if isinstance(grad, tf.IndexedSlices):
        grad = tf.IndexedSlices(grad.values * replicas, grad.indices, grad.dense_shape)
      else:
        grad = grad * tf.cast(replicas, grad.dtype)
    out.append((grad, variable))
  return out
