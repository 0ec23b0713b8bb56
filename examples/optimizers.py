"""The compressor and the optimizer of a run: ``tf_adacomp`` objects built from its ``Config``.

``config`` arguments are ``flags_and_config.Config`` instances (that module is not
imported here: its ``validate`` calls ``make_compressor``).
"""

import keras

import tf_adacomp

# --optimizer=adamw: the weight decay when --weight_decay is unset, and the variables it
# spares (as GPT's training does): biases, LayerNorm's (and BatchNorm's) scales and
# offsets, embeddings. Keras matches these in each variable's own name ("bias",
# "gamma", ...).
ADAMW_WEIGHT_DECAY = 0.01
NO_WEIGHT_DECAY = ("bias", "gamma", "beta", "embeddings")


def make_compressor(config):
  """The ``tf_adacomp`` compressor the flags describe."""
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


def make_optimizer(config, steps_per_epoch: int):
  """The inner Keras optimizer, wrapped in a ``CompressedOptimizer`` when compressing."""
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
  elif config.optimizer == "adamw":
    decay = ADAMW_WEIGHT_DECAY if config.weight_decay is None else config.weight_decay
    inner = keras.optimizers.AdamW(rate, weight_decay=decay)
    inner.exclude_from_weight_decay(var_names=list(NO_WEIGHT_DECAY))
  else:
    inner = keras.optimizers.Adam(rate)
  plain = (config.compressor == "none" and config.reduction == "sum"
           and config.optimizer_exchange in (None, "gradients")
           and config.local_clipnorm is None and config.second_moment is None
           and config.optimizer_local_steps is None and config.outer_optimizer is None
           and not config.dense_when_faster)
  if plain or config.exchange == "cross_device_ops":
    return inner
  return tf_adacomp.CompressedOptimizer(
      inner, make_compressor(config), start_step=config.start_step,
      reduction=config.reduction,
      # "gradient" is the flag's default: only "delta" says something --optimizer_exchange
      # does not.
      adasum_mode="delta" if config.adasum_mode == "delta" else None,
      exchange=config.optimizer_exchange, momentum_masking=config.momentum_masking,
      local_clipnorm=config.local_clipnorm, second_moment=config.second_moment,
      local_steps=config.optimizer_local_steps or 1,
      outer_optimizer=_outer_optimizer(config),
      dense_when_faster=config.dense_when_faster)


def _outer_optimizer(config):
  """--outer_optimizer as CompressedOptimizer takes it (None: the library's default)."""
  if config.outer_optimizer == "nesterov":
    return tf_adacomp.local_steps.diloco()
  return config.outer_optimizer
