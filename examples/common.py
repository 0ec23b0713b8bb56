"""What every example shares: flags, strategy, optimizer, the training run and its summary.

An example module provides ``NAME``, ``DEFAULTS`` (its hyper-parameters, overridden by
flags), ``load_data(config) -> Data`` and ``build_model(config, data) -> keras.Model``
(uncompiled, logits out), and optionally ``callbacks(config) -> [keras.callbacks.Callback]``
(more callbacks for ``fit``; those with a ``summary() -> dict`` method add its entries to
the summary); ``train(example, config)`` does the rest:

  1. the strategy (``--strategy``, ``--replicas``; logical devices where there are fewer
     GPUs than replicas), made before anything else touches TensorFlow;
  2. input pipelines: the example's shuffled, augmented examples, repeated, batched to
     the global batch size and prefetched;
  3. the model and a ``CompressedOptimizer`` (or, with ``--exchange cross_device_ops``, a
     ``CompressedAllReduce`` strategy) built in the strategy's scope;
  4. ``model.fit`` with Keras progress bars, compression statistics, TensorBoard logs and
     resumable checkpoints (residues included) in ``--model_dir``;
  5. the test accuracy, and a summary printed and written to ``<model_dir>/summary.json``.
"""

import dataclasses
import json
import math
import os
import time
from typing import Any, Dict, Optional

from absl import flags

FLAGS = flags.FLAGS

STRATEGIES = ("mirrored", "multi_worker", "one_device")
EXCHANGES = ("optimizer", "cross_device_ops")
REDUCTIONS = ("sum", "adasum")  # tf_adacomp.collectives.REDUCTIONS (test_common checks)
ADASUM_MODES = ("gradient", "delta")  # tf_adacomp.optimizer.ADASUM_MODES
OPTIMIZER_EXCHANGES = ("gradients", "updates")  # tf_adacomp.optimizer.EXCHANGES
# tf_adacomp.optimizer.DEFAULT_EXCHANGE: the exchange of each reduction when unset.
DEFAULT_OPTIMIZER_EXCHANGE = {"sum": "updates", "adasum": "gradients"}
LR_SCHEDULES = ("constant", "cosine", "step", "legw")
OPTIMIZERS = ("sgd", "adam")
# Kept in step with tf_adacomp.available_compressors() by tests/examples/test_common.py
# (listed here so that parsing flags does not import TensorFlow).
COMPRESSORS = ("none", "fp16", "bf16", "topk", "adacomp", "fft")

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
flags.DEFINE_enum("optimizer", None, OPTIMIZERS, "Inner optimizer (SGD has momentum 0.9).")
flags.DEFINE_string("model_dir", None, "Checkpoints (with residues, resumed from when "
                    "present), TensorBoard logs and summary.json.")
flags.DEFINE_string("data_dir", None, "tensorflow-datasets data directory (Fashion-MNIST: "
                    "also a directory of IDX files).")
flags.DEFINE_boolean("synthetic", False, "Random data of the real shapes (smoke runs).")
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
  model_dir: Optional[str] = None
  data_dir: Optional[str] = None
  synthetic: bool = False
  seed: int = 0
  verbose: int = 1
  options: Dict[str, Any] = dataclasses.field(default_factory=dict)  # the example's own


@dataclasses.dataclass
class Data:
  """An example's data: unbatched ``(x, y)`` datasets and split sizes.

  ``train`` is shuffled and augmented (``pipelines`` repeats and batches it); ``test``
  is in order.
  """
  train: Any
  test: Any
  train_size: int
  test_size: int
  info: Dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. vocabulary size


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
  for name in ("optimizer_exchange", "local_clipnorm"):
    need(getattr(config, name) is None or config.exchange == "optimizer", name,
         "unset with --exchange=cross_device_ops (a CompressedOptimizer option)")
  need(config.local_clipnorm is None or (config.local_clipnorm > 0
                                         and math.isfinite(config.local_clipnorm)),
       "local_clipnorm", "a finite number > 0 or unset")
  need(config.momentum_masking in (True, False), "momentum_masking", "True or False")
  if config.momentum_masking:
    exchange = config.optimizer_exchange or (
        "updates" if config.adasum_mode == "delta"
        else DEFAULT_OPTIMIZER_EXCHANGE.get(config.reduction))
    need(config.exchange == "optimizer" and exchange == "updates", "momentum_masking",
         "False unless --exchange=optimizer exchanges updates (--optimizer_exchange="
         "updates or --adasum_mode=delta)")
  need(config.lr_schedule in LR_SCHEDULES, "lr_schedule", f"one of {LR_SCHEDULES}")
  need(config.optimizer in OPTIMIZERS, "optimizer", f"one of {OPTIMIZERS}")
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
  make_compressor(config)  # its own checks: bin sizes, densities (named, with the value)


# --- Strategy -----------------------------------------------------------------------


def replica_devices(count: Optional[int]):
  """Device names for ``count`` local replicas (None: every GPU, else one CPU).

  Uses the first ``count`` GPUs; with fewer GPUs, splits the first GPU (2 GiB each) or
  the CPU into logical devices. Call before anything else touches TensorFlow.
  """
  import tensorflow as tf
  from tf_adacomp import distribute

  gpus = tf.config.list_physical_devices("GPU")
  if count is None:
    count = max(len(gpus), 1)
  if gpus and count <= len(gpus):
    return [f"/device:GPU:{i}" for i in range(count)]
  kind = "GPU" if gpus else "CPU"
  try:
    return distribute.split_logical_devices(
        count, kind, memory_limit=2048 if kind == "GPU" else None)
  except RuntimeError:
    # TensorFlow already runs with logical devices (a test's conftest): use them if enough.
    existing = tf.config.list_logical_devices(kind)
    if len(existing) < count:
      raise
    return [device.name for device in existing[:count]]


def make_compressor(config: Config):
  """The ``tf_adacomp`` compressor the flags describe."""
  import tf_adacomp

  options = {}
  if config.compressor == "adacomp":
    options = dict(conv_bin_size=config.conv_bin_size, dense_bin_size=config.dense_bin_size,
                   recurrent_bin_size=config.recurrent_bin_size,
                   max_density=config.max_density)
  elif config.compressor == "topk":
    options = dict(density=config.topk_density)
  elif config.compressor == "fft":
    options = dict(theta=config.fft_theta, final_theta=config.fft_final_theta,
                   theta_decay_steps=config.fft_theta_decay_steps)
  return tf_adacomp.get_compressor(config.compressor, **options)


def make_strategy(config: Config):
  """The ``tf.distribute`` strategy of ``config`` (see the module docstring)."""
  import tensorflow as tf
  from tf_adacomp import distribute
  from tf_adacomp.cross_device_ops import CompressedAllReduce

  if config.strategy == "multi_worker":
    if config.replicas not in (None, 1) and not tf.config.list_physical_devices("GPU"):
      raise ValueError("Under --strategy=multi_worker each CPU worker is one replica (add "
                       f"workers to TF_CONFIG instead). Received: replicas={config.replicas}")
    return distribute.multi_worker_strategy()
  devices = replica_devices(config.replicas)
  if config.strategy == "one_device":
    return tf.distribute.OneDeviceStrategy(devices[0])
  if config.exchange == "cross_device_ops" and (config.compressor != "none"
                                                or config.reduction != "sum"):
    return distribute.mirrored_strategy(
        devices=devices, cross_device_ops=CompressedAllReduce(
            make_compressor(config), start_step=config.start_step,
            reduction=config.reduction))
  return distribute.mirrored_strategy(devices=devices)


def is_chief(strategy) -> bool:
  """True except on the non-chief workers of a multi-worker cluster."""
  resolver = getattr(strategy, "cluster_resolver", None)
  if resolver is None or not resolver.cluster_spec().as_dict():
    return True
  return resolver.task_type == "chief" or (
      resolver.task_type == "worker" and resolver.task_id == 0
      and "chief" not in resolver.cluster_spec().as_dict())


# --- Optimizer ----------------------------------------------------------------------


def make_optimizer(config: Config, steps_per_epoch: int):
  """The inner Keras optimizer, wrapped in a ``CompressedOptimizer`` when compressing."""
  import keras
  import tf_adacomp

  total = config.epochs * steps_per_epoch
  if config.lr_schedule == "legw":
    # --learning_rate and --warmup_epochs are the base batch's: LEGW scales them.
    rate = tf_adacomp.schedules.LEGW(
        config.learning_rate, config.base_batch_size or config.batch_size, config.batch_size,
        config.warmup_epochs, steps_per_epoch, config.epochs)
  else:
    rate = tf_adacomp.schedules.WarmupDecay(
        config.learning_rate, total_steps=total, decay=config.lr_schedule,
        warmup_steps=int(round(config.warmup_epochs * steps_per_epoch)))
  if config.optimizer == "sgd":
    inner = keras.optimizers.SGD(rate, momentum=0.9)
  else:
    inner = keras.optimizers.Adam(rate)
  plain = (config.compressor == "none" and config.reduction == "sum"
           and config.optimizer_exchange in (None, "gradients")
           and config.local_clipnorm is None)
  if plain or config.exchange == "cross_device_ops":
    return inner
  return tf_adacomp.CompressedOptimizer(
      inner, make_compressor(config), start_step=config.start_step,
      reduction=config.reduction,
      # "gradient" is the flag's default: only "delta" says something --optimizer_exchange
      # does not.
      adasum_mode="delta" if config.adasum_mode == "delta" else None,
      exchange=config.optimizer_exchange, momentum_masking=config.momentum_masking,
      local_clipnorm=config.local_clipnorm)


# --- Input pipelines ----------------------------------------------------------------


def pipelines(data: Data, config: Config):
  """Batched, prefetched ``(train, test)``; under multi_worker, sharded across workers."""
  import tensorflow as tf

  options = tf.data.Options()
  # Data in memory or in a few files are sharded by example; an example whose data lie
  # in many files (ImageNet) says "AUTO" (by file) in Data.info["shard_policy"].
  policy = data.info.get("shard_policy", "DATA")
  options.experimental_distribute.auto_shard_policy = getattr(
      tf.data.experimental.AutoShardPolicy, policy)
  train = (data.train.repeat().batch(config.batch_size, drop_remainder=True)
           .prefetch(tf.data.AUTOTUNE).with_options(options))
  test = data.test.batch(config.batch_size).prefetch(tf.data.AUTOTUNE).with_options(options)
  return train, test


def split_size(info, split, dataset) -> int:
  """Examples in a tfds split: from its metadata, else by counting ``dataset``.

  (``tfds.testing.mock_data`` generates examples without split metadata.)
  """
  try:
    return info.splits[split].num_examples
  except KeyError:
    count = int(dataset.cardinality())
    return count if count >= 0 else int(dataset.reduce(0, lambda n, _: n + 1))


def synthetic_data(x_shape, num_classes, train_size, test_size, seed, x_dtype="float32",
                   y_shape=()):
  """Random inputs of ``x_shape`` and labels in ``[0, num_classes)`` (smoke runs)."""
  import numpy as np
  import tensorflow as tf

  rng = np.random.default_rng(seed)

  def split(size):
    if x_dtype == "int32":
      x = rng.integers(0, num_classes, (size, *x_shape), dtype=np.int32)
    else:
      x = rng.standard_normal((size, *x_shape)).astype(x_dtype)
    y = rng.integers(0, num_classes, (size, *y_shape), dtype=np.int32)
    return tf.data.Dataset.from_tensor_slices((x, y))

  return Data(split(train_size).shuffle(train_size, seed=seed), split(test_size),
              train_size, test_size)


# --- Training -----------------------------------------------------------------------


def train(example, config: Config, callbacks=()) -> Dict[str, Any]:
  """Trains ``example`` as ``config`` says; returns (and writes) the run's summary.

  Args:
    example: an example module (``NAME``, ``DEFAULTS``, ``load_data``, ``build_model``).
    config: from ``make_config`` or ``config_from_flags``.
    callbacks: more Keras callbacks for ``fit`` (e.g. a benchmark's step timer).

  Returns:
    The summary dict (see ``summarize``); also printed, and written to
    ``<model_dir>/summary.json`` by the chief when ``model_dir`` is set.
  """
  validate(config)
  start = time.perf_counter()
  strategy = make_strategy(config)  # first: logical devices need an untouched TensorFlow

  import keras
  import tf_adacomp

  keras.utils.set_random_seed(config.seed)
  data = example.load_data(config)
  train_data, test_data = pipelines(data, config)
  steps_per_epoch = config.steps_per_epoch or max(data.train_size // config.batch_size, 1)
  chief = is_chief(strategy)
  model_dir = config.model_dir
  if model_dir and not chief:  # every worker writes checkpoints; only the chief keeps them
    model_dir = os.path.join(model_dir, "workers", str(strategy.cluster_resolver.task_id))

  with strategy.scope():
    model = example.build_model(config, data)
    model.compile(optimizer=make_optimizer(config, steps_per_epoch),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

  stats = tf_adacomp.CompressionStats(
      log_dir=os.path.join(model_dir, "logs", "compression") if model_dir else None)
  # An example may train with callbacks of its own (e.g. ResIST's rounds).
  own = list(example.callbacks(config)) if hasattr(example, "callbacks") else []
  callbacks = list(callbacks) + own + ([stats] if config.compressor != "none" else [])
  if model_dir:
    callbacks += [
        # Weights, optimizer state and residues, every epoch; a rerun resumes from them.
        keras.callbacks.BackupAndRestore(os.path.join(model_dir, "checkpoint"),
                                         delete_checkpoint=False),
        keras.callbacks.TensorBoard(os.path.join(model_dir, "logs"))]

  fit_start = time.perf_counter()
  model.fit(train_data, epochs=config.epochs, steps_per_epoch=steps_per_epoch,
            shuffle=False,  # the pipelines shuffle
            callbacks=callbacks, verbose=config.verbose if chief else 0)
  train_seconds = time.perf_counter() - fit_start
  test_loss, test_accuracy = model.evaluate(test_data, steps=config.eval_steps, verbose=0)
  steps = int(model.optimizer.iterations.numpy())  # resumed runs count their earlier steps

  summary = summarize(example, config, model, strategy,
                      stats.totals() if config.compressor != "none" else None)
  if config.compressor != "none":  # what each layer weight got, per step of this fit
    summary["variables"] = {
        name: {"kind": v["kind"], "shape": v["shape"],
               "dense_bytes_per_step": v["dense_bytes"] / v["steps"],
               "sent_bytes_per_step": v["sent_bytes"] / v["steps"], "ratio": v["ratio"]}
        for name, v in stats.variable_totals().items()}
  summary.update(test_accuracy=float(test_accuracy), test_loss=float(test_loss),
                 steps=steps, steps_per_epoch=steps_per_epoch,
                 train_seconds=train_seconds, wall_seconds=time.perf_counter() - start,
                 config=dataclasses.asdict(config))  # every setting, to reproduce the run
  for callback in own:  # what an example's callbacks measured (e.g. bytes per round)
    if hasattr(callback, "summary"):
      summary.update(callback.summary())
  if chief:
    print(format_summary(summary))
    if model_dir:
      os.makedirs(model_dir, exist_ok=True)
      with open(os.path.join(model_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
  return summary


def summarize(example, config, model, strategy, totals):
  """The run's settings and bytes per step: measured totals, or dense for "none"."""
  import tf_adacomp
  from tf_adacomp import stats

  # The library's own accounting: each variable's kind and float32 bytes, from its plan.
  baseline = tf_adacomp.NoCompression()
  plans = [baseline.plan(v.shape, v.dtype, v.path) for v in model.trainable_variables
           if v.dtype in ("float16", "bfloat16", "float32", "float64")]
  dense = {kind: entry["dense_bytes"]
           for kind, entry in stats.summarize((p, p.dense_nbytes) for p in plans).items()}
  compression = {}
  for kind, dense_bytes in dense.items():
    if totals and kind in totals and totals[kind]["steps"]:
      entry = totals[kind]
      sent = entry["sent_bytes"] / entry["steps"]
    else:  # dense all-reduce (or nothing measured): float32 gradients
      sent = float(dense_bytes)
    compression[kind] = {"dense_bytes_per_step": float(dense_bytes),
                         "sent_bytes_per_step": sent,
                         "ratio": dense_bytes / sent if sent else math.nan}
  return {
      "example": example.NAME, "compressor": config.compressor, "exchange": config.exchange,
      "strategy": config.strategy, "replicas": strategy.num_replicas_in_sync,
      "epochs": config.epochs, "batch_size": config.batch_size,
      "learning_rate": config.learning_rate, "synthetic": config.synthetic,
      "parameters": int(sum(math.prod(v.shape) for v in model.trainable_variables)),
      "compression": compression,
      "bytes_sent_per_step": compression["total"]["sent_bytes_per_step"],
      "dense_bytes_per_step": compression["total"]["dense_bytes_per_step"],
      "compression_ratio": compression["total"]["ratio"],
  }


KIND_ORDER = ("conv", "dense", "recurrent", "vector")


def _rows(summaries):
  """``(label, [cell per summary])`` rows of the summary table."""
  kinds = [k for k in KIND_ORDER if any(k in s["compression"] for s in summaries)]

  def ratio(s, kind):
    entry = s["compression"].get(kind)
    return f"{entry['ratio']:.1f}x" if entry else "-"

  rows = [("compressor", [s["compressor"] for s in summaries]),
          ("replicas", [f"{s['replicas']} ({s['strategy']})" for s in summaries]),
          ("steps x global batch", [f"{s['steps']} x {s['batch_size']}" for s in summaries]),
          ("test accuracy", [f"{s['test_accuracy']:.4f}" for s in summaries]),
          ("bytes sent / replica / step", [f"{s['bytes_sent_per_step']:,.0f}" for s in summaries]),
          ("dense float32 bytes / step", [f"{s['dense_bytes_per_step']:,.0f}" for s in summaries]),
          ("compression ratio, all", [ratio(s, "total") for s in summaries])]
  rows += [(f"  {kind} layers", [ratio(s, kind) for s in summaries]) for kind in kinds]
  rows += [("train time (s)", [f"{s['train_seconds']:.1f}" for s in summaries]),
           ("wall time (s)", [f"{s['wall_seconds']:.1f}" for s in summaries])]
  return rows


def format_summary(*summaries) -> str:
  """One column per run: accuracy, bytes per step, compression per kind, time."""
  title = f"== {summaries[0]['example']}" + (" (synthetic data)" if summaries[0]["synthetic"]
                                              else "") + " =="
  lines = [title]
  for label, cells in _rows(summaries):
    lines.append(f"{label:<30}" + "".join(f"{cell:>20}" for cell in cells))
  return "\n".join(lines)


def plot_summaries(summaries, path) -> str:
  """Draws the runs side by side (test accuracy; bytes per step, log scale) to ``path``.

  Args:
    summaries: summary dicts (see ``train``), one bar each.
    path: the PNG to write.

  Returns:
    ``path``.

  Raises:
    ImportError: matplotlib is not installed (it comes with the ``[examples]`` extra).
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top

  names = [s["compressor"] for s in summaries]
  figure, (accuracy, sent) = pyplot.subplots(1, 2, figsize=(9, 3.6))
  bars = accuracy.bar(names, [s["test_accuracy"] for s in summaries], color="tab:blue")
  accuracy.bar_label(bars, fmt="%.4f")
  accuracy.set_ylim(0, 1.05)
  accuracy.set_title("test accuracy")
  bars = sent.bar(names, [s["bytes_sent_per_step"] for s in summaries], color="tab:orange")
  sent.bar_label(bars, labels=[f"{s['bytes_sent_per_step']:,.0f}" for s in summaries])
  sent.axhline(summaries[0]["dense_bytes_per_step"], color="gray", linestyle="--",
               label="dense float32")
  sent.set_yscale("log")
  smallest = min(s["bytes_sent_per_step"] for s in summaries)
  sent.set_ylim(max(smallest, 1) / 10, summaries[0]["dense_bytes_per_step"] * 10)
  sent.set_title("bytes sent per replica per step")
  sent.legend(loc="upper left")
  figure.suptitle(f"{summaries[0]['example']}: {summaries[0]['replicas']} replicas, "
                  f"{summaries[0]['steps']} steps")
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  pyplot.close(figure)
  return path


def run(example, argv):
  """The examples' absl ``main``: train from flags; an error in a flag exits with it."""
  if len(argv) > 1:
    raise SystemExit(f"Unexpected arguments: {argv[1:]}. Flags are --name=value.")
  try:
    config = config_from_flags(example)
  except ValueError as error:
    raise SystemExit(f"{example.NAME}: {error}") from None
  quiet_tensorflow_logs()
  train(example, config)


def quiet_tensorflow_logs():
  """Hides TensorFlow's INFO lines (one per collective), which absl would print."""
  import logging
  logging.getLogger("tensorflow").setLevel(logging.WARNING)
