"""The examples' shared modules: settings, their checks, the optimizer, the strategy, the
training run and the summary."""

import json
import math

import pytest

import example_runs
import tf_adacomp
from tf_adacomp.examples import distribution
from tf_adacomp.examples import fashion_mnist
from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import optimizers
from tf_adacomp.examples import report
from tf_adacomp.examples import shakespeare_lstm
from tf_adacomp.examples import training


def test_example_defaults_then_overrides():
  config = flags_and_config.make_config(shakespeare_lstm, batch_size=32, lstm_units=16,
                                        epochs=None)
  assert config.optimizer == "adam" and config.epochs == 10  # example defaults
  assert config.batch_size == 32 and config.options["lstm_units"] == 16
  assert config.options["seq_length"] == 100 and config.max_density == 0.25


@pytest.mark.parametrize("overrides,match", [
    ({"strategy": "parameter_server"}, "strategy='parameter_server'"),
    ({"replicas": 0}, "replicas=0"),
    ({"epochs": 0}, "epochs=0"),
    ({"batch_size": 10, "replicas": 4}, "batch_size=10"),
    ({"learning_rate": -0.1}, "learning_rate=-0.1"),
    ({"learning_rate": math.inf}, "learning_rate=inf"),
    ({"steps_per_epoch": 0}, "steps_per_epoch=0"),
    ({"warmup_epochs": 3.0, "epochs": 2}, "warmup_epochs=3.0"),
    ({"strategy": "one_device", "replicas": 2}, "replicas=2"),
    ({"exchange": "cross_device_ops", "strategy": "one_device"}, "strategy='one_device'"),
    ({"lr_schedule": "poly"}, "lr_schedule='poly'"),
    ({"optimizer": "lamb"}, "optimizer='lamb'"),
    ({"weight_decay": 0.1}, "weight_decay=0.1"),  # with SGD: nothing would read it
    ({"optimizer": "adamw", "weight_decay": -0.01}, "weight_decay=-0.01"),
    ({"optimizer": "adamw", "weight_decay": math.nan}, "weight_decay=nan"),
    ({"lr_schedule": "legw", "base_batch_size": 0}, "base_batch_size=0"),
    ({"base_batch_size": 64}, "base_batch_size=64"),  # with cosine: nothing would read it
    # legw: 1 base epoch x k=8 = 8 epochs of warm-up > 2
    ({"lr_schedule": "legw", "base_batch_size": 16, "warmup_epochs": 1.0}, "warmup_epochs=1.0"),
    ({"depth": 20}, "depth=20"),  # another example's option
    ({"compressor": "zip"}, "compressor='zip'"),
    ({"conv_bin_size": 0}, "conv_bin_size=0"),
    ({"compressor": "topk", "topk_density": 1.5}, "density=1.5"),
    ({"reduction": "mean"}, "reduction='mean'"),
    ({"adasum_mode": "deltas"}, "adasum_mode='deltas'"),
    ({"adasum_mode": "delta"}, "adasum_mode='delta'"),  # needs --reduction=adasum
    ({"adasum_mode": "delta", "reduction": "adasum", "exchange": "cross_device_ops"},
     "adasum_mode='delta'"),
    ({"second_moment": "mean"}, "second_moment='mean'"),
    ({"second_moment": "shared", "exchange": "cross_device_ops"}, "second_moment='shared'"),
])
def test_bad_settings_are_named_with_the_value(overrides, match):
  with pytest.raises(ValueError, match=match):
    flags_and_config.make_config(fashion_mnist, **overrides)


def test_legw_schedule_scales_the_base_rate_and_warmup():
  """--learning_rate and --warmup_epochs are the base batch's; k = 1024/128 = 8."""
  import keras
  config = flags_and_config.make_config(fashion_mnist, lr_schedule="legw",
                                        base_batch_size=128, batch_size=1024,
                                        warmup_epochs=0.25, compressor="none")
  assert config.learning_rate == 0.05 and config.epochs == 2  # the example's defaults
  optimizer = optimizers.make_optimizer(config, steps_per_epoch=58)  # 60,000 // 1024
  rate = keras.saving.deserialize_keras_object(optimizer.get_config()["learning_rate"])
  assert isinstance(rate, tf_adacomp.schedules.LEGW)
  assert rate.peak_learning_rate == pytest.approx(math.sqrt(8) * 0.05)
  assert rate.warmup_steps == round(8 * 0.25 * 58) and rate.total_steps == 2 * 58
  # Without --base_batch_size, k = 1: the flags' own values.
  plain = optimizers.make_optimizer(flags_and_config.make_config(
      fashion_mnist, lr_schedule="legw", warmup_epochs=0.5, compressor="none"), 10)
  rate = keras.saving.deserialize_keras_object(plain.get_config()["learning_rate"])
  assert (rate.peak_learning_rate, rate.warmup_steps) == (pytest.approx(0.05), 5)


def test_adasum_flags_reach_the_optimizer_and_the_cross_device_ops():
  config = flags_and_config.make_config(fashion_mnist, compressor="none", reduction="adasum",
                                        adasum_mode="delta")
  optimizer = optimizers.make_optimizer(config, steps_per_epoch=10)
  assert isinstance(optimizer, tf_adacomp.CompressedOptimizer)  # even without compression
  assert (optimizer.reduction, optimizer.adasum_mode) == ("adasum", "delta")
  config = flags_and_config.make_config(fashion_mnist, reduction="adasum",
                                        exchange="cross_device_ops", replicas=2)
  strategy = distribution.make_strategy(config)
  assert strategy.extended._cross_device_ops.reduction == "adasum"  # pylint: disable=protected-access
  assert not isinstance(optimizers.make_optimizer(config, 10), tf_adacomp.CompressedOptimizer)


@pytest.mark.parametrize("name,kind", [("sgd", "SGD"), ("adam", "Adam"),
                                       ("adamw", "AdamW")])
def test_the_optimizer_flag_picks_the_inner_optimizer(name, kind):
  import keras
  for compressor in ("none", "adacomp"):  # the optimizer itself, or in the wrapper
    optimizer = optimizers.make_optimizer(flags_and_config.make_config(
        fashion_mnist, optimizer=name, compressor=compressor), steps_per_epoch=10)
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    assert type(inner) is getattr(keras.optimizers, kind)  # pylint: disable=unidiomatic-typecheck
  assert (inner.weight_decay is None) == (name != "adamw")


def test_the_second_moment_flag_reaches_the_optimizer():
  default = tf_adacomp.optimizer.DEFAULT_SECOND_MOMENT
  for flag, expected in ((None, default), ("local", "local"), ("shared", "shared")):
    config = flags_and_config.make_config(fashion_mnist, optimizer="adamw",
                                          second_moment=flag)
    optimizer = optimizers.make_optimizer(config, steps_per_epoch=10)
    assert optimizer.second_moment == expected, flag
  config = flags_and_config.make_config(fashion_mnist, optimizer="sgd", second_moment="shared")
  with pytest.raises(ValueError, match="second_moment='shared'"):
    optimizers.make_optimizer(config, steps_per_epoch=10)


def test_adamw_decays_kernels_only_and_takes_the_weight_decay_flag():
  import keras
  config = flags_and_config.make_config(fashion_mnist, optimizer="adamw", compressor="none")
  assert optimizers.make_optimizer(config, 10).weight_decay == optimizers.ADAMW_WEIGHT_DECAY
  config = flags_and_config.make_config(fashion_mnist, optimizer="adamw", weight_decay=0.05)
  optimizer = optimizers.make_optimizer(config, 10)
  assert optimizer.weight_decay == 0.05  # read through the CompressedOptimizer
  model = keras.Sequential([keras.Input([3], dtype="int32"), keras.layers.Embedding(5, 4),
                            keras.layers.LayerNormalization(), keras.layers.Dense(2)])
  decayed = [v.name for v in model.trainable_variables
             if optimizer.inner_optimizer._use_weight_decay(v)]  # pylint: disable=protected-access
  assert decayed == ["kernel"]  # not embeddings, gamma, beta or bias


def test_compressor_options_reach_the_compressor():
  config = flags_and_config.make_config(fashion_mnist, conv_bin_size=25, max_density=0.5)
  compressor = optimizers.make_compressor(config)
  assert (compressor.conv_bin_size, compressor.max_density) == (25, 0.5)
  topk = optimizers.make_compressor(flags_and_config.make_config(
      fashion_mnist, compressor="topk", topk_density=0.05))
  assert topk.density == 0.05


@pytest.mark.slow
def test_cross_device_ops_exchange_trains_and_is_measured(tmp_path):
  """--exchange=cross_device_ops: CompressedAllReduce in the strategy, plain optimizer."""
  config = example_runs.small_config(fashion_mnist, tmp_path, synthetic=True,
                                     compressor="topk", exchange="cross_device_ops")
  summary = training.train(fashion_mnist, config)
  example_runs.check_summary(summary, tmp_path, kinds=("conv", "dense"))
  assert summary["compression"]["dense"]["ratio"] > 10


@pytest.mark.slow
def test_a_rerun_resumes_from_the_model_dir(tmp_path):
  """Weights, optimizer state and residues come back; training continues, not restarts.

  One replica (each run compiles its step once): restoring residues across replicas is
  tested in tests/test_optimizer_restore.py."""
  first = example_runs.small_config(fashion_mnist, tmp_path, synthetic=True,
                                    compressor="topk", replicas=1, eval_steps=1)
  training.train(fashion_mnist, first)
  again = example_runs.small_config(fashion_mnist, tmp_path, synthetic=True,
                                    compressor="topk", replicas=1, eval_steps=1, epochs=2)
  summary = training.train(fashion_mnist, again)
  assert summary["steps"] == 6  # 3 restored + 3 new
  assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 6


def test_format_summary_puts_runs_side_by_side():
  def fake(compressor, ratio):
    entry = {"dense_bytes_per_step": 400.0, "sent_bytes_per_step": 400.0 / ratio,
             "ratio": ratio}
    return {"example": "x", "synthetic": False, "compressor": compressor, "replicas": 4,
            "strategy": "mirrored", "steps": 10, "batch_size": 8, "test_accuracy": 0.5,
            "bytes_sent_per_step": 400.0 / ratio, "dense_bytes_per_step": 400.0,
            "compression": {"total": entry, "conv": entry}, "train_seconds": 1.0,
            "wall_seconds": 2.0}
  text = report.format_summary(fake("adacomp", 100.0), fake("none", 1.0))
  row = next(line for line in text.splitlines() if line.startswith("  conv layers"))
  assert row.split()[-2:] == ["100.0x", "1.0x"]
  assert "dense float32 bytes / step" in text


def test_the_train_clock_times_training_not_what_follows_fit():
  # fit returned seconds after the last step while TensorFlow destroyed the input
  # iterator; the clock stops at on_train_end, and a callback after it is not timed.
  import time  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  class SlowEnd(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
      time.sleep(1.0)

  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  model.compile(optimizer="sgd", loss="mse")
  clock = training._TrainClock()  # pylint: disable=protected-access
  start = time.perf_counter()
  model.fit(np.zeros((4, 2)), np.zeros((4, 1)), epochs=1, verbose=0,
            callbacks=[clock, SlowEnd()])
  around = time.perf_counter() - start
  assert 0 < clock.seconds < around - 0.9
