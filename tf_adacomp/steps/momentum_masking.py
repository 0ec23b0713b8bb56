"""DGC's momentum factor masking (``momentum_masking=True``, the update exchange): after
each step the inner optimizer's momentum (SGD with ``momentum > 0``) or first moment
(Adam, AdamW) is set to zero, on each replica, wherever that replica's compressor sent
an element of its update (its residue did not simply absorb it), so that a delayed
element does not keep being pushed by a stale momentum. Tensors sent whole (dense plans,
warm-up steps) are not masked.
"""

import keras
import tensorflow as tf

from tf_adacomp.compressors import base
from tf_adacomp.ops import checks


def check(momentum_masking, exchange, inner_optimizer, compressor):
  """Raises ValueError unless ``momentum_masking`` is a bool that can apply here."""
  if not checks.boolean(momentum_masking, "momentum_masking"):
    return
  if exchange != "updates":
    raise ValueError("`momentum_masking=True` masks the local momentum of the update "
                     "exchange and needs exchange='updates'. Received: "
                     f"momentum_masking=True, exchange={exchange!r}")
  if not has_first_moment(inner_optimizer):
    raise ValueError("`momentum_masking=True` needs an inner optimizer with a momentum or "
                     "first moment: SGD with momentum > 0, Adam or AdamW. Received: "
                     f"momentum_masking=True, inner_optimizer={inner_optimizer!r}")
  probe = compressor.plan([max(compressor.min_size, 4096)], "float32")
  if base.residue_position(compressor.state_specs(probe), probe.shape) is None:
    raise ValueError("`momentum_masking=True` needs a compressor with a residue (error "
                     "feedback): with this one every element is sent every step. "
                     f"Received: momentum_masking=True, compressor={compressor!r}")


def has_first_moment(optimizer):
  if isinstance(optimizer, keras.optimizers.SGD):
    return float(optimizer.momentum) > 0
  return isinstance(optimizer, keras.optimizers.Adam)  # AdamW is an Adam


def first_moment_slots(optimizer):
  """The momentum (SGD) or first-moment (Adam, AdamW) variables of a built optimizer,
  in its variable order (``optimizer._get_variable_index``).

  The one place that reads Keras internals for momentum masking: Keras 3 has no public
  accessor. SGD keeps them in ``momentums`` (an undocumented attribute), Adam and AdamW
  in the private ``_momentums`` (keras/src/optimizers/sgd.py and adam.py, Keras 3.15).
  tests/compat/test_internals.py fails if either moves.
  """
  attribute = "momentums" if isinstance(optimizer, keras.optimizers.SGD) else "_momentums"
  slots = getattr(optimizer, attribute, None)
  if not slots:
    raise RuntimeError(f"{type(optimizer).__name__} has no `{attribute}` variables in Keras "
                       f"{keras.__version__}: momentum masking needs updating for it.")
  return slots


def mask(guard, optimizer, variables, old_states, deltas, new_states, masked_step):
  """Zeroes this replica's momentum of ``optimizer`` where it sent.

  An element counts as sent where the new residue is not the old residue plus this
  step's update (the compressor sent all or part of it). Variables without a residue
  (sent whole every step) are left alone, and so is everything when ``masked_step`` is
  false (a skipped step or a dense warm-up step).
  """
  slots = first_moment_slots(optimizer)
  targets, values = [], []
  for variable, old, delta, new in zip(variables, old_states, deltas, new_states):
    position = None if delta is None else base.residue_position(old, delta.shape)
    if position is None:
      continue
    residue, new_residue = old[position], new[position]
    held = residue + tf.cast(delta, residue.dtype)  # G of the compressor
    sent = tf.logical_and(masked_step, tf.not_equal(held, new_residue))
    slot = slots[optimizer._get_variable_index(variable)]  # pylint: disable=protected-access
    value = tf.convert_to_tensor(slot)
    targets.append(slot)
    values.append(tf.where(sent, tf.zeros_like(value), value))
  guard.assign_per_replica(targets, values)
