"""Local steps: replicas that synchronise every H steps (DiLoCo, SparseLoCo).

``CompressedOptimizer(inner, local_steps=H, outer_optimizer=...)`` runs rounds of H
steps. Within a round each replica takes the inner optimizer's steps on its own data
with its own optimizer state, starting from the anchor (the weights every replica held
when the round began), and nothing crosses the network. At the round's last step:

    delta_r  = local weights of replica r - anchor            # its pseudo-update
    sent_r   = compress(residue_r + delta_r)                  # error feedback
    update   = mean over r of decode(sent_r)
    anchor  <- anchor + update                                # outer_optimizer="average"
    anchor  <- outer_optimizer step on the gradient -update   # e.g. DiLoCo's Nesterov SGD

and every replica adopts the new anchor. DiLoCo (arXiv 2311.08105) is this with no
compression and an outer Nesterov SGD (learning rate 0.7, momentum 0.9, ``diloco``);
SparseLoCo (arXiv 2508.15706) compresses the pseudo-update with top-k and error feedback
and applies the mean without outer momentum (the residue takes momentum's place).

With ``outer_optimizer="predictive"`` (``Predictive``) every replica first takes out of
what it sends the part of its pseudo-update that every replica can predict, ``mu``
times ``moved`` (how far the anchor moved at the last round's end, the same on all):

    sent_r   = compress(residue_r + delta_r - mu * moved)
    moved   <- mu * moved + mean over r of decode(sent_r)
    anchor  <- anchor + moved

An element that is not sent still moves by its prediction, and the error feedback
corrects a prediction that was wrong: over the rounds the anchor moves by the mean
pseudo-updates less the mean residue, as with "average", whatever the prediction (and
without compression by exactly the mean, each round). Temporal predictive coding (Edin
et al., arXiv 2410.02478) sends gradients less a prediction from past ones likewise.

With H=1 and "average" this is the update exchange that ``CompressedOptimizer`` runs by
default, bit for bit: the anchor is the weights before the step.

A round whose pseudo-update is not finite on some replica (one scalar all-reduce at the
round's end) changes nothing that is shared: every replica goes back to the anchor, and
the residues and the outer optimizer's state are kept. Entries of a replica's inner
optimizer state that are not finite are set to zero, so that it can go on.

Between round ends each replica holds its own weights: a checkpoint taken mid-round
stores the first replica's (what a ``MirroredVariable`` reads as), and after a restore
every replica continues the round from them.

Weights set between steps (``Model.set_weights``, as EarlyStopping's
``restore_best_weights`` does where a fit stops mid-round; ``Variable.assign``): training
goes on from them, and the jump is no update. Each replica keeps, per variable, a
fingerprint of the weights its last local step left (``fingerprints``: one integer from
the variable's bits, rather than a copy of the weights, which would double their memory)
and, at the next step of the round, compares it with the weights' before stepping; where
they differ, the replica anchors that variable's round at its weights as they are now,
so that the jump enters neither a pseudo-update nor a residue. A replica whose own
weights did not change (``set_weights(get_weights())`` sets every replica to the first
one's) does not notice: at the round's end, where any replica re-anchored a variable in
the round (one more float in the round's scalar all-reduce), the replicas share who
re-anchored which variable when (a small all-reduce) and every replica takes, for such a
variable, the anchor of the replica that re-anchored it latest (one dense all-reduce, in
such rounds only), and measures its pseudo-update from it. The cost is a pass over the
weights (about a read of them: ``fingerprints``) after each step of a round but its
last, and one before each but its first. A change the fingerprint misses (the bit
differences of several changed elements, weighted by distinct odd factors, summing to
zero modulo 2^32) is treated as before the fix: as part of the pseudo-update.
Fingerprints are not saved: after a restore or ``optimizer.set_weights`` (which set
``iterations``) the round goes on from the restored anchor.

A variable the optimizer was built with and that a step does not train (a layer frozen
with ``trainable = False`` and ``compile`` run again, as Keras requires for the change to
take effect): if a replica stepped it earlier in the round, it joins the round's exchange
(the same compression and error feedback; without compression exactly the mean of the
replicas' copies), and every replica sets it to its anchor plus the mean, without the
outer optimizer's step (it is no longer trained); the rounds after leave it, and its
residue, alone. A variable the optimizer was not built with (a layer unfrozen after
``build``) is refused as Keras' optimizers refuse it.
"""

import keras
import tensorflow as tf

from tf_adacomp import replica_steps
from tf_adacomp.ops import checks
from tf_adacomp.ops import compiled
from tf_adacomp.ops import variant

AVERAGE = "average"
PREDICTIVE = "predictive"
# What ``outer_optimizer=None`` means, unless ``default_outer`` says PREDICTIVE.
DEFAULT_OUTER = AVERAGE
# ``Predictive``'s momentum: the share of the last round's move that every replica
# predicts for the next. Measured on the small GPT with AdamW inside 8 local steps
# (docs/convergence.md), 0.3 to 0.9: 0.7 and 0.8 gained most, 0.7 for fewer bytes.
PREDICTIVE_MOMENTUM = 0.7
# DiLoCo's outer optimizer (arXiv 2311.08105): Nesterov SGD, learning rate 0.7,
# momentum 0.9.
DILOCO_LEARNING_RATE = 0.7
DILOCO_MOMENTUM = 0.9
# AdaComp's bins on dense and recurrent kernels (and vectors) where an Adam or AdamW
# inside rounds divides by its estimate of the global batch's second moment, and the
# compressor is named ("adacomp", the default): less than a third of the default 500. A
# round's pseudo-update of Adam is about as large everywhere, so AdaComp, which sends an
# element when it nears its bin's largest, sends some 1.5% of them a round with bins of
# 500, and an element waits tens of rounds; smaller bins send more bytes and lost fewer
# points on the small GPT and the character LSTM: 150 is the smallest measured that
# keeps the GPT's ratio above 800x with Elias-Fano positions (docs/convergence.md).
ADAM_ROUND_BIN_SIZE = 150


def diloco():
  """DiLoCo's outer optimizer: ``keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)``.

  Returns:
    A new ``keras.optimizers.SGD``.
  """
  return keras.optimizers.SGD(learning_rate=DILOCO_LEARNING_RATE, momentum=DILOCO_MOMENTUM,
                              nesterov=True, name="outer_optimizer")


@keras.saving.register_keras_serializable(package="tf_adacomp")
class Predictive(keras.optimizers.SGD):
  """The outer step of ``outer_optimizer="predictive"``: the anchor moves by the mean of
  what arrived plus ``momentum`` times its last move, a prediction that every replica
  took out of its pseudo-update before compressing it (this module's docstring).

  It is Keras' SGD with learning rate 1 and this momentum (its slot ``momentums`` holds
  the last move; checkpointed with the wrapper's state), which ``steps.updates`` knows
  to subtract the prediction for.

  Args:
    momentum: float in (0, 1), default ``PREDICTIVE_MOMENTUM``.
    name: the optimizer's name.

  Raises:
    ValueError: ``momentum`` is not a float in (0, 1).
  """

  def __init__(self, momentum=PREDICTIVE_MOMENTUM, name="outer_optimizer"):
    if (isinstance(momentum, bool) or not isinstance(momentum, (int, float))
        or not 0 < momentum < 1):
      raise ValueError("`momentum` of the predictive outer step must be a float in (0, 1). "
                       f"Received: momentum={momentum!r}")
    super().__init__(learning_rate=1.0, momentum=float(momentum), nesterov=False, name=name)

  def prediction(self, index: int, dtype):
    """``momentum`` times the last move of variable ``index`` (of those it was built
    with), the same on every replica."""
    return tf.cast(self.momentum, dtype) * tf.cast(
        tf.convert_to_tensor(self.momentums[index]), dtype)

  def get_config(self):
    return {"momentum": self.momentum, "name": self.name}

  @classmethod
  def from_config(cls, config, custom_objects=None):
    return cls(**config)


def default_outer(local_steps: int, second_moment: str, compresses: bool):
  """What ``outer_optimizer=None`` means: a new ``Predictive`` where an Adam or AdamW
  inside rounds of local steps divides by its estimate of the global batch's second
  moment (``second_moment="global"``) and the compressor compresses; else
  ``DEFAULT_OUTER``. Adam's pseudo-updates are about one size everywhere, so AdaComp
  sends few of them a round and the rest wait; the prediction moves them meanwhile
  (docs/convergence.md). With SGD inside, "average" is at dense accuracy already."""
  if local_steps > 1 and second_moment == "global" and compresses:
    return Predictive()
  return DEFAULT_OUTER


def check_local_steps(local_steps) -> int:
  """``local_steps`` as an int >= 1, or ValueError naming it."""
  return checks.positive_int(local_steps, "local_steps")


def resolve_outer_optimizer(outer_optimizer):
  """What ``outer_optimizer`` means: ``AVERAGE``, a Keras optimizer, or None (for
  ``default_outer`` to decide, once the second moment is known).

  "predictive" is a new ``Predictive()``. A serialized Keras optimizer (a dict) is
  deserialized. docs/convergence.md has the measurements: with SGD and momentum inside,
  DiLoCo's outer momentum cost accuracy at 8 and 32 steps.

  Raises:
    ValueError: a string other than "average" and "predictive", a Keras optimizer that
      cannot be the outer one (a ``LossScaleOptimizer``, or one with gradient
      accumulation, EMA or clipping, which apply to gradients that the round does not
      have), or anything else.
  """
  if outer_optimizer is None:
    return None
  if isinstance(outer_optimizer, dict):
    outer_optimizer = keras.saving.deserialize_keras_object(outer_optimizer)
  expected = f"`outer_optimizer` must be '{AVERAGE}', '{PREDICTIVE}', None or a Keras optimizer."
  if isinstance(outer_optimizer, str):
    if outer_optimizer == PREDICTIVE:
      return Predictive()
    if outer_optimizer != AVERAGE:
      raise ValueError(f"{expected} Received: outer_optimizer={outer_optimizer!r}")
    return AVERAGE
  if not isinstance(outer_optimizer, keras.optimizers.Optimizer):
    raise ValueError(f"{expected} Received: outer_optimizer={outer_optimizer!r}")
  if isinstance(outer_optimizer, keras.optimizers.LossScaleOptimizer):
    raise ValueError("`outer_optimizer` cannot be a LossScaleOptimizer: the pseudo-gradient "
                     "of a round is not a scaled loss's gradient. Received: "
                     f"outer_optimizer={outer_optimizer!r}")
  for setting in ("clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps"):
    if getattr(outer_optimizer, setting, None) is not None:
      raise ValueError(f"`outer_optimizer` with `{setting}` set is not supported. Received: "
                       f"outer_optimizer.{setting}={getattr(outer_optimizer, setting)!r}")
  if getattr(outer_optimizer, "use_ema", False):
    raise ValueError("`outer_optimizer` with `use_ema=True` is not supported. Received: "
                     "outer_optimizer.use_ema=True")
  return outer_optimizer


def serialize_outer(outer_optimizer):
  """``AVERAGE`` or the Keras serialization of the outer optimizer."""
  if isinstance(outer_optimizer, str):
    return outer_optimizer
  return keras.saving.serialize_keras_object(outer_optimizer)


def is_round_end(step, local_steps: int):
  """Whether 1-based ``step`` (a tensor) is the last of its round."""
  return tf.equal(tf.math.floormod(step, local_steps), 0)


def without_non_finite(value):
  """``value`` with its non-finite entries set to zero (a float tensor)."""
  return tf.where(tf.math.is_finite(value), value, tf.zeros_like(value))


def _words(value):
  """``value``'s bits as a flat int32 vector: a float64 becomes two int32 words, a 16-bit
  float one int16 (widened), an integer its int32 cast."""
  if value.dtype.is_floating:
    value = tf.bitcast(value, tf.int16 if value.dtype.size == 2 else tf.int32)
  return tf.reshape(tf.cast(value, tf.int32), [-1])


def _fingerprint(value):
  words = _words(value)
  # Odd factors, distinct below 2^31 elements (int32 arithmetic wraps modulo 2^32).
  odd = 2 * tf.range(tf.size(words)) + 1
  return tf.reduce_sum(words * odd)


def _fingerprints(tensors):
  return tf.cast(tf.stack([_fingerprint(t) for t in tensors]), tf.int64)


# The CPU form's row length: a matrix product streams over rows this long (measured
# against 64 to 16,384 on the 5.8M-weight MLP's tensors: 4,096 and longer the same).
_ROW = 4096


def _fingerprint_by_rows(value):
  """``_fingerprint(value)``, the same int32, as TensorFlow's (not XLA's) int32 kernels.

  XLA:CPU's int32 reductions are several times slower than TensorFlow's own kernels
  (``benchmarks/fingerprints.py`` times the two). Element (r, c) of the words as rows of
  ``_ROW`` has the factor 2 (r _ROW + c) + 1, so a matrix product by the two columns
  (2c, 1) gives each row's two sums, which the row factors combine.
  """
  words = _words(value)
  size = words.shape.num_elements()
  if size is None:  # not known when traced: elementwise
    return _fingerprint(value)
  width = min(_ROW, size)
  rows = size // width if width else 0
  head = rows * width
  total = tf.constant(0, tf.int32)
  if rows:
    columns = tf.stack([2 * tf.range(width), tf.ones([width], tf.int32)], axis=1)
    sums = tf.matmul(tf.reshape(words[:head], [rows, width]), columns)
    total += tf.reduce_sum(sums[:, 0] + (2 * width * tf.range(rows) + 1) * sums[:, 1])
  if head < size:
    total += tf.reduce_sum(words[head:] * (2 * tf.range(head, size) + 1))
  return total


def fingerprints(tensors):
  """A fingerprint of each tensor's bits (an int64 vector, one entry per tensor): the sum,
  modulo 2^32, of each element's bit pattern times a distinct odd factor (2 * position
  + 1).

  Equal tensors have equal fingerprints; a change of one element always changes its
  tensor's (an odd factor is invertible modulo 2^32), and a change of several escapes
  only where their weighted bit differences cancel. A single pass over each tensor
  (about the cost of reading it; int32 arithmetic, kept on the device), in the form of
  the tensors' device (``ops.variant``): on a GPU one XLA program for all the tensors, on
  a CPU TensorFlow's int32 matrix product (``_fingerprint_by_rows``; XLA:CPU's int32
  reduction is over twice as slow: docs/performance.md); nothing of the tensors is kept.
  """
  tensors = [tf.convert_to_tensor(t) for t in tensors]
  if not tensors:
    return tf.zeros([0], tf.int64)
  if variant.gpu_form(tensors[0]):
    return compiled.kernel(_fingerprints)(tensors)
  return tf.cast(tf.stack([_fingerprint_by_rows(t) for t in tensors]), tf.int64)


class RoundState:
  """What each replica records of its own local steps (one value per replica, equal on
  all but ``fingerprints`` and ``moved_at``): not saved, and not among the optimizer's
  variables (``round_state``).

  Attributes:
    fingerprints: int64 per variable, ``fingerprints`` of the weights this replica's
      last recorded local step left.
    stepped_at: int64 per variable, the step (1-based) that last stepped it; a round's
      last step is not recorded (the exchange sets the weights).
    moved_at: int64 per variable, the step at which this replica re-anchored it because
      its weights had been set from outside (0: never).
    recorded_at: int64, ``iterations`` after the last recorded step (-1: none); the
      records hold only while ``iterations`` is still that (not after a restore).
  """

  def __init__(self, strategy, count):
    self.count = count

    def initial(shape, value):
      return lambda: tf.fill(shape, tf.constant(value, tf.int64))

    (self.fingerprints, self.stepped_at, self.moved_at,
     self.recorded_at) = replica_steps.first_replica_variables(strategy, [
         ("local_steps_fingerprints", initial([count], 0)),
         ("local_steps_stepped_at", initial([count], 0)),
         ("local_steps_moved_at", initial([count], 0)),
         ("local_steps_recorded_at", initial([], -1))])


_ROUND_STATE = "_local_steps_round_state"


def round_state(holder, count: int) -> RoundState:
  """``holder``'s ``RoundState`` for ``count`` variables (those an optimizer was built
  with), made on first use.

  Kept out of Keras' and TensorFlow's tracking (set in ``holder.__dict__``; the holder is
  the optimizer's step, ``steps.local_rounds``): the optimizer's variables, its
  checkpoints and saved models stay as they were. Made in a replica
  context when the first step is traced: in a ``merge_call``, once for every replica, or
  where the strategy runs without one, by the first replica's thread (they trace one
  after the other), through the strategy's variable creator.
  """
  state = holder.__dict__.get(_ROUND_STATE)
  if state is None or state.count != count:
    if tf.distribute.in_cross_replica_context():
      state = RoundState(tf.distribute.get_strategy(), count)
    elif tf.__internal__.distribute.strategy_supports_no_merge_call():
      # No strategy, or XLA on GPUs (no merge_call): the replicas' threads trace one
      # after the other, and the first makes it, with the strategy's creator.
      state = RoundState(None, count)
    else:
      state = tf.distribute.get_replica_context().merge_call(
          lambda strategy: RoundState(strategy, count))
    holder.__dict__[_ROUND_STATE] = state
  return state


def record_step(state, indices, variables, iterations):
  """Records this replica's local step of ``variables`` (at ``indices``), which made
  ``iterations`` steps in all. Returns True (for a ``tf.cond`` branch)."""
  if indices:
    positions = [[i] for i in indices]
    state.fingerprints.assign(tf.tensor_scatter_nd_update(
        tf.convert_to_tensor(state.fingerprints), positions, fingerprints(variables)))
    state.stepped_at.assign(tf.tensor_scatter_nd_update(
        tf.convert_to_tensor(state.stepped_at), positions,
        tf.fill([len(indices)], iterations)))
  state.recorded_at.assign(iterations)
  return tf.constant(True)


def moved_in_round(state, indices, begun):
  """Float32 per entry of ``indices``: the step of the round (1 to H) at which this
  replica re-anchored the variable there, 0 if it did not in the round that followed
  step ``begun``."""
  moved_at = tf.gather(tf.convert_to_tensor(state.moved_at), tf.constant(indices, tf.int64))
  return tf.cast(tf.where(moved_at > begun, moved_at - begun, tf.zeros_like(moved_at)),
                 tf.float32)


def adopt_latest_anchors(anchor_variables, moved, anchors):
  """In a replica context, at the end of a round in which a replica re-anchored a
  variable: each such variable's anchor becomes, on every replica, the anchor of the
  replica that re-anchored it latest in the round (the lowest-numbered among equals).

  A replica that did not notice a ``set_weights`` held the weights set already, so the
  latest anchor is where the round went on from. A sum in which only that replica's
  copy is not zero moves it exactly.

  Args:
    anchor_variables: the anchors' variables (this replica's copies are set).
    moved: float32 per variable, ``moved_in_round`` of this replica.
    anchors: this replica's anchors, one tensor per variable.

  Returns:
    True (for a ``tf.cond`` branch).
  """
  ctx = tf.distribute.get_replica_context()
  replica = tf.cast(ctx.replica_id_in_sync_group, tf.int32)
  rows = tf.one_hot(replica, ctx.num_replicas_in_sync, dtype=tf.float32)
  table = ctx.all_reduce(tf.distribute.ReduceOp.SUM, rows[:, None] * moved[None, :])
  latest = tf.reduce_max(table, axis=0)
  owner = tf.argmax(tf.cast(tf.equal(table, latest[None, :]), tf.int32), axis=0,
                    output_type=tf.int32)
  adopt = latest > 0
  offered = [tf.where(tf.logical_and(adopt[k], tf.equal(owner[k], replica)), a,
                      tf.zeros_like(a)) for k, a in enumerate(anchors)]
  summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, offered)
  for k, (variable, anchor, value) in enumerate(zip(anchor_variables, anchors, summed)):
    variable.assign(tf.where(adopt[k], value, anchor))
  return tf.constant(True)
