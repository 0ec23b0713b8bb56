"""Learning-rate schedules for (large-batch) distributed training.

- ``WarmupDecay``: linear warm-up from 0 to a given peak, then a constant, cosine or step
  decay (Goyal et al. 2017's recipe; the peak is scaled by the caller).
- ``LEGW``: linear-epoch gradual warm-up (You et al., SC 2019, arXiv 1901.08256): tuned at
  a base batch, it scales the peak by sqrt(k) and the warm-up epochs by k for a batch k
  times larger, then decays (polynomial, exponential or step). See docs/legw.md.

Both are Keras ``LearningRateSchedule``s, registered for serialization (package
``tf_adacomp``), and take the optimizer's 0-based iteration count: step ``s`` of a
warm-up of ``W`` steps gets ``peak * (s + 1) / W``, so the first step is not wasted at 0
and step ``W - 1`` reaches the peak.
"""

import math

import keras
from keras import ops

from tf_adacomp.ops import checks

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
    peak = checks.positive_number(peak, "peak")
    total_steps = checks.positive_int(total_steps, "total_steps")
    warmup_steps = checks.non_negative_int(warmup_steps, "warmup_steps")
    if warmup_steps > total_steps:
      raise ValueError(f"`warmup_steps` must be <= total_steps={total_steps}. "
                       f"Received: warmup_steps={warmup_steps}")
    if decay not in DECAYS:
      raise ValueError(f"`decay` must be one of {DECAYS}. Received: decay={decay!r}")
    self.peak = peak
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


LEGW_DECAYS = ("poly", "exponential", "step")


def _check_number(name, value, low, inclusive=True, high=None, integer=False):
  """``value`` as a float (int if ``integer``), else ValueError naming it and the value."""
  ok = (checks.is_int(value) if integer else checks.is_number(value)) and math.isfinite(value)
  ok = ok and (value >= low if inclusive else value > low) and (high is None or value <= high)
  if not ok:
    rule = f"{'an integer' if integer else 'a finite number'} {'>=' if inclusive else '>'} {low}"
    rule += f" and <= {high}" if high is not None else ""
    raise ValueError(f"`{name}` must be {rule}. Received: {name}={value!r}")
  return int(value) if integer else float(value)


def _check_boundaries(boundaries, warmup_epochs, total_epochs):
  """``boundaries`` as a tuple of floats, else ValueError naming it and the value."""
  try:
    epochs = tuple(boundaries)
  except TypeError:
    epochs = None
  ok = bool(epochs) and all(
      checks.is_number(b) and math.isfinite(b)
      and warmup_epochs <= b <= total_epochs for b in epochs)
  if not (ok and all(a < b for a, b in zip(epochs, epochs[1:]))):
    raise ValueError(
        f"`boundaries` must be a non-empty, strictly increasing sequence of epochs in "
        f"[warm-up epochs {warmup_epochs:g}, total_epochs={total_epochs:g}]. "
        f"Received: boundaries={boundaries!r}")
  return tuple(float(b) for b in epochs)


@keras.saving.register_keras_serializable(package="tf_adacomp")
class LEGW(keras.optimizers.schedules.LearningRateSchedule):
  """Linear-epoch gradual warm-up (You et al. 2019): sqrt peak scaling, k-times warm-up.

  A schedule tuned at a base batch ``B0`` (peak ``eta0``, ``w0`` warm-up epochs) carried to
  the batch ``B = k * B0``, ``k = batch_size / base_batch_size``:

  - peak ``sqrt(k) * eta0`` (``peak_learning_rate``);
  - a linear ramp from 0 over ``k * w0`` epochs, ``warmup_steps = round(k * w0 *
    steps_per_epoch)``: ``peak * (step + 1) / warmup_steps`` at 0-based ``step`` (as in
    ``WarmupDecay``; step 0 gets ``peak / warmup_steps``, step ``warmup_steps - 1`` the
    peak). As ``steps_per_epoch`` (at ``B``) is ``1/k`` of the base batch's, the warm-up
    lasts the same number of iterations at every batch size;
  - then, with ``t = (step - warmup_steps) / (total_steps - warmup_steps)``, the decay:

    - ``"poly"``: ``end + (peak - end) * (1 - t) ** power``, ``end_learning_rate`` at
      ``total_steps``;
    - ``"exponential"``: ``peak * decay_rate ** ((step - warmup_steps) / decay_steps)``,
      continuous (no staircase), ``decay_steps = decay_epochs * steps_per_epoch``; by
      default ``decay_epochs`` is the span after warm-up, so the run ends at ``peak *
      decay_rate``;
    - ``"step"``: ``peak * step_factor ** n``, ``n`` the ``boundaries`` (epochs from the
      start of training) passed, each at step ``round(epoch * steps_per_epoch)``; by
      default 50% and 75% of ``total_epochs`` (He et al. 2016).

  Steps at and after ``total_steps = round(total_epochs * steps_per_epoch)`` hold the
  value of step ``total_steps`` (``end_learning_rate`` for ``"poly"``).

  ``k`` may be non-integer or below 1 (a smaller batch): the same formulas apply, a
  lower peak and a shorter warm-up in epochs, still the same warm-up iterations. ``k = 1``
  is the base schedule itself.

  Args:
    base_learning_rate: ``eta0``, the peak tuned at ``base_batch_size``, > 0.
    base_batch_size: ``B0``, the global batch the rate and warm-up were tuned at, >= 1.
    batch_size: ``B``, the global batch of this run, >= 1.
    base_warmup_epochs: ``w0``, warm-up epochs at ``B0``, >= 0 (0: no warm-up).
    steps_per_epoch: steps of one epoch at ``batch_size``, >= 1.
    total_epochs: epochs of the whole run, > 0; ``k * w0`` must not exceed it.
    decay: one of ``LEGW_DECAYS``.
    power: the polynomial's power (``"poly"``), > 0.
    decay_rate: factor per ``decay_epochs`` (``"exponential"``), in (0, 1].
    decay_epochs: epochs per factor of ``decay_rate`` (``"exponential"``), > 0; None: the
      epochs after warm-up.
    boundaries: strictly increasing epochs from the start of training (``"step"``), each
      in [``k * w0``, ``total_epochs``]; None: ``(0.5, 0.75) * total_epochs``.
    step_factor: the rate's factor at each boundary (``"step"``), in (0, 1].
    end_learning_rate: the rate at ``total_steps`` (``"poly"``), in [0, peak].

  Raises:
    ValueError: an argument out of range, or a warm-up longer than ``total_epochs``,
      naming the argument(s) and the values received.
  """

  def __init__(self, base_learning_rate, base_batch_size, batch_size, base_warmup_epochs,
               steps_per_epoch, total_epochs, decay="poly", power=2.0, decay_rate=0.1,
               decay_epochs=None, boundaries=None, step_factor=0.1, end_learning_rate=0.0):
    self.base_learning_rate = _check_number("base_learning_rate", base_learning_rate, 0,
                                            inclusive=False)
    self.base_batch_size = _check_number("base_batch_size", base_batch_size, 1, integer=True)
    self.batch_size = _check_number("batch_size", batch_size, 1, integer=True)
    self.base_warmup_epochs = _check_number("base_warmup_epochs", base_warmup_epochs, 0)
    self.steps_per_epoch = _check_number("steps_per_epoch", steps_per_epoch, 1, integer=True)
    self.total_epochs = _check_number("total_epochs", total_epochs, 0, inclusive=False)
    if decay not in LEGW_DECAYS:
      raise ValueError(f"`decay` must be one of {LEGW_DECAYS}. Received: decay={decay!r}")
    self.decay = decay
    self.power = _check_number("power", power, 0, inclusive=False)
    self.decay_rate = _check_number("decay_rate", decay_rate, 0, inclusive=False, high=1)
    self.decay_epochs = None if decay_epochs is None else _check_number(
        "decay_epochs", decay_epochs, 0, inclusive=False)
    self.step_factor = _check_number("step_factor", step_factor, 0, inclusive=False, high=1)

    self.scale = self.batch_size / self.base_batch_size  # k
    self._peak = math.sqrt(self.scale) * self.base_learning_rate
    self.end_learning_rate = _check_number("end_learning_rate", end_learning_rate, 0,
                                           high=self._peak)
    # Multiplied before dividing: exact for integer epochs and batch sizes.
    self.warmup_epochs = self.base_warmup_epochs * self.batch_size / self.base_batch_size
    self._total_steps = int(round(self.total_epochs * self.steps_per_epoch))
    self._warmup_steps = int(round(self.warmup_epochs * self.steps_per_epoch))
    if self._total_steps < 1:
      raise ValueError(f"`total_epochs` must make at least one step of steps_per_epoch="
                       f"{self.steps_per_epoch}. Received: total_epochs={total_epochs!r}")
    if self.warmup_epochs > self.total_epochs or self._warmup_steps > self._total_steps:
      raise ValueError(
          f"The warm-up, base_warmup_epochs * batch_size / base_batch_size = "
          f"{self.warmup_epochs:g} epochs, must not be longer than total_epochs. Received: "
          f"base_warmup_epochs={base_warmup_epochs!r}, batch_size={batch_size!r}, "
          f"base_batch_size={base_batch_size!r}, total_epochs={total_epochs!r}")

    self.boundaries = None if boundaries is None else _check_boundaries(
        boundaries, self.warmup_epochs, self.total_epochs)
    epochs = self.boundaries or (0.5 * self.total_epochs, 0.75 * self.total_epochs)
    if decay == "step" and epochs[0] < self.warmup_epochs:  # only the defaults get here
      raise ValueError(
          f"`boundaries` must be given when the warm-up ({self.warmup_epochs:g} epochs) "
          f"outlasts the default first boundary, 50% of total_epochs="
          f"{self.total_epochs:g}. Received: boundaries=None")
    self._boundary_steps = tuple(int(round(b * self.steps_per_epoch)) for b in epochs)

  @property
  def peak_learning_rate(self):
    """``sqrt(batch_size / base_batch_size) * base_learning_rate``."""
    return self._peak

  @property
  def warmup_steps(self):
    """``round(base_warmup_epochs * batch_size / base_batch_size * steps_per_epoch)``."""
    return self._warmup_steps

  @property
  def total_steps(self):
    """``round(total_epochs * steps_per_epoch)``; later steps hold its rate."""
    return self._total_steps

  def __call__(self, step):
    """The rate at the 0-based ``step`` (the optimizer's iterations before this update).

    Args:
      step: a scalar integer or float tensor (or Python number).

    Returns:
      A float32 scalar tensor.
    """
    step = ops.minimum(ops.cast(step, "float32"), float(self._total_steps))  # hold the end
    warm, total, peak = self._warmup_steps, self._total_steps, self._peak
    after_warmup = step - warm
    if self.decay == "poly":
      done = ops.clip(after_warmup / max(total - warm, 1), 0.0, 1.0)
      end = self.end_learning_rate
      after = end + (peak - end) * ops.power(1.0 - done, self.power)
    elif self.decay == "exponential":
      decay_steps = (max(total - warm, 1) if self.decay_epochs is None
                     else self.decay_epochs * self.steps_per_epoch)
      after = peak * ops.power(self.decay_rate, ops.maximum(after_warmup, 0.0) / decay_steps)
    else:
      passed = sum(ops.cast(step >= b, "float32") for b in self._boundary_steps)
      after = peak * ops.power(self.step_factor, passed)
    if warm == 0:
      return ops.cast(after, "float32")
    warmup_rate = peak * ops.minimum(step + 1.0, warm) / warm
    return ops.cast(ops.where(step < warm, warmup_rate, after), "float32")

  def get_config(self):
    return {"base_learning_rate": self.base_learning_rate,
            "base_batch_size": self.base_batch_size, "batch_size": self.batch_size,
            "base_warmup_epochs": self.base_warmup_epochs,
            "steps_per_epoch": self.steps_per_epoch, "total_epochs": self.total_epochs,
            "decay": self.decay, "power": self.power, "decay_rate": self.decay_rate,
            "decay_epochs": self.decay_epochs,
            "boundaries": None if self.boundaries is None else list(self.boundaries),
            "step_factor": self.step_factor, "end_learning_rate": self.end_learning_rate}
