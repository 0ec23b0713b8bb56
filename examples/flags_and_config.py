"""The examples' shared settings: their absl flags, the ``Config`` of a run, its checks.

The choices of ``--compressor``, ``--reduction``, ``--adasum_mode`` and
``--optimizer_exchange`` are the library's own lists (``tf_adacomp.available_compressors()``,
``exchange.REDUCTIONS``, ``optimizer.ADASUM_MODES``, ``optimizer.EXCHANGES``), not
copies: importing ``tf_adacomp.examples`` loads the library (and TensorFlow) anyway.
``validate`` also builds the compressor (``optimizers.make_compressor``) for the
library's own checks of its options.
"""

import dataclasses
import math
from typing import Any, Dict, Optional

from absl import flags

import tf_adacomp
import tf_adacomp.exchange
import tf_adacomp.optimizer
from tf_adacomp.examples import optimizers

FLAGS = flags.FLAGS

STRATEGIES = ("mirrored", "multi_worker", "one_device")
EXCHANGES = ("optimizer", "cross_device_ops")
REDUCTIONS = tf_adacomp.exchange.REDUCTIONS
ADASUM_MODES = tf_adacomp.optimizer.ADASUM_MODES
OPTIMIZER_EXCHANGES = tf_adacomp.optimizer.EXCHANGES
SECOND_MOMENTS = tf_adacomp.shared_moment.SECOND_MOMENTS
# --outer_optimizer: the mean of the replicas' pseudo-updates, or DiLoCo's Nesterov SGD.
OUTER_OPTIMIZERS = ("average", "nesterov")
# The exchange of each reduction when --optimizer_exchange is unset.
DEFAULT_OPTIMIZER_EXCHANGE = tf_adacomp.optimizer.DEFAULT_EXCHANGE
LR_SCHEDULES = ("constant", "cosine", "step", "legw")
OPTIMIZERS = ("sgd", "adam", "adamw")
# "none" (TensorFlow's dense all-reduce) first, then the registered compressors.
COMPRESSORS = ("none", *(c for c in tf_adacomp.available_compressors() if c != "none"))

flags.DEFINE_enum("strategy", "mirrored", STRATEGIES,
                  "mirrored: the replicas of this machine; multi_worker: one process per "
                  "host, cluster from TF_CONFIG; one_device: no distribution.")
flags.DEFINE_integer("replicas", None, "Replicas on this machine: GPUs, or logical devices "
                     "split from the first GPU or the CPU when there are fewer GPUs. "
                     "Default: every GPU, else 1 CPU.")
flags.DEFINE_enum("compressor", None, COMPRESSORS,
                  "Gradient compression; none is TensorFlow's dense all-reduce. "
                  "Default: adacomp.")
flags.DEFINE_enum("exchange", None, EXCHANGES,
                  "optimizer: CompressedOptimizer (any strategy); cross_device_ops: "
                  "CompressedAllReduce in a MirroredStrategy.")
flags.DEFINE_enum("reduction", None, REDUCTIONS,
                  "How the replicas' (decoded) gradients combine: sum, or adasum "
                  "(Adasum, Maleki et al. 2021; docs/adasum.md).")
flags.DEFINE_enum("adasum_mode", None, ADASUM_MODES,
                  "With --reduction=adasum and --exchange=optimizer: Adasum of gradients, "
                  "or of each replica's optimizer update (delta, Horovod's).")
flags.DEFINE_enum("optimizer_exchange", None, OPTIMIZER_EXCHANGES,
                  "With --exchange=optimizer: what CompressedOptimizer compresses, the "
                  "gradients or each replica's local optimizer update (default: the "
                  "library's; docs/distributed.md).")
flags.DEFINE_boolean("momentum_masking", None, "With --optimizer_exchange=updates: zero "
                     "the local momentum where an element was sent (DGC).")
flags.DEFINE_enum("second_moment", None, SECOND_MOMENTS,
                  "With --optimizer_exchange=updates and Adam/AdamW: each replica's own "
                  "second moment, or one shared by all (the replicas' mean, or 'global': "
                  "estimated for the global batch). Default: the library's "
                  "(tf_adacomp.optimizer.default_second_moment).")
flags.DEFINE_integer("optimizer_local_steps", None, "With --exchange=optimizer: steps each "
                     "replica takes on its own between exchanges (DiLoCo, SparseLoCo; "
                     "docs/distributed.md). Default 1: every step.")
flags.DEFINE_enum("outer_optimizer", None, OUTER_OPTIMIZERS,
                  "With --exchange=optimizer: how a round's exchanged pseudo-update moves "
                  "the weights: average (apply the mean) or nesterov (DiLoCo's Nesterov "
                  "SGD, learning rate 0.7, momentum 0.9). Default: the library's.")
flags.DEFINE_boolean("dense_when_faster", None, "With --exchange=optimizer: measure the "
                     "compressed exchange against the dense all-reduce during training "
                     "and use the faster (CompressedOptimizer's dense_when_faster, on by "
                     "default in the library). Off here unless set: the examples show "
                     "the compression, every step.")
flags.DEFINE_float("local_clipnorm", None, "With --exchange=optimizer: clip each "
                   "replica's own mean gradient to this global norm before compression.")
flags.DEFINE_integer("conv_bin_size", None, "AdaComp bin length L_T of conv kernels (50).")
flags.DEFINE_integer("dense_bin_size", None, "AdaComp L_T of dense kernels (500).")
flags.DEFINE_integer("recurrent_bin_size", None, "AdaComp L_T of recurrent kernels (500).")
flags.DEFINE_float("max_density", None, "AdaComp payload capacity, a fraction of the "
                   "tensor (0.25); what does not fit stays in the residue.")
flags.DEFINE_float("topk_density", None, "Fraction of elements TopK sends (0.01).")
flags.DEFINE_float("fft_theta", None, "Fraction of FFT coefficients the fft compressor "
                   "drops (0.9).")
flags.DEFINE_float("fft_final_theta", None, "fft: the theta reached linearly after "
                   "--fft_theta_decay_steps steps (default: constant --fft_theta).")
flags.DEFINE_integer("fft_theta_decay_steps", None, "fft: steps of the theta schedule (0).")
flags.DEFINE_integer("start_step", None, "Dense (float32) steps before compression starts.")
flags.DEFINE_integer("epochs", None, "Training epochs.")
flags.DEFINE_integer("steps_per_epoch", None, "Steps per epoch (default: one pass over "
                     "the training split).")
flags.DEFINE_integer("eval_steps", None, "Test batches to evaluate (default: all).")
flags.DEFINE_integer("batch_size", None, "Global batch size (all replicas together).")
flags.DEFINE_integer("base_batch_size", None, "--lr_schedule=legw: the global batch size "
                     "--learning_rate and --warmup_epochs were tuned at (default: "
                     "--batch_size, no scaling).")
flags.DEFINE_float("learning_rate", None, "Peak learning rate at the global batch size "
                   "(legw: at --base_batch_size, scaled by sqrt(batch_size/base_batch_size)).")
flags.DEFINE_enum("lr_schedule", None, LR_SCHEDULES,
                  "After warm-up: constant, cosine decay to 0, or step (x0.1 at 50% and "
                  "75% of training); legw: LEGW (You et al. 2019), the base batch's rate "
                  "and warm-up scaled to --batch_size, then polynomial decay to 0.")
flags.DEFINE_float("warmup_epochs", None, "Epochs of linear warm-up from 0 (legw: at "
                   "--base_batch_size, scaled by batch_size/base_batch_size).")
flags.DEFINE_enum("optimizer", None, OPTIMIZERS, "Inner optimizer (SGD has momentum 0.9; "
                  "AdamW: Adam with decoupled weight decay, --weight_decay).")
flags.DEFINE_float("weight_decay", None, "--optimizer=adamw: decoupled weight decay "
                   f"({optimizers.ADAMW_WEIGHT_DECAY}), not applied to biases, "
                   "normalisation scales and offsets, or embeddings.")
flags.DEFINE_string("model_dir", None, "Checkpoints (with residues, resumed from when "
                    "present), TensorBoard logs and summary.json.")
flags.DEFINE_string("data_dir", None, "tensorflow-datasets data directory (Fashion-MNIST: "
                    "also a directory of IDX files).")
flags.DEFINE_boolean("synthetic", False, "Random data of the real shapes (smoke runs).")
flags.DEFINE_boolean("xla_cache", None, "Keep compiled XLA programs on disk and reuse them "
                     "across devices and runs (tf_adacomp.xla_cache; default true).")
flags.DEFINE_integer("seed", None, "Random seed of weights and data order.")
flags.DEFINE_integer("verbose", None, "Keras fit verbosity: 0 silent, 1 progress bar, "
                     "2 one line per epoch.")


@dataclasses.dataclass
class Config:
  """One training run. ``None`` fields take the example's ``DEFAULTS``, then these."""
  strategy: str = "mirrored"
  replicas: Optional[int] = None
  compressor: str = "adacomp"
  exchange: str = "optimizer"
  reduction: str = "sum"
  adasum_mode: str = "gradient"
  optimizer_exchange: Optional[str] = None  # None: CompressedOptimizer's default
  momentum_masking: bool = False
  local_clipnorm: Optional[float] = None
  second_moment: Optional[str] = None  # None: CompressedOptimizer's default
  # CompressedOptimizer's local_steps (ResIST's example has a local_steps of its own).
  optimizer_local_steps: Optional[int] = None  # None: CompressedOptimizer's default (1)
  outer_optimizer: Optional[str] = None  # None: CompressedOptimizer's default
  dense_when_faster: bool = False
  conv_bin_size: int = 50
  dense_bin_size: int = 500
  recurrent_bin_size: int = 500
  max_density: float = 0.25
  topk_density: float = 0.01
  fft_theta: float = 0.9
  fft_final_theta: Optional[float] = None
  fft_theta_decay_steps: int = 0
  start_step: int = 0
  epochs: int = 1
  steps_per_epoch: Optional[int] = None
  eval_steps: Optional[int] = None
  batch_size: int = 128
  base_batch_size: Optional[int] = None  # legw: batch of learning_rate, warmup_epochs
  learning_rate: float = 0.1
  lr_schedule: str = "constant"
  warmup_epochs: float = 0.0
  optimizer: str = "sgd"
  weight_decay: Optional[float] = None  # adamw only; None: optimizers.ADAMW_WEIGHT_DECAY
  model_dir: Optional[str] = None
  data_dir: Optional[str] = None
  synthetic: bool = False
  xla_cache: bool = True  # tf_adacomp.xla_cache, when the process has not started TF yet
  seed: int = 0
  verbose: int = 1
  options: Dict[str, Any] = dataclasses.field(default_factory=dict)  # the example's own


def make_config(example, **overrides) -> Config:
  """The example's ``DEFAULTS`` over ``Config``'s, then ``overrides`` (None: unset).

  Raises:
    ValueError: an unknown field, or a value out of range (see ``validate``).
  """
  fields = {f.name for f in dataclasses.fields(Config)}
  values = {}
  for source in (example.DEFAULTS, {k: v for k, v in overrides.items() if v is not None}):
    for name, value in source.items():
      if name in fields:
        values[name] = value
      else:
        values.setdefault("options", {})[name] = value
  options = dict(getattr(example, "OPTIONS", {}))
  options.update(values.pop("options", {}))
  unknown = set(options) - set(getattr(example, "OPTIONS", {}))
  if unknown:
    raise ValueError(f"Unknown setting(s) for example {example.NAME!r}: {sorted(unknown)}. "
                     f"Received: {', '.join(f'{k}={options[k]!r}' for k in sorted(unknown))}")
  config = Config(**values, options=options)
  validate(config)
  return config


def config_from_flags(example) -> Config:
  """``make_config`` from the parsed shared flags and the example's own flags."""
  shared = {f.name: getattr(FLAGS, f.name) for f in dataclasses.fields(Config)
            if f.name != "options" and f.name in FLAGS}
  shared["synthetic"] = FLAGS.synthetic or None
  own = {name: getattr(FLAGS, name) for name in getattr(example, "OPTIONS", {})}
  return make_config(example, **shared, **own)


def validate(config: Config):
  """Raises ValueError naming the first setting out of range, and the value received."""
  def need(ok, name, rule):
    if not ok:
      raise ValueError(f"`{name}` must be {rule}. Received: {name}={getattr(config, name)!r}")

  need(config.strategy in STRATEGIES, "strategy", f"one of {STRATEGIES}")
  need(config.compressor in COMPRESSORS, "compressor", f"one of {COMPRESSORS}")
  need(config.exchange in EXCHANGES, "exchange", f"one of {EXCHANGES}")
  need(config.reduction in REDUCTIONS, "reduction", f"one of {REDUCTIONS}")
  need(config.adasum_mode in ADASUM_MODES, "adasum_mode", f"one of {ADASUM_MODES}")
  if config.adasum_mode == "delta":
    need(config.reduction == "adasum" and config.exchange == "optimizer", "adasum_mode",
         "'gradient' unless --reduction=adasum --exchange=optimizer (the delta mode is the "
         "optimizer's)")
  need(config.optimizer_exchange in (None, *OPTIMIZER_EXCHANGES), "optimizer_exchange",
       f"one of {OPTIMIZER_EXCHANGES} or unset")
  need(config.optimizer_exchange in (None, "updates") or config.adasum_mode != "delta",
       "optimizer_exchange", "'updates' or unset with --adasum_mode=delta")
  need(config.second_moment in (None, *SECOND_MOMENTS), "second_moment",
       f"one of {SECOND_MOMENTS} or unset")
  need(config.optimizer_local_steps is None or (
      isinstance(config.optimizer_local_steps, int) and config.optimizer_local_steps >= 1),
       "optimizer_local_steps", "an integer >= 1 or unset")
  need(config.outer_optimizer in (None, *OUTER_OPTIMIZERS), "outer_optimizer",
       f"one of {OUTER_OPTIMIZERS} or unset")
  for name in ("optimizer_exchange", "local_clipnorm", "second_moment",
               "optimizer_local_steps", "outer_optimizer"):
    need(getattr(config, name) is None or config.exchange == "optimizer", name,
         "unset with --exchange=cross_device_ops (a CompressedOptimizer option)")
  need(config.local_clipnorm is None or (config.local_clipnorm > 0
                                         and math.isfinite(config.local_clipnorm)),
       "local_clipnorm", "a finite number > 0 or unset")
  need(config.momentum_masking in (True, False), "momentum_masking", "True or False")
  need(config.dense_when_faster in (True, False), "dense_when_faster", "True or False")
  need(not config.dense_when_faster or config.exchange == "optimizer", "dense_when_faster",
       "False with --exchange=cross_device_ops (a CompressedOptimizer option)")
  if config.momentum_masking:
    exchange = config.optimizer_exchange or (
        "updates" if config.adasum_mode == "delta"
        else DEFAULT_OPTIMIZER_EXCHANGE.get(config.reduction))
    need(config.exchange == "optimizer" and exchange == "updates", "momentum_masking",
         "False unless --exchange=optimizer exchanges updates (--optimizer_exchange="
         "updates or --adasum_mode=delta)")
  need(config.lr_schedule in LR_SCHEDULES, "lr_schedule", f"one of {LR_SCHEDULES}")
  need(config.optimizer in OPTIMIZERS, "optimizer", f"one of {OPTIMIZERS}")
  need(config.weight_decay is None or (config.weight_decay >= 0
                                       and math.isfinite(config.weight_decay)),
       "weight_decay", "a finite number >= 0 or unset")
  need(config.weight_decay is None or config.optimizer == "adamw", "weight_decay",
       "unset unless optimizer='adamw' (only AdamW decays weights)")
  need(config.replicas is None or config.replicas >= 1, "replicas", ">= 1")
  for name in ("epochs", "batch_size"):
    need(getattr(config, name) >= 1, name, ">= 1")
  for name in ("steps_per_epoch", "eval_steps"):
    need(getattr(config, name) is None or getattr(config, name) >= 1, name, ">= 1 or unset")
  need(config.learning_rate > 0 and math.isfinite(config.learning_rate), "learning_rate",
       "a finite number > 0")
  need(config.base_batch_size is None or config.base_batch_size >= 1, "base_batch_size",
       ">= 1 or unset")
  need(config.base_batch_size is None or config.lr_schedule == "legw", "base_batch_size",
       "unset unless lr_schedule='legw' (only LEGW scales from a base batch)")
  if config.lr_schedule == "legw":  # LEGW stretches the warm-up k = batch/base times
    base = config.base_batch_size or config.batch_size
    need(0 <= config.warmup_epochs * config.batch_size / base <= config.epochs,
         "warmup_epochs", f">= 0 and, times batch_size/base_batch_size={config.batch_size}/"
         f"{base}, <= epochs={config.epochs}")
  else:
    need(0 <= config.warmup_epochs <= config.epochs, "warmup_epochs",
         f">= 0 and <= epochs={config.epochs}")
  need(config.start_step >= 0, "start_step", ">= 0")
  need(config.verbose in (0, 1, 2), "verbose", "0, 1 or 2")
  if config.strategy == "one_device":
    need(config.replicas in (None, 1), "replicas", "1 with --strategy=one_device")
  if config.exchange == "cross_device_ops":
    need(config.strategy == "mirrored", "strategy",
         "mirrored with --exchange=cross_device_ops (only MirroredStrategy takes custom "
         "cross-device ops)")
  if config.replicas and config.batch_size % config.replicas:
    need(False, "batch_size", f"divisible by replicas={config.replicas}")
  optimizers.make_compressor(config)  # its own checks: bin sizes, densities (named, with value)
