"""A differential-test oracle: ``compressor="none"`` loses nothing, so a compressed
optimizer (or all-reduce) given it must train as plain Keras does.

Shared machinery of tests/conformance/test_oracle.py (``tf_adacomp.CompressedOptimizer``),
test_oracle_tf_keras.py (``tf_adacomp.tf_keras.CompressedOptimizer``) and
test_oracle_cross_device_ops.py (``tf_adacomp.CompressedAllReduce``):

- ``pairwise``: a deterministic greedy all-pairs covering array under constraints (each
  row the first assignment, in a fixed value order, that covers the most pairs not yet
  covered; backtracking keeps every row valid). No randomness, no new dependency: the
  same rows in every run and every process (pytest-xdist workers must agree on ids).
- ``Config``: one configuration of the Keras 3 wrapper's axes crossed with what Keras
  users do (inner optimizer, schedule, weight decay, EMA, mixed precision, an Embedding
  with repeated tokens, a mid-run event, the replica count). ``construction_error``
  predicts, from the wrapper's documented rules, which configurations its constructor
  refuses with a ValueError, and the argument the message must name.
- ``train``: ``model.fit`` of a tiny model in phases with the configuration's event
  between them (a layer frozen and unfrozen, ``set_weights``, a ``.keras``, ``.weights.h5``,
  ``model.export`` or ``tf.train.Checkpoint`` save and load, a restore onto another
  replica count, ``evaluate``/``predict``), with the wrapper or with the plain inner
  optimizer.
- ``Replay``: an eager, strategy-free replay, where no plain Keras run is the reference:
  each replica's own copy of the model and of the inner optimizer (real Keras
  optimizers, stepped eagerly) on its own shard of each global batch; the gradient
  exchange (the mean of the replicas' own gradients, each clipped to
  ``local_clipnorm``), the update exchange with local steps (``local_steps=H``: each
  replica steps its own optimizer for H steps from the anchor, the anchor moves by the
  mean pseudo-update; H=1 is the update exchange; an Adam inside with
  ``second_moment="global"``, the default, is Keras' with each replica's estimate of the
  global batch's second moment in its ``update_step``: ``EstimatedGlobalAdam``, at
  every step as inside local steps, with each replica's first moment inferred from the
  mean pseudo-update at a round's end, not in a round cut by ``set_weights``), and Adam
  with the second moment averaged at steps 1, 2, 4, ... ("shared", or "global" with
  ``precondition="after"`` or
  ``second_moment_interval="doubling"``; NumPy, float64, the algorithm of
  ``tf_adacomp.shared_moment``'s docstring).
- ``reference_kind`` picks the reference of a configuration and ``tolerance`` how close
  it must be (below); ``KNOWN_DEFECTS`` marks the configurations that fail because of a
  defect being fixed, ``xfail(strict=True)``, so that a fix turns them into XPASS
  failures and their entry is deleted.

References and tolerances (float32 unless said):

- One replica (no strategy, or a 1-device ``MirroredStrategy``), ``local_steps=1``:
  plain Keras with the same inner optimizer (``global_clipnorm=c`` for
  ``local_clipnorm=c``, which the wrapper documents as the same thing), bit for bit:
  the wrapper promises Keras' own arithmetic there (Adam's shared moment included: with
  one replica it is Keras' Adam), mixed precision included.
- One replica with ``local_steps=3``: plain Keras within ``ROUNDING`` (rtol 1e-6, atol
  1e-7): the anchor moves by the pseudo-update, ``a + (w - a)``, which float32 rounds
  differently from ``w`` (one ulp per round: 2 rounds, weights of order 1).
- Two or four replicas: plain Keras under a ``MirroredStrategy`` on the same devices with
  the same global batches where the wrapper's algorithm is plain Keras' on the global
  batch (the gradient exchange; SGD under the update exchange, linear in the gradient),
  else the replay; within ``FLOAT`` (rtol 1e-5, atol 2e-6): the all-reduce sums the R
  replicas' float32 contributions in another order than Keras' (a few ulp per step, 6
  steps, learning rates <= 0.05, Adam's normalisation: below 1e-6 here), while a term
  dropped or a sign flipped moves a weight by 1e-3 or more.
- Adam with the shared second moment on 2+ replicas: the NumPy replay, comparing each
  weight's displacement from its start within ``SHARED`` (2% of it, plus 0.2% of the
  largest): the replicas average their second moments in bfloat16 (0.4% on a moment,
  0.2% on a step, documented), which the float64 replay does not round. Exact (up to
  that rounding) at the steps that averaged (1, 2, 4); between them each replica's step
  is clipped to Adam's bound, which the replay applies too. A wrong bias correction is
  off by 10% or more (sqrt(1 - 0.999^2) against sqrt(1 - 0.999^3)).
- Mixed precision on 2+ replicas: ``MIXED`` (rtol 1e-3, atol 1e-4): float16 activations
  round to 2^-11 relative, so the float32 reordering above can flip a rounding of the
  forward pass and change a gradient by an ulp of float16.
- A save/load or evaluate mid-run is compared with the uninterrupted run (the principle:
  it must not change training); ``.weights.h5`` holds no optimizer state, so both sides
  continue with a fresh optimizer; a restore onto another replica count is compared
  with the reference continuing on that count from the checkpoint's state (per-replica
  optimizer slots restored as their mean, the wrapper's documented checkpoint contents).
"""

import contextlib
import copy
import dataclasses
import itertools
import math
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp import shared_moment

DEVICES = [f"/cpu:{i}" for i in range(4)]  # tests/conftest.py's logical CPUs
GLOBAL_BATCH = 8
STEPS = 6
FEATURES, OUTPUTS, VOCAB, TOKENS, EMBED = 5, 3, 20, 6, 4
SGD_LR, ADAM_LR, MOMENTUM, WEIGHT_DECAY, EMA_MOMENTUM = 0.05, 0.01, 0.9, 0.1, 0.5
CLIPNORM = 0.5  # binds: the tiny models' gradients have norms of 1 to 5
LOSS_SCALE = 2.0 ** 15  # LossScaleOptimizer's initial scale (no overflow here)

EXACT = "bit for bit"
ROUNDING = dict(rtol=1e-6, atol=1e-7)
FLOAT = dict(rtol=1e-5, atol=2e-6)
MIXED = dict(rtol=1e-3, atol=1e-4)
SHARED = dict(rtol=2e-2, of_largest=2e-3)


# --- Pairwise covering arrays ----------------------------------------------------------


# Rows tried per row kept: one from each of the first SEEDS uncovered pairs; the one
# that covers most uncovered pairs is kept (AETG's candidates, without randomness).
SEEDS = 24


def pairwise(axes: Dict[str, Sequence[Any]],
             rules: Sequence[Tuple[Tuple[str, ...], Callable[..., bool]]] = ()) -> List[Dict]:
  """Rows (dicts) that hold every pair of values of two axes that some valid row holds.

  ``rules``: ``(axis names, predicate over their values)``; a row is valid when every
  predicate holds. Deterministic greedy: a candidate row starts from a pair not yet
  covered, and fills the other axes in order, each with the value that covers most
  uncovered pairs with the values set so far (ties: the earlier value), backtracking
  where a rule fails; of the candidates started from the first ``SEEDS`` uncovered pairs
  (axis order, then value order) the row that covers most is kept. A pair no valid row
  holds is dropped.
  """
  names = list(axes)
  index = {n: i for i, n in enumerate(names)}

  def consistent(row):
    for rule_axes, predicate in rules:
      if all(a in row for a in rule_axes) and not predicate(*(row[a] for a in rule_axes)):
        return False
    return True

  uncovered = {}
  for i, j in itertools.combinations(range(len(names)), 2):
    for a, b in itertools.product(axes[names[i]], axes[names[j]]):
      uncovered[((names[i], a), (names[j], b))] = True

  def gain(row, name, value):
    count = 0
    for other, held in row.items():
      key = (((other, held), (name, value)) if index[other] < index[name]
             else ((name, value), (other, held)))
      count += key in uncovered
    return count

  def complete(row, rest):
    if not rest:
      return dict(row)
    name = rest[0]
    values = sorted(axes[name], key=lambda v: -gain(row, name, v))  # stable: ties in order
    for value in values:
      row[name] = value
      if consistent(row):
        found = complete(row, rest[1:])
        if found is not None:
          return found
      del row[name]
    return None

  def covers(row):
    return sum(((i, row[i]), (j, row[j])) in uncovered
               for i, j in itertools.combinations(names, 2))

  rows = []
  while uncovered:
    best = None
    for seed in list(uncovered)[:SEEDS]:
      row = dict(seed)
      found = complete(row, [n for n in names if n not in row]) if consistent(row) else None
      if found is None:
        del uncovered[seed]  # no valid row holds it
        continue
      if best is None or covers(found) > covers(best):
        best = found
    if best is None:
      continue
    for i, j in itertools.combinations(names, 2):
      uncovered.pop(((i, best[i]), (j, best[j])), None)
    rows.append(best)
  return rows


# --- The Keras 3 wrapper's configurations ------------------------------------------------

EVENTS = ("none", "set_weights", "freeze", "keras", "h5", "export",
          "checkpoint", "keras_other", "checkpoint_other")
# Mid-round for local_steps=3 (a round ends at steps 3 and 6): where the round's handling
# of weights set, or of a layer frozen, shows.
MID_ROUND_EVENTS = ("set_weights", "freeze")
# Another replica count to restore onto (2 -> 1, 1 -> 2, 4 -> 2).
OTHER_COUNT = {1: 2, 2: 1, 4: 2}
# A strategy of one device never calls its cross-device ops: 2 -> 4, 4 -> 2 for those.
CROSS_DEVICE_OTHER_COUNT = {2: 4, 4: 2}


@dataclasses.dataclass(frozen=True)
class Config:
  """One configuration; ``id`` names it in test ids (only what differs from the default)."""
  inner: str = "sgd"                 # "sgd" (momentum 0.9), "adam", "adamw"
  exchange: str = "updates"
  second_moment: Optional[str] = None
  precondition: str = "before"
  second_moment_interval: Any = None  # None, 0, "doubling" or an int (the wrapper's)
  local_steps: int = 1
  replicas: int = 1
  no_strategy: bool = False          # one replica without any strategy
  v1: bool = False                   # tf.compat.v1.distribute.MirroredStrategy
  # CompressedAllReduce("none") as the strategy's cross_device_ops, a plain optimizer
  # (test_oracle_cross_device_ops.py); False: CompressedOptimizer.
  cross_device_ops: bool = False
  devices_per_worker: Optional[int] = None
  start_step: int = 0
  local_clipnorm: Optional[float] = None
  schedule: bool = False             # ExponentialDecay learning rate
  weight_decay: bool = False         # weight_decay=0.1, bias excluded
  ema: bool = False                  # use_ema=True, ema_momentum=0.5
  mixed: bool = False                # mixed_float16: compile wraps a LossScaleOptimizer
  model: str = "dense"               # "dense" (Dense(3) on 5 features), "embedding"
  event: str = "none"
  steps: int = STEPS

  @property
  def id(self):
    parts = []
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value != field.default:
        parts.append(f"{field.name}={value}" if not isinstance(value, bool)
                     else field.name if value else f"no_{field.name}")
    return ",".join(parts) or "default"

  @property
  def other_count(self):
    """The replica count a restore onto another goes to."""
    return (CROSS_DEVICE_OTHER_COUNT if self.cross_device_ops else OTHER_COUNT)[self.replicas]

  @property
  def counts(self):
    """The replica counts the run trains on (two with a restore onto another)."""
    if self.event in ("keras_other", "checkpoint_other"):
      return (self.replicas, self.other_count)
    return (self.replicas,)

  @property
  def cut(self):
    return 2 if self.event in MID_ROUND_EVENTS else 3


def resolved_second_moment(c: Config) -> str:
  """What the wrapper's ``second_moment`` is for ``c`` (its documented default)."""
  if c.second_moment is not None:
    return c.second_moment
  if c.exchange == "updates" and c.inner != "sgd" and not c.ema:
    return "global"
  return "local"


def resolved_interval(c: Config):
  """What the wrapper's ``second_moment_interval`` is for ``c`` (its documented default:
  0 for "global", unless ``precondition="after"``; "doubling" for a moment averaged)."""
  if c.second_moment_interval is not None:
    return c.second_moment_interval
  moment = resolved_second_moment(c)
  if moment == "global" and (c.precondition == "before" or c.local_steps > 1):
    return 0
  return "doubling" if moment in ("shared", "global") else None


def estimates_own_moment(c: Config) -> bool:
  """Whether each replica of ``c`` divides by its own estimate of the global batch's
  second moment (``EstimatedGlobalAdam``): "global" inside local steps or with interval 0."""
  return resolved_second_moment(c) == "global" and (c.local_steps > 1
                                                     or resolved_interval(c) == 0)


def construction_error(c: Config) -> List[str]:
  """The rules of ``CompressedOptimizer``'s docstring that ``c`` breaks, as the text its
  ValueError must name (one of them, when several are broken); [] when it is valid."""
  broken = []
  shared = c.second_moment in ("shared", "global")
  if c.local_steps > 1 and c.exchange == "gradients":
    broken.append(f"local_steps={c.local_steps}")
  if c.local_steps > 1 and c.ema:
    broken.append("use_ema=True")
  if shared and c.exchange == "gradients":
    broken.append("exchange='gradients'")
  if c.second_moment == "shared" and c.local_steps > 1:
    broken.append(f"local_steps={c.local_steps}")
  if shared and c.inner == "sgd":
    broken.append("inner_optimizer=")
  if shared and c.ema:
    broken.append("use_ema=True")
  if c.precondition == "after" and (resolved_second_moment(c) == "local"
                                    or c.local_steps > 1):
    broken.append("precondition='after'")
  return broken


# Rules of a training configuration: the constructor's (above), and what a run needs.
TRAINING_RULES = (
    (("local_steps", "exchange"), lambda h, e: h == 1 or e == "updates"),
    (("local_steps", "ema"), lambda h, ema: h == 1 or not ema),
    (("second_moment", "exchange"), lambda s, e: s not in ("shared", "global") or e == "updates"),
    (("second_moment", "local_steps"), lambda s, h: s != "shared" or h == 1),
    (("second_moment", "inner"), lambda s, i: s not in ("shared", "global") or i != "sgd"),
    (("second_moment", "ema"), lambda s, ema: s not in ("shared", "global") or not ema),
    (("precondition", "second_moment", "inner", "exchange", "local_steps", "ema"),
     lambda p, s, i, e, h, ema: p == "before" or (h == 1 and resolved_second_moment(Config(
         inner=i, exchange=e, second_moment=s, local_steps=h, ema=ema)) != "local")),
    (("devices_per_worker", "replicas"), lambda d, r: d is None or r in (2, 4)),
    (("no_strategy", "replicas"), lambda n, r: not n or r == 1),
    (("no_strategy", "v1"), lambda n, v1: not (n and v1)),
    # Keras 3.15's own EMA fails at the end of a fit with a layer frozen (plain Keras
    # too: finalize_variable_values zips its averages with fewer trainable variables).
    (("ema", "event"), lambda ema, e: not (ema and e == "freeze")),
)

TRAINING_AXES = {
    # The constrained axes first: rows are completed in this order.
    "inner": ("sgd", "adam", "adamw"),
    "exchange": ("updates", "gradients"),
    "local_steps": (1, 3),
    "ema": (False, True),
    "second_moment": (None, "local", "shared", "global"),
    "precondition": ("before", "after"),
    "replicas": (2, 1, 4),
    "no_strategy": (False, True),
    "v1": (False, True),
    "devices_per_worker": (None, 2),
    "event": EVENTS,
    "model": ("dense", "embedding"),
    "mixed": (False, True),
    "start_step": (0, 2),
    "local_clipnorm": (None, CLIPNORM),
    "schedule": (False, True),
    "weight_decay": (False, True),
}

# The fast tier's slice: the first rows of the covering array (its greedy order puts the
# rows that cover most pairs first) that train on at most 2 replicas: a 4-replica row
# compiles every kernel on 4 devices and costs the fast tier about 4 times a 2-replica
# row (30-40 s on a 2-core machine); ``--full`` runs every row.
FAST_ROWS = 4
FAST_MAX_REPLICAS = 2


def fast_rows(configs, count: int = FAST_ROWS) -> List[int]:
  """The indices of ``configs`` in the fast tier: the first ``count`` on at most
  ``FAST_MAX_REPLICAS`` replicas."""
  small = [i for i, c in enumerate(configs) if max(c.counts) <= FAST_MAX_REPLICAS]
  return small[:count]


def training_configs() -> List[Config]:
  return [Config(**row) for row in pairwise(TRAINING_AXES, TRAINING_RULES)]


# Beside the covering array: the smallest configuration of each of issue 43's defects
# (a fix shows as one XPASS, not hidden among other factors), and what the array holds
# only beside other factors.
TARGETED = (
    Config(replicas=2, ema=True),                                        # 2
    Config(exchange="gradients", replicas=2, ema=True),                  # 2
    Config(inner="adam", model="embedding", steps=20),                   # 3
    Config(replicas=4, devices_per_worker=2, event="keras_other"),       # 5
    Config(inner="adam", replicas=2, event="keras"),                     # 6
    Config(local_steps=3, replicas=2, event="set_weights"),              # 7
    Config(local_steps=3, replicas=2, event="freeze"),                   # 8
    Config(replicas=2, v1=True),                                         # 9
    Config(inner="adam", exchange="gradients", model="embedding"),       # A
    Config(inner="adam", exchange="gradients", mixed=True, model="embedding"),  # B
    Config(inner="adam", local_clipnorm=CLIPNORM, model="embedding"),    # C
    Config(inner="adam", second_moment="global", precondition="after", replicas=4),
    # "global" averaged (the default before each replica's own estimate).
    Config(inner="adam", second_moment="global", second_moment_interval="doubling",
           replicas=2, model="embedding"),
    # Adam inside local steps with each replica's estimate of the global second moment
    # (the default): an Embedding's slices, AdamW's decay, a round cut by set_weights.
    Config(inner="adamw", local_steps=3, replicas=2, model="embedding", weight_decay=True),
    Config(inner="adam", local_steps=3, replicas=2, event="set_weights"),
    Config(local_steps=3, replicas=2, event="keras"),                    # F
    Config(local_steps=3, mixed=True, event="keras_other"),  # G: the replay, fixed
)


CONSTRUCTION_AXES = {
    "inner": ("sgd", "adam", "adamw"),
    "exchange": ("updates", "gradients"),
    "second_moment": (None, "local", "shared", "global"),
    "precondition": ("before", "after"),
    "local_steps": (1, 3),
    "ema": (False, True),
    "devices_per_worker": (None, 2),
    "start_step": (0, 2),
    "local_clipnorm": (None, CLIPNORM),
    "schedule": (False, True),
    "weight_decay": (False, True),
}


# The axes the constructor's rules read; the others are free (any value is valid).
RULE_AXES = ("inner", "exchange", "second_moment", "precondition", "local_steps", "ema")


def construction_configs(everything: bool) -> List[Config]:
  """All pairs of the constructor's axes; with ``everything``, every combination of the
  axes its rules read (192), the free axes cycled through their values."""
  if not everything:
    return [Config(**row) for row in pairwise(CONSTRUCTION_AXES)]
  free = [a for a in CONSTRUCTION_AXES if a not in RULE_AXES]
  configs = []
  for i, values in enumerate(itertools.product(*(CONSTRUCTION_AXES[a] for a in RULE_AXES))):
    row = dict(zip(RULE_AXES, values))
    for j, axis in enumerate(free):
      levels = CONSTRUCTION_AXES[axis]
      row[axis] = levels[(i + j) % len(levels)]
    configs.append(Config(**row))
  return configs


# --- Known defects -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Defect:
  """``applies(config)``: whether the defect makes that configuration fail. An
  ``exact_only`` defect is a float rounding difference: it fails the bit-for-bit
  comparisons only (``test_one_replica_is_keras_bit_for_bit``); while it is listed,
  ``tolerance`` compares the configurations it applies to within ``ROUNDING``."""
  reason: str
  applies: Callable[[Any], bool]
  exact_only: bool = False


def _wrapper(c) -> bool:
  """A configuration of the Keras 3 wrapper (not tf_keras', not CompressedAllReduce)."""
  return not getattr(c, "tf_keras", False) and not getattr(c, "cross_device_ops", False)


# Issue 43's defects being fixed: each configuration one makes fail is xfail(strict=True)
# through this table. When a fix lands its configurations XPASS, which fails: delete the
# entry. Keyed by the defect number. (Defects 1, 2, 3, 5, 7, 8 and 9 pass at
# the time of writing, their targeted configurations (``TARGETED``) included: no entry.)
KNOWN_DEFECTS: Dict[str, Defect] = {
    # Defect 6 (a 2+-replica resume of Adam/AdamW under the update exchange gave every
    # replica the mean of the replicas' moments) is fixed: tf_adacomp.replica_state.
}

# Defects the oracle found that issue 43 does not list (the report that came with this
# file describes each). Same mechanics: xfail(strict=True), delete the entry on a fix.
FOUND_DEFECTS: Dict[str, Defect] = {
    # Defect E (the tf_keras wrapper's legacy .h5 format gave a 2-replica Adam resume
    # under the update exchange the mean of the replicas' moments) is fixed: the file
    # keeps each replica's copies (tf_adacomp.tf_keras_saving.h5_copies).
}


def _tables():
  return [("issue 43 defect", KNOWN_DEFECTS), ("found by the oracle, defect", FOUND_DEFECTS)]


def defects(c, exact: bool = False) -> List[str]:
  """The defects that make ``c`` fail (``exact``: in a bit-for-bit comparison)."""
  return [f"{label} {key}: {defect.reason}" for label, table in _tables()
          for key, defect in table.items()
          if defect.applies(c) and (exact or not defect.exact_only)]


def rounding_defect(c) -> bool:
  """Whether a listed rounding (``exact_only``) defect applies to ``c``."""
  return any(d.exact_only and d.applies(c) for _, table in _tables() for d in table.values())


def marks(c, exact: bool = False) -> list:
  found = defects(c, exact)
  return [pytest.mark.xfail(strict=True, reason="; ".join(found))] if found else []


# --- Data, models, optimizers ------------------------------------------------------------


def data(model: str, steps: int = STEPS):
  """``(x, y)`` of ``steps`` global batches of ``GLOBAL_BATCH`` rows. Each consecutive
  pair of rows has its own target map, so every replica's shard (of 2, 4 or 8 rows)
  disagrees with the others'. Embedding rows repeat their first token (and draw from 20
  tokens): every shard's IndexedSlices gradient has duplicate rows."""
  rng = np.random.default_rng(7)
  n = steps * GLOBAL_BATCH
  group = (np.arange(n) % GLOBAL_BATCH) // 2
  if model == "embedding":
    x = rng.integers(0, VOCAB, size=(n, TOKENS)).astype(np.int32)
    x[:, 1] = x[:, 0]
    table = rng.standard_normal([4, VOCAB, OUTPUTS]).astype(np.float32)
    y = table[group[:, None], x].mean(axis=1).astype(np.float32)
  else:
    x = rng.standard_normal([n, FEATURES]).astype(np.float32)
    maps = rng.standard_normal([4, FEATURES, OUTPUTS]).astype(np.float32)
    y = np.einsum("nf,nfo->no", x, maps[group]).astype(np.float32)
  return x, y


def make_model(c: Config):
  """The configuration's model, seeded (the same initial weights every time). The freeze
  event needs a second layer to freeze: the dense model then has Dense(4) first."""
  keras.utils.set_random_seed(1)
  if c.model == "embedding":
    return keras.Sequential([keras.Input([TOKENS], dtype="int32"),
                             keras.layers.Embedding(VOCAB, EMBED), keras.layers.Flatten(),
                             keras.layers.Dense(OUTPUTS)])
  if c.event == "freeze":
    return keras.Sequential([keras.Input([FEATURES]), keras.layers.Dense(4),
                             keras.layers.Dense(OUTPUTS)])
  return keras.Sequential([keras.Input([FEATURES]), keras.layers.Dense(OUTPUTS)])


def make_inner(c: Config, reference: bool = False, ema: Optional[bool] = None,
               one_replica_clip: bool = False):
  """A new inner optimizer of ``c``. ``one_replica_clip``: the reference of
  ``local_clipnorm`` on one replica, ``global_clipnorm``."""
  base = SGD_LR if c.inner == "sgd" else ADAM_LR
  lr = (keras.optimizers.schedules.ExponentialDecay(base, decay_steps=2, decay_rate=0.5)
        if c.schedule else base)
  kwargs = {}
  if c.ema if ema is None else ema:
    kwargs.update(use_ema=True, ema_momentum=EMA_MOMENTUM)
  if one_replica_clip and c.local_clipnorm is not None:
    kwargs["global_clipnorm"] = c.local_clipnorm
  if c.weight_decay:
    kwargs["weight_decay"] = WEIGHT_DECAY
  if c.inner == "sgd":
    optimizer = keras.optimizers.SGD(lr, momentum=MOMENTUM, **kwargs)
  elif c.inner == "adam":
    optimizer = keras.optimizers.Adam(lr, **kwargs)
  else:
    optimizer = keras.optimizers.AdamW(lr, **kwargs)
  del reference
  return optimizer


def learning_rate_at(c: Config, iterations: int) -> float:
  base = SGD_LR if c.inner == "sgd" else ADAM_LR
  if not c.schedule:
    return base
  return float(keras.optimizers.schedules.ExponentialDecay(base, decay_steps=2,
                                                           decay_rate=0.5)(iterations))


def make_wrapper(c: Config, devices_per_worker="config"):
  kwargs = dict(exchange=c.exchange, second_moment=c.second_moment,
                precondition=c.precondition, local_steps=c.local_steps,
                second_moment_interval=c.second_moment_interval,
                start_step=c.start_step, local_clipnorm=c.local_clipnorm,
                devices_per_worker=(c.devices_per_worker if devices_per_worker == "config"
                                    else devices_per_worker))
  return tf_adacomp.CompressedOptimizer(make_inner(c), "none", **kwargs)


def make_optimizer(c: Config, wrapped: bool, replicas: int, devices_per_worker="config"):
  if wrapped:
    optimizer = make_wrapper(c, devices_per_worker)
  else:
    optimizer = make_inner(c, one_replica_clip=replicas == 1)
  if c.weight_decay:  # on the wrapper: it forwards to the inner optimizer
    optimizer.exclude_from_weight_decay(var_names=["bias"])
  return optimizer


def make_strategy(replicas: int, no_strategy: bool = False, v1: bool = False,
                  compressed_all_reduce: bool = False):
  """The default strategy (``no_strategy``), or a ``MirroredStrategy`` (of
  ``tf.compat.v1.distribute`` with ``v1``) over the first ``replicas`` CPUs, with
  ``CompressedAllReduce("none")`` as its cross-device ops if ``compressed_all_reduce``."""
  if no_strategy:
    return tf.distribute.get_strategy()
  ops = tf_adacomp.CompressedAllReduce("none") if compressed_all_reduce else None
  if v1:
    return tf.compat.v1.distribute.MirroredStrategy(DEVICES[:replicas], cross_device_ops=ops)
  return tf_adacomp.distribute.mirrored_strategy(devices=DEVICES[:replicas],
                                                 cross_device_ops=ops)


@contextlib.contextmanager
def policy(mixed: bool):
  previous = keras.config.dtype_policy()
  if mixed:
    keras.config.set_dtype_policy("mixed_float16")
  try:
    yield
  finally:
    keras.config.set_dtype_policy(previous)


def jumped_weights(shapes, seed=3):
  """What ``set_weights`` sets mid-run: the same values on both sides of a comparison."""
  rng = np.random.default_rng(seed)
  return [(0.5 * rng.standard_normal(s)).astype(np.float32) for s in shapes]


def ordered(model) -> list:
  """The model's weights in layer order (``model.weights`` puts the trainable ones first,
  so its order changes while a layer is frozen)."""
  return [v for layer in model.layers for v in layer.weights]


def replica_copies(variable, strategy) -> List[np.ndarray]:
  value = variable.value if isinstance(variable, keras.Variable) else variable
  if strategy is None or not hasattr(strategy, "experimental_local_results"):
    return [np.asarray(value)]
  return [np.asarray(c) for c in strategy.experimental_local_results(value)]


def probe(c: Config):
  """Inputs for predict and evaluate: the first global batch."""
  x, y = data(c.model, c.steps)
  return x[:GLOBAL_BATCH], y[:GLOBAL_BATCH]


# --- model.fit, in phases with an event between them --------------------------------------


@dataclasses.dataclass
class Run:
  start: List[np.ndarray]
  weights: List[List[np.ndarray]]          # per variable (``ordered``), per replica
  iterations: int
  at_cut: Dict[str, Any] = dataclasses.field(default_factory=dict)


def _mirrored(strategy) -> bool:
  return isinstance(strategy, (tf.distribute.MirroredStrategy,
                               tf.compat.v1.distribute.MirroredStrategy))


def _fit(model, x, y, first, last):
  """``model.fit`` on global batches ``first`` to ``last``, shuffled never.

  Under a ``MirroredStrategy`` the batches go in as the strategy would split them: each
  replica's own shard (the global batch's ``r``-th consecutive ``GLOBAL_BATCH / R``
  rows, what ``experimental_distribute_dataset`` gives replica ``r`` and what
  ``Replay`` steps on), one input pipeline per replica, read where it is
  (``InputReplicationMode.PER_REPLICA`` without fetching to the device). Why not NumPy
  arrays: Keras distributes those with a ``MultiDeviceIterator``, three of which each
  ``fit`` creates (each tracing functions per device): about 0.5 CPU-s a ``fit`` on 2
  replicas, more than the optimizer's steps, half of a configuration's cost. The
  weights come out bit-identical either way (checked on 2 and 4 replicas, v1, mixed
  precision, an Embedding); the optimizer sees the same per-replica gradients.
  """
  strategy = model.distribute_strategy
  rows = slice(first * GLOBAL_BATCH, last * GLOBAL_BATCH)
  if not _mirrored(strategy):
    model.fit(x[rows], y[rows], batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    return
  xs, ys = x[rows], y[rows]
  per = GLOBAL_BATCH // strategy.num_replicas_in_sync

  def shard(context):
    r = context.input_pipeline_id  # the replica (one pipeline per replica)
    own = (np.arange(last - first)[:, None] * GLOBAL_BATCH + r * per + np.arange(per)).ravel()
    return tf.data.Dataset.from_tensor_slices((xs[own], ys[own])).batch(per)

  dataset = strategy.distribute_datasets_from_function(shard, tf.distribute.InputOptions(
      experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
      experimental_fetch_to_device=False))
  model.fit(dataset, epochs=1, shuffle=False, verbose=0)  # shuffle=True would only warn


def _inner_of(optimizer):
  """The wrapper or plain optimizer inside a LossScaleOptimizer."""
  while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    optimizer = optimizer.inner_optimizer
  return optimizer


def _compile(model, optimizer):
  model.compile(optimizer=optimizer, loss="mse")


def train(c: Config, wrapped: bool, directory: str) -> Run:
  """``model.fit`` for ``c.steps`` steps with ``c.event`` at ``c.cut``; the wrapper with
  "none" (``wrapped``) or the plain inner optimizer."""
  os.makedirs(directory, exist_ok=True)
  x, y = data(c.model, c.steps)
  all_reduce = c.cross_device_ops and wrapped  # the compressed all-reduce, or the default
  wrapped = wrapped and not c.cross_device_ops  # the optimizer is plain Keras' then
  strategy = make_strategy(c.replicas, c.no_strategy, c.v1, all_reduce)
  with policy(c.mixed):
    with strategy.scope():
      model = make_model(c)
      _compile(model, make_optimizer(c, wrapped, c.replicas))
    start = model.get_weights()
    cut, at_cut = c.cut, {}
    _fit(model, x, y, 0, cut)
    event = c.event
    if event in ("evaluate", "export"):
      # evaluate and predict; "export" also a SavedModel for serving (model.export),
      # loaded and served.
      px, py = probe(c)
      at_cut["loss"] = float(model.evaluate(px, py, batch_size=GLOBAL_BATCH, verbose=0))
      at_cut["predict"] = model.predict(px, batch_size=GLOBAL_BATCH, verbose=0)
      at_cut["weights"] = model.get_weights()
      if event == "export":
        path = os.path.join(directory, "exported")
        model.export(path, verbose=False)
        loaded = tf.saved_model.load(path)  # held: its function needs its variables
        at_cut["served"] = np.asarray(loaded.serve(tf.constant(px)))
        del loaded
    elif event == "set_weights":
      model.set_weights(jumped_weights([w.shape for w in model.get_weights()]))
    elif event == "freeze":
      model.layers[0].trainable = False
      with strategy.scope():
        _compile(model, model.optimizer)
      _fit(model, x, y, cut, cut + 2)
      cut += 2
      model.layers[0].trainable = True
      with strategy.scope():
        _compile(model, model.optimizer)
    elif event == "keras":
      path = os.path.join(directory, "model.keras")
      model.save(path)
      with strategy.scope():
        model = keras.models.load_model(path)
    elif event == "h5":
      path = os.path.join(directory, "model.weights.h5")
      model.save_weights(path)
      with strategy.scope():
        model = make_model(c)
        _compile(model, make_optimizer(c, wrapped, c.replicas))
      model.load_weights(path)
    elif event in ("checkpoint", "checkpoint_other"):
      replicas = c.other_count if event == "checkpoint_other" else c.replicas
      # CompressedAllReduce keeps its residues itself: one more item (its docs).
      extra = ({"residues": tf_adacomp.CompressedAllReduce.of(strategy)} if all_reduce
               else {})
      path = tf.train.Checkpoint(model=model, optimizer=model.optimizer, **extra).write(
          os.path.join(directory, "ckpt"))
      if event == "checkpoint_other":
        strategy = make_strategy(replicas, v1=c.v1, compressed_all_reduce=all_reduce)
      # The user's own optimizer for the devices there are (devices_per_worker that
      # does not divide them is theirs to drop).
      layout = (c.devices_per_worker if c.devices_per_worker and
                replicas % c.devices_per_worker == 0 else None)
      with strategy.scope():
        model = make_model(c)
        _compile(model, make_optimizer(c, wrapped, replicas, devices_per_worker=layout))
        model.optimizer.build(model.trainable_variables)
      extra = ({"residues": tf_adacomp.CompressedAllReduce.of(strategy)} if all_reduce
               else {})
      tf.train.Checkpoint(model=model, optimizer=model.optimizer, **extra).read(
          path).expect_partial()
    elif event == "keras_other":
      path = os.path.join(directory, "model.keras")
      model.save(path)
      strategy = make_strategy(c.other_count, v1=c.v1, compressed_all_reduce=all_reduce)
      with strategy.scope():
        model = keras.models.load_model(path)
    _fit(model, x, y, cut, c.steps)
    weights = [replica_copies(v, strategy) for v in ordered(model)]
    iterations = int(_inner_of(model.optimizer).iterations.numpy())
  return Run(start, weights, iterations, at_cut)


# --- The replay --------------------------------------------------------------------------


def _own_gradients(model, x, y, mixed, replicas=1):
  """One replica's mean gradient on its shard (eager, no strategy), of ``replicas`` in
  sync; as Keras computes it under mixed precision: each replica's loss divided by the
  replica count (Keras' loss scaling for distribution) and scaled by LossScaleOptimizer's
  scale, so the float16 backward pass sees ``LOSS_SCALE / replicas`` times the gradient,
  which is then divided out. Scaling by a power of two is exact, except where float16
  overflows: with the whole ``LOSS_SCALE`` a replica's gradient overflowed here where
  Keras' did not (defect G, NaN weights after a restore onto 2 replicas)."""
  scale = LOSS_SCALE / replicas
  with tf.GradientTape() as tape:
    prediction = tf.cast(model(x, training=True), tf.float32)
    loss = tf.reduce_mean(keras.losses.mean_squared_error(y, prediction))
    if mixed:
      loss = loss * scale
  grads = tape.gradient(loss, model.trainable_variables)
  if mixed:
    grads = [tf.IndexedSlices(g.values / scale, g.indices, g.dense_shape)
             if isinstance(g, tf.IndexedSlices) else g / scale for g in grads]
  return grads


def _clipped_as_keras(grads, clipnorm):
  """``grads`` clipped as Keras' ``global_clipnorm`` clips them, the wrapper's documented
  ``local_clipnorm`` of one replica: the global norm counts an IndexedSlices' slices'
  squares (Keras squares the slices before it makes them dense), and every gradient
  comes back dense, scaled by ``min(1, clipnorm / norm)`` (float64 here)."""
  total = 0.0
  for g in grads:
    values = g.values if isinstance(g, tf.IndexedSlices) else g
    total += float(np.sum(np.square(np.asarray(values, np.float64))))
  scale = min(1.0, clipnorm / math.sqrt(total))
  return [tf.constant((_dense(g) * scale).astype(np.float32)) for g in grads]


def _dense(g):
  return tf.convert_to_tensor(g).numpy().astype(np.float64)


def _mean_gradients(grads_per_replica):
  """What Keras' all-reduce hands the optimizer: the sum of the replicas' gradients,
  each scaled by 1/R; an IndexedSlices gradient stays one (the replicas' slices
  concatenated), as MirroredStrategy's all-reduce of IndexedSlices gives it."""
  replicas = len(grads_per_replica)
  out = []
  for parts in zip(*grads_per_replica):
    if isinstance(parts[0], tf.IndexedSlices):
      out.append(tf.IndexedSlices(tf.concat([p.values / replicas for p in parts], 0),
                                  tf.concat([p.indices for p in parts], 0),
                                  parts[0].dense_shape))
    else:
      out.append(tf.add_n([p / replicas for p in parts]))
  return out


def shares_moment(c: Config) -> bool:
  """Whether the replicas of ``c`` share Adam's second moment (averaged in bfloat16)."""
  return (resolved_second_moment(c) in ("shared", "global") and c.local_steps == 1
          and not estimates_own_moment(c))


def EstimatedGlobalAdam(inner, replicas):  # pylint: disable=invalid-name
  """``inner`` (a new Keras Adam or AdamW) as one replica's optimizer with
  ``second_moment="global"`` inside local steps or at every step with nothing averaged
  (the default; tf_adacomp.steps.estimated_adam's docstring): Keras'
  step (its schedule, weight decay, IndexedSlices squares), divided by the replica's
  estimate of the global batch's second moment from its own moments, in float32."""

  class Estimated(type(inner)):
    """Keras' Adam with the estimate in its ``update_step``."""

    sparse = None

    def build(self, var_list):
      if self.built:
        return
      super().build(var_list)
      self.momentum_squares = [self.add_variable_from_reference(v, "momentum_square")
                               for v in var_list]
      self.sparse = {}  # variable index -> whether its last gradient was IndexedSlices

    def update_step(self, gradient, variable, learning_rate):
      k = self._get_variable_index(variable)
      m, v, w = self._momentums[k], self._velocities[k], self.momentum_squares[k]
      t = tf.cast(self.iterations + 1, variable.dtype)
      b1, b2 = tf.cast(self.beta_1, variable.dtype), tf.cast(self.beta_2, variable.dtype)
      alpha = (tf.cast(learning_rate, variable.dtype) * tf.sqrt(1 - tf.pow(b2, t))
               / (1 - tf.pow(b1, t)))
      sparse = isinstance(gradient, tf.IndexedSlices)
      self.sparse[k] = sparse
      square = (tf.math.unsorted_segment_sum(tf.square(gradient.values), gradient.indices,
                                             gradient.dense_shape[0])
                if sparse else tf.square(gradient))
      m.assign_add((tf.convert_to_tensor(gradient) - m) * (1 - b1))
      v.assign_add((square - v) * (1 - b2))
      w.assign_add((tf.square(m / (1 - tf.pow(b1, t))) - w) * (1 - b2))
      variable.assign_sub(alpha * m / (tf.sqrt(self.estimate(k)) + self.epsilon))

    def estimate(self, k):
      v, w = self._velocities[k], self.momentum_squares[k]
      b1 = tf.cast(self.beta_1, v.dtype)
      c = (1 - b1) / (1 + b1)
      estimate = ((w - c * v) + (v - w) / replicas) / (1 - c)
      return (v / replicas if self.sparse.get(k) else
              tf.minimum(tf.maximum(estimate, v / replicas), v))

    def infer_first_moment(self, variable, mean_update, steps, learning_rate):
      """At an uncompressed round's end: ``m`` as the one that over ``steps`` steps would
      have moved ``variable`` by the replicas' ``mean_update`` (unless alpha is 0)."""
      k = self._get_variable_index(variable)
      t = float(self.iterations.numpy())
      alpha = (learning_rate * math.sqrt(1 - float(self.beta_2) ** t)
               / (1 - float(self.beta_1) ** t))
      if alpha > 0:
        self._momentums[k].assign(-mean_update * (tf.sqrt(self.estimate(k)) + self.epsilon)
                                  / np.float32(alpha * steps))

  return Estimated.from_config(inner.get_config())


class NumpySharedAdam:
  """Adam with one second moment shared by the replicas (shared_moment's docstring), in
  float64, per variable (by position in the model's weights)."""

  def __init__(self, c: Config, inner, replicas):
    self.c, self.inner, self.mode = c, inner, resolved_second_moment(c)
    self.b1, self.b2 = float(inner.beta_1), float(inner.beta_2)
    self.eps = float(inner.epsilon)
    self.replicas = replicas
    self.m, self.v, self.w = {}, {}, {}  # (replica, variable) -> array
    self.shared = {}                     # variable -> array
    self.synced_at = 0
    self.iterations = 0

  def learning_rate(self):
    """The learning rate at this step (a schedule's value at ``iterations``, as Keras)."""
    return learning_rate_at(self.c, self.iterations)

  def collapse(self, replicas):
    """A checkpoint's restore onto ``replicas``: each replica's own moments become their
    mean (the shared moment and the step of the last average are the same on all)."""
    for store in (self.m, self.v, self.w):
      keys = {k for _, k in store}
      means = {k: np.mean([store[(r, k)] for r in range(self.replicas)], axis=0) for k in keys}
      store.clear()
      for k, mean in means.items():
        for r in range(replicas):
          store[(r, k)] = mean.copy()
    self.replicas = replicas

  def step(self, weights, grads, present, decays):
    """New weights (per variable, float32) from each replica's own gradients ``grads[r][k]``
    for the variables ``present`` (positions); ``decays[k]``: whether weight decay applies."""
    t = self.iterations + 1
    lr = self.learning_rate()
    sparse = {k: isinstance(grads[0][i], tf.IndexedSlices) for i, k in enumerate(present)}
    for r in range(self.replicas):
      for i, k in enumerate(present):
        g = grads[r][i]
        if isinstance(g, tf.IndexedSlices):
          square = tf.math.unsorted_segment_sum(
              tf.square(tf.cast(g.values, tf.float64)), g.indices,
              g.dense_shape[0]).numpy()
        else:
          square = None
        g = _dense(g)
        square = g * g if square is None else square
        zeros = np.zeros_like(g)
        m = self.m.get((r, k), zeros)
        v = self.v.get((r, k), zeros)
        m = m + (g - m) * (1 - self.b1)
        v = v + (square - v) * (1 - self.b2)
        self.m[(r, k)], self.v[(r, k)] = m, v
        w = self.w.get((r, k), zeros)
        m_hat = m / (1 - self.b1 ** t)
        self.w[(r, k)] = w + (m_hat * m_hat - w) * (1 - self.b2)
    schedule = t & (t - 1) == 0  # 1, 2, 4, 8, ...
    if self.replicas == 1 or schedule or self.synced_at == 0:
      self.synced_at = t
      for k in present:
        v = np.mean([self.v[(r, k)] for r in range(self.replicas)], axis=0)
        w = np.mean([self.w[(r, k)] for r in range(self.replicas)], axis=0)
        if sparse[k]:
          # Slices' squares add up over the replicas: Keras' v on the global batch.
          shared = v / self.replicas
        elif self.mode == "shared":
          shared = v
        else:
          c = (1 - self.b1) / (1 + self.b1)
          estimate = ((w - c * v) + (v - w) / self.replicas) / (1 - c)
          shared = np.clip(estimate, v / self.replicas, v)
        self.shared[k] = shared
        for r in range(self.replicas):
          self.v[(r, k)], self.w[(r, k)] = v.copy(), w.copy()
    alpha = lr * math.sqrt(1 - self.b2 ** self.synced_at) / (1 - self.b1 ** t)
    bound = (shared_moment.step_bound(alpha, self.b1, self.b2) if self.synced_at != t
             else np.inf)
    out = [w.astype(np.float64) for w in weights]
    for k in present:
      divisor = np.sqrt(self.shared[k]) + self.eps
      steps = [np.clip(-alpha * self.m[(r, k)] / divisor, -bound, bound)
               for r in range(self.replicas)]
      if decays[k]:
        out[k] = out[k] - out[k] * self.inner.weight_decay * lr
      out[k] = out[k] + np.mean(steps, axis=0)
    self.iterations = t
    return [w.astype(np.float32) for w in out]


class Replay:
  """The eager, strategy-free replay of ``c`` (module docstring), through the same events
  as ``train``."""

  def __init__(self, c: Config, start: List[np.ndarray]):
    self.c = c
    self.mode = ("shared" if shares_moment(c) else
                 "gradients" if c.exchange == "gradients" else "local")
    self.start = [s.copy() for s in start]
    self.exclude_bias = c.weight_decay
    self._new_replicas(c.replicas, start)
    self._new_optimizers()

  def _new_replicas(self, replicas, weights):
    self.replicas = replicas
    with policy(self.c.mixed):
      self.models = [make_model(self.c) for _ in range(replicas)]
    for model in self.models:
      model.set_weights(weights)
    self.anchor = [np.asarray(w, np.float32).copy() for w in weights]

  def _inner(self, ema):
    optimizer = make_inner(self.c, ema=ema)
    if estimates_own_moment(self.c):
      optimizer = EstimatedGlobalAdam(optimizer, self.replicas)
    if self.c.weight_decay and self.exclude_bias:
      optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer

  def _ema(self):
    # The local optimizers' own EMA would follow each replica's weights: the wrapper's
    # follows the exchanged ones (tf_adacomp.ema), kept here (``self.ema``).
    return self.c.ema if self.mode == "gradients" else False

  def _new_optimizers(self):
    c = self.c
    count = 1 if self.mode == "gradients" else self.replicas
    self.optimizers = [self._inner(self._ema()) for _ in range(count)]
    self.shared = (NumpySharedAdam(c, make_inner(c), self.replicas)
                   if self.mode == "shared" else None)
    self.ema = None
    self.local_iterations = 0
    self.re_anchored = False  # a round cut by set_weights

  def _replace_optimizers(self, states):
    """New optimizers (one per replica, or one for the gradient exchange), built on the
    replicas' variables, holding ``states`` (per optimizer, its variables' values)."""
    models = self.models[:1] if self.mode == "gradients" else self.models
    self.optimizers = []
    for model, values in zip(models, states):
      optimizer = self._inner(self._ema())
      optimizer.build(model.trainable_variables)
      for variable, value in zip(optimizer.variables, values):
        variable.assign(np.asarray(value).astype(variable.dtype))
      self.optimizers.append(optimizer)

  def forget_exclusions(self):
    """What a ``.keras`` file's optimizer is: Keras' ``get_config`` does not hold
    ``exclude_from_weight_decay`` (Keras 3.15), so a loaded optimizer, plain or wrapped,
    decays every variable."""
    self.exclude_bias = False
    if self.mode != "shared":
      self._replace_optimizers([[v.numpy() for v in o.variables] for o in self.optimizers])

  def weights(self):
    return [[np.asarray(v.numpy()) for v in ordered(model)] for model in self.models]

  def _set_all(self, values):
    for model in self.models:
      for variable, value in zip(ordered(model), values):
        variable.assign(value)

  def _trainable_positions(self):
    model = self.models[0]
    ids = {id(v): k for k, v in enumerate(ordered(model))}
    return [ids[id(v)] for v in model.trainable_variables]

  def step(self, x, y):
    c, replicas = self.c, self.replicas
    per = GLOBAL_BATCH // replicas
    grads = []
    for r, model in enumerate(self.models):
      own = _own_gradients(model, x[r * per:(r + 1) * per], y[r * per:(r + 1) * per], c.mixed,
                           replicas)
      if c.local_clipnorm is not None:
        own = _clipped_as_keras(own, c.local_clipnorm)
      grads.append(own)
    if self.mode == "gradients":
      optimizer, model = self.optimizers[0], self.models[0]
      optimizer.apply(_mean_gradients(grads), model.trainable_variables)
      self._set_all([v.numpy() for v in ordered(model)])
      return
    if self.mode == "shared":
      present = self._trainable_positions()
      # AdamW's default weight decay applies to every variable; the configuration's
      # excludes the biases.
      decays = [bool(self.shared.inner.weight_decay)
                and not (c.weight_decay and self.exclude_bias and "bias" in variable.path)
                for variable in ordered(self.models[0])]
      new = self.shared.step([v.numpy() for v in ordered(self.models[0])], grads, present,
                             decays)
      self._set_all(new)
      return
    # The update exchange: each replica's own step, the anchor moves by their mean at a
    # round's end (every step with local_steps=1).
    if self.local_iterations % c.local_steps == 0:
      self.anchor = [np.asarray(v.numpy()) for v in ordered(self.models[0])]
    for optimizer, model, own in zip(self.optimizers, self.models, grads):
      optimizer.apply(own, model.trainable_variables)
    self.local_iterations += 1
    if self.local_iterations % c.local_steps:
      return
    everyone = self.weights()
    means = [np.mean([w[k] - a for w in everyone], axis=0).astype(np.float32)
             for k, a in enumerate(self.anchor)]
    new = [a + mean for a, mean in zip(self.anchor, means)]
    if (c.local_steps > 1 and estimates_own_moment(c) and replicas > 1
        and not self.re_anchored):
      # Uncompressed rounds reconcile the replicas' first moments from the mean
      # pseudo-update (tf_adacomp.steps.estimated_adam), not in a round cut by set_weights
      # nor on one replica.
      lr = learning_rate_at(c, int(self.optimizers[0].iterations.numpy()))
      for optimizer, model in zip(self.optimizers, self.models):
        positions = {id(v): k for k, v in enumerate(ordered(model))}
        for variable in model.trainable_variables:
          optimizer.infer_first_moment(variable, means[positions[id(variable)]],
                                       c.local_steps, lr)
    self.re_anchored = False
    self._set_all(new)
    self.anchor = new
    if c.ema:  # Keras' average of the exchanged weights (tf_adacomp.ema)
      momentum = 0.0 if self.local_iterations == 1 else EMA_MOMENTUM
      positions = self._trainable_positions()
      if self.ema is None:
        self.ema = {k: np.zeros_like(new[k]) for k in positions}
      for k in positions:
        self.ema[k] = (np.float32(momentum) * self.ema[k]
                       + np.float32(1 - momentum) * new[k]).astype(np.float32)

  def end_fit(self):
    """What the end of ``model.fit`` does: an EMA's average into the weights."""
    if not self.c.ema:
      return
    if self.mode == "gradients":
      model = self.models[0]
      self.optimizers[0].finalize_variable_values(model.trainable_variables)
      self._set_all([v.numpy() for v in ordered(model)])
    elif self.ema is not None:
      values = [w.copy() for w in self.weights()[0]]
      for k, average in self.ema.items():
        values[k] = average
      self._set_all(values)

  def fit(self, x, y, first, last):
    for s in range(first, last):
      rows = slice(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH)
      self.step(x[rows], y[rows])
    self.end_fit()

  def collapse(self, replicas):
    """A checkpoint written here restored onto ``replicas``: the first replica's weights,
    the mean of the replicas' optimizer slots (their on-read mean), on every replica."""
    weights = self.weights()[0]
    states = [[v.numpy() for v in o.variables] for o in self.optimizers]
    self._new_replicas(replicas, weights)
    if self.mode == "local":
      mean = [np.mean([state[j] for state in states], axis=0) for j in range(len(states[0]))]
      self._replace_optimizers([mean] * replicas)
    elif self.mode == "gradients":
      self._replace_optimizers(states)
    else:
      self.shared.collapse(replicas)


def replay(c: Config, start: List[np.ndarray]) -> Run:
  x, y = data(c.model, c.steps)
  r = Replay(c, start)
  cut = c.cut
  r.fit(x, y, 0, cut)
  event = c.event
  if event == "set_weights":
    values = jumped_weights([w.shape for w in r.weights()[0]])
    r._set_all(values)  # pylint: disable=protected-access
    r.anchor = [v.copy() for v in values]
    r.re_anchored = True
  elif event == "freeze":
    for model in r.models:
      model.layers[0].trainable = False
    r.fit(x, y, cut, cut + 2)
    cut += 2
    for model in r.models:
      model.layers[0].trainable = True
  elif event == "h5":
    r._new_optimizers()  # pylint: disable=protected-access
  elif event in ("keras_other", "checkpoint_other"):
    r.collapse(c.other_count)
  if event in ("keras", "keras_other"):
    r.forget_exclusions()
  r.fit(x, y, cut, c.steps)
  weights = r.weights()
  per_variable = [[weights[rep][k] for rep in range(r.replicas)] for k in range(len(weights[0]))]
  iterations = (r.shared.iterations if r.shared is not None else
                int(r.optimizers[0].iterations.numpy()))
  return Run([s.copy() for s in start], per_variable, iterations)


# --- Which reference, how close -----------------------------------------------------------


def reference_kind(c: Config) -> str:
  """"keras" (plain Keras under the same strategy and events) or "replay"."""
  if max(c.counts) == 1:
    return "keras"
  sm = resolved_second_moment(c)
  if sm in ("shared", "global") or c.local_clipnorm is not None:
    return "replay"
  if c.exchange == "gradients":
    return "keras"
  if c.inner == "sgd" and c.local_steps == 1:
    return "keras"  # linear in the gradient: the mean of the steps is SGD's step
  return "replay"


def tolerance(c: Config):
  if max(c.counts) == 1:
    return EXACT if c.local_steps == 1 and not rounding_defect(c) else ROUNDING
  if reference_kind(c) == "replay" and shares_moment(c):
    return SHARED
  return MIXED if c.mixed else FLOAT


def assert_close(found, expected, start, how, where):
  if how == EXACT:
    np.testing.assert_array_equal(found, expected, err_msg=where)
  elif "of_largest" in how:
    moved = expected.astype(np.float64) - start
    atol = how["of_largest"] * float(np.max(np.abs(moved))) + 1e-7
    np.testing.assert_allclose(found.astype(np.float64) - start, moved, rtol=how["rtol"],
                               atol=atol, err_msg=where)
  else:
    np.testing.assert_allclose(found, expected, err_msg=where, **how)


def compare(c: Config, ours: Run, reference: Run, how=None):
  """Every replica's copy of every weight: equal on all replicas (every run ends a
  round), and close to the reference's."""
  how = tolerance(c) if how is None else how
  assert len(ours.weights) == len(reference.weights)
  for s, r in zip(ours.start, reference.start):
    np.testing.assert_array_equal(s, r, err_msg="the runs start from other weights")
  failures = []
  for k, (copies, expected) in enumerate(zip(ours.weights, reference.weights)):
    for r, copy in enumerate(copies):
      if not np.array_equal(copy, copies[0]):
        failures.append(f"weight {k}: replica {r} holds other values than replica 0 "
                        f"(max diff {np.max(np.abs(copy - copies[0])):.3g})")
    try:
      start = ours.start[k].astype(np.float64) if k < len(ours.start) else 0.0
      assert_close(copies[0], expected[0], start, how, f"weight {k}")
    except AssertionError as error:
      diff = np.max(np.abs(copies[0].astype(np.float64) - expected[0]))
      failures.append(f"weight {k}: max |ours - reference| = {diff:.3g} "
                      f"(tolerance {how}) {str(error).splitlines()[0] if how != EXACT else ''}")
  assert not failures, f"{c.id}: " + "; ".join(failures)
  assert ours.iterations == reference.iterations, (
      f"{c.id}: iterations {ours.iterations} != reference {reference.iterations}")


# Reference runs by what they train: computed once per process, shared by the
# configurations that differ only in the wrapper's own arguments (``computed_once``).
_ONCE: Dict[Any, Any] = {}


def computed_once(key, compute):
  """``compute()``, once per process for each ``key``; a copy for each caller, so that
  none sees another's arrays."""
  if key not in _ONCE:
    _ONCE[key] = compute()
  return copy.deepcopy(_ONCE[key])


def _reference_key(c: Config) -> Config:
  """What ``train(c, wrapped=False)`` reads of ``c``: the wrapper's own arguments reset
  (``make_optimizer`` and ``train`` pass none of them to the plain optimizer), and
  ``local_clipnorm`` only where a count is 1 (there it is ``global_clipnorm``)."""
  return dataclasses.replace(
      c, exchange="updates", second_moment=None, precondition="before", local_steps=1,
      start_step=0, devices_per_worker=None,
      local_clipnorm=c.local_clipnorm if 1 in c.counts else None)


def keras_reference(c: Config, directory: str) -> Run:
  """``train(c, False, directory)``, once per process for each ``_reference_key``
  (a copy: no caller sees another's arrays)."""
  return computed_once(("keras", _reference_key(c)), lambda: train(c, False, directory))


def check(c: Config, directory: str):
  """The oracle for one configuration: a ValueError where the constructor must refuse
  it, else the wrapper against its reference."""
  broken = construction_error(c)
  if broken:
    with pytest.raises(ValueError) as error:
      make_wrapper(c)
    assert any(name in str(error.value) for name in broken), (
        f"{c.id}: the ValueError names none of {broken}: {error.value}")
    return
  os.makedirs(os.path.join(directory, "ours"), exist_ok=True)
  os.makedirs(os.path.join(directory, "reference"), exist_ok=True)
  ours = train(c, True, os.path.join(directory, "ours"))
  if reference_kind(c) == "keras":
    reference = keras_reference(c, os.path.join(directory, "reference"))
  else:
    reference = replay(c, ours.start)
  compare(c, ours, reference)
  check_at_cut(c, ours)


def check_at_cut(c: Config, ours: Run):
  """``evaluate``/``predict`` and the exported SavedModel at the cut give what the
  model's weights give there."""
  at_cut = ours.at_cut
  if "served" in at_cut:
    np.testing.assert_allclose(at_cut["served"], at_cut["predict"], rtol=1e-6, atol=1e-6,
                               err_msg=f"{c.id}: the exported model serves other outputs")
  if "weights" in at_cut:
    with policy(c.mixed):
      model = make_model(c)
    model.set_weights(at_cut["weights"])
    px, py = probe(c)
    expected = np.asarray(model(px, training=False), np.float32)
    how = MIXED if c.mixed else dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(at_cut["predict"], expected, err_msg=f"{c.id}: predict", **how)
    loss = float(np.mean((expected - py) ** 2))
    np.testing.assert_allclose(at_cut["loss"], loss, err_msg=f"{c.id}: evaluate", **how)


# --- Diagnosis: the smallest configuration that still fails ------------------------------


def parse_id(text: str) -> Config:
  """The ``Config`` a test id names (``Config.id``'s inverse)."""
  fields = {f.name: f for f in dataclasses.fields(Config)}
  values = {}
  for part in filter(None, text.split(",")):
    if "=" not in part:
      name, value = (part[3:], False) if part.startswith("no_") and part[3:] in fields and \
          part != "no_strategy" else (part, True)
      values[name] = value
      continue
    name, raw = part.split("=", 1)
    default = fields[name].default
    if raw == "None":
      value = None
    elif isinstance(default, int) and not isinstance(default, bool) or name in (
        "devices_per_worker",):
      value = int(raw)
    elif name == "local_clipnorm":
      value = float(raw)
    else:
      value = raw
    values[name] = value
  return Config(**values)


def outcome(c: Config, directory: str) -> Optional[str]:
  """None if ``c`` passes the oracle, else the failure's first line."""
  try:
    check(c, directory)
  except Exception as error:  # pylint: disable=broad-except
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
  return None


def minimize(c: Config, directory: str, log=print) -> Config:
  """Resets each field of a failing ``c`` to its default (or a simpler value) while it
  still fails the same way (the same exception type) and stays valid: the factors the
  failure needs. ``python tests/conformance/oracle.py minimize ID...`` (or ``run``)."""
  failure = outcome(c, directory)
  log(f"{c.id}: {failure}")
  if failure is None:
    return c
  simpler = {"replicas": [2, 1], "event": ["none"], "model": ["dense"]}
  changed = True
  while changed:
    changed = False
    for field in dataclasses.fields(Config):
      value = getattr(c, field.name)
      for candidate in [field.default] + simpler.get(field.name, []):
        if candidate == value:
          break
        trial = dataclasses.replace(c, **{field.name: candidate})
        if any(not p(*(getattr(trial, a) for a in axes)) for axes, p in TRAINING_RULES):
          continue
        if construction_error(trial):
          continue
        result = outcome(trial, directory)
        log(f"  {trial.id}: {result}")
        if result is not None and result.split(":")[0] == failure.split(":")[0]:
          c, changed = trial, True
          break
  log(f"smallest: {c.id}")
  return c


if __name__ == "__main__":
  import sys
  import tempfile
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
  import conftest  # pylint: disable=g-import-not-at-top
  conftest.split_cpu()
  for text in sys.argv[2:]:
    with tempfile.TemporaryDirectory() as tmp:
      if sys.argv[1] == "minimize":
        minimize(parse_id(text), tmp)
      else:
        print(text, outcome(parse_id(text), tmp))
