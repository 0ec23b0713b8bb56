"""Learning-rate schedules for (large-batch) distributed training."""

import math

import keras
from keras import ops

DECAYS = ("constant", "cosine", "step")


@keras.saving.register_keras_serializable(package="tf_adacomp")
class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
  """Linear warm-up from 0 to ``peak``, then a constant, cosine or step decay.

  The usual large-batch recipe (Goyal et al. 2017): over the first ``warmup_steps``
  the rate grows linearly, ``peak * (step + 1) / warmup_steps``; afterwards

  - ``"constant"``: ``peak``;
  - ``"cosine"``: ``peak * (1 + cos(pi * t)) / 2``, ``t`` the fraction of the steps
    after warm-up done, reaching 0 at ``total_steps``;
  - ``"step"``: ``peak``, x0.1 from 50% and x0.01 from 75% of ``total_steps`` (He et
    al. 2016's CIFAR schedule).

  Args:
    peak: the rate after warm-up, > 0.
    total_steps: steps of the whole run, >= 1.
    warmup_steps: steps of linear warm-up, 0 <= warmup_steps <= total_steps.
    decay: one of ``DECAYS``.

  Raises:
    ValueError: an argument out of range, naming it and the value received.
  """

  def __init__(self, peak, total_steps, warmup_steps=0, decay="constant"):
    if isinstance(peak, bool) or not isinstance(peak, (int, float)) or not (
        math.isfinite(peak) and peak > 0):
      raise ValueError(f"`peak` must be a finite number > 0. Received: peak={peak!r}")
    for name, value, low in (("total_steps", total_steps, 1), ("warmup_steps", warmup_steps, 0)):
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an integer >= {low}. Received: {name}={value!r}")
    if warmup_steps > total_steps:
      raise ValueError(f"`warmup_steps` must be <= total_steps={total_steps}. "
                       f"Received: warmup_steps={warmup_steps}")
    if decay not in DECAYS:
      raise ValueError(f"`decay` must be one of {DECAYS}. Received: decay={decay!r}")
    self.peak = float(peak)
    self.total_steps = total_steps
    self.warmup_steps = warmup_steps
    self.decay = decay

  def __call__(self, step):
    step = ops.cast(step, "float32")
    warm = max(self.warmup_steps, 1)
    warmup_rate = self.peak * ops.minimum(step + 1.0, warm) / warm
    if self.decay == "cosine":
      span = max(self.total_steps - self.warmup_steps, 1)
      done = ops.clip((step - self.warmup_steps) / span, 0.0, 1.0)
      after = self.peak * 0.5 * (1.0 + ops.cos(math.pi * done))
    elif self.decay == "step":
      after = ops.where(step < 0.5 * self.total_steps, self.peak,
                        ops.where(step < 0.75 * self.total_steps, 0.1 * self.peak,
                                  0.01 * self.peak))
    else:
      after = ops.convert_to_tensor(self.peak, "float32")
    if self.warmup_steps == 0:
      return after
    return ops.where(step < self.warmup_steps, warmup_rate, after)

  def get_config(self):
    return {"peak": self.peak, "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps, "decay": self.decay}
