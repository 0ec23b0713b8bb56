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
With H=1 and "average" this is the update exchange that ``CompressedOptimizer`` runs by
default, bit for bit: the anchor is the weights before the step.

A round whose pseudo-update is not finite on some replica (one scalar all-reduce at the
round's end) changes nothing that is shared: every replica goes back to the anchor, and
the residues and the outer optimizer's state are kept. Entries of a replica's inner
optimizer state that are not finite are set to zero, so that it can go on.

Between round ends each replica holds its own weights: a checkpoint taken mid-round
stores the first replica's (what a ``MirroredVariable`` reads as), and after a restore
every replica continues the round from them.
"""

import keras
import tensorflow as tf

from tf_adacomp.ops import checks

AVERAGE = "average"
# What ``outer_optimizer=None`` means.
DEFAULT_OUTER = AVERAGE
# DiLoCo's outer optimizer (arXiv 2311.08105): Nesterov SGD, learning rate 0.7,
# momentum 0.9.
DILOCO_LEARNING_RATE = 0.7
DILOCO_MOMENTUM = 0.9


def diloco():
  """DiLoCo's outer optimizer: ``keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)``.

  Returns:
    A new ``keras.optimizers.SGD``.
  """
  return keras.optimizers.SGD(learning_rate=DILOCO_LEARNING_RATE, momentum=DILOCO_MOMENTUM,
                              nesterov=True, name="outer_optimizer")


def check_local_steps(local_steps) -> int:
  """``local_steps`` as an int >= 1, or ValueError naming it."""
  return checks.positive_int(local_steps, "local_steps")


def resolve_outer_optimizer(outer_optimizer):
  """What ``outer_optimizer`` means: ``AVERAGE`` or a Keras optimizer.

  None is ``DEFAULT_OUTER`` ("average"; docs/convergence.md has the measurements: with
  SGD and momentum inside, DiLoCo's outer momentum cost accuracy at 8 and 32 steps). A
  serialized Keras optimizer (a dict) is deserialized.

  Raises:
    ValueError: a string other than "average", a Keras optimizer that cannot be the
      outer one (a ``LossScaleOptimizer``, or one with gradient accumulation, EMA or
      clipping, which apply to gradients that the round does not have), or anything
      else.
  """
  if outer_optimizer is None:
    return DEFAULT_OUTER
  if isinstance(outer_optimizer, dict):
    outer_optimizer = keras.saving.deserialize_keras_object(outer_optimizer)
  if isinstance(outer_optimizer, str):
    if outer_optimizer != AVERAGE:
      raise ValueError(f"`outer_optimizer` must be '{AVERAGE}', None or a Keras optimizer. "
                       f"Received: outer_optimizer={outer_optimizer!r}")
    return AVERAGE
  if not isinstance(outer_optimizer, keras.optimizers.Optimizer):
    raise ValueError(f"`outer_optimizer` must be '{AVERAGE}', None or a Keras optimizer. "
                     f"Received: outer_optimizer={outer_optimizer!r}")
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
