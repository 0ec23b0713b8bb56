"""The examples' --optimizer_exchange, --momentum_masking, --local_clipnorm,
--optimizer_local_steps, --outer_optimizer and --dense_when_faster flags."""

import pytest

import tf_adacomp
from tf_adacomp.examples import fashion_mnist
from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import optimizers


def test_the_flags_reach_the_optimizer():
  config = flags_and_config.make_config(fashion_mnist, optimizer_exchange="updates",
                                        momentum_masking=True, local_clipnorm=5.0)
  optimizer = optimizers.make_optimizer(config, steps_per_epoch=10)
  assert (optimizer.exchange, optimizer.momentum_masking, optimizer.local_clipnorm) == (
      "updates", True, 5.0)
  # No compression, but local optimizer steps: still the wrapper.
  config = flags_and_config.make_config(fashion_mnist, compressor="none",
                                        optimizer_exchange="updates")
  assert isinstance(optimizers.make_optimizer(config, 10), tf_adacomp.CompressedOptimizer)
  config = flags_and_config.make_config(fashion_mnist, reduction="adasum", adasum_mode="delta")
  assert optimizers.make_optimizer(config, 10).exchange == "updates"
  # The default exchange (updates, with --reduction=sum):
  config = flags_and_config.make_config(fashion_mnist, momentum_masking=True)
  assert optimizers.make_optimizer(config, 10).exchange == "updates"


def test_the_local_steps_flags_reach_the_optimizer():
  import keras
  config = flags_and_config.make_config(fashion_mnist, optimizer_local_steps=8,
                                        outer_optimizer="nesterov")
  optimizer = optimizers.make_optimizer(config, steps_per_epoch=10)
  assert optimizer.local_steps == 8 and isinstance(optimizer.outer_optimizer,
                                                   keras.optimizers.SGD)
  assert optimizer.outer_optimizer.nesterov
  config = flags_and_config.make_config(fashion_mnist, compressor="none", optimizer_local_steps=4,
                                        outer_optimizer="average")
  optimizer = optimizers.make_optimizer(config, steps_per_epoch=10)  # DiLoCo-style, dense
  assert (optimizer.local_steps, optimizer.outer_optimizer) == (4, "average")


def test_dense_when_faster_reaches_the_optimizer_even_without_compression():
  config = flags_and_config.make_config(fashion_mnist, dense_when_faster=True)
  assert optimizers.make_optimizer(config, 10).dense_when_faster is True
  config = flags_and_config.make_config(fashion_mnist, compressor="none",
                                        dense_when_faster=True)
  assert optimizers.make_optimizer(config, 10).dense_when_faster is True
  config = flags_and_config.make_config(fashion_mnist)
  assert optimizers.make_optimizer(config, 10).dense_when_faster is False


@pytest.mark.parametrize("overrides,match", [
    ({"optimizer_local_steps": 0}, "optimizer_local_steps=0"),
    ({"outer_optimizer": "adam"}, "outer_optimizer='adam'"),
    ({"optimizer_local_steps": 4, "exchange": "cross_device_ops"}, "optimizer_local_steps=4"),
    ({"optimizer_exchange": "deltas"}, "optimizer_exchange='deltas'"),
    ({"optimizer_exchange": "gradients", "adasum_mode": "delta", "reduction": "adasum"},
     "optimizer_exchange='gradients'"),
    ({"optimizer_exchange": "updates", "exchange": "cross_device_ops"},
     "optimizer_exchange='updates'"),
    ({"momentum_masking": True, "optimizer_exchange": "gradients"}, "momentum_masking=True"),
    ({"momentum_masking": True, "reduction": "adasum"}, "momentum_masking=True"),
    ({"local_clipnorm": -1.0}, "local_clipnorm=-1.0"),
    ({"local_clipnorm": 1.0, "exchange": "cross_device_ops"}, "local_clipnorm=1.0"),
    ({"dense_when_faster": True, "exchange": "cross_device_ops"}, "dense_when_faster=True"),
    ({"dense_when_faster": "yes"}, "dense_when_faster='yes'"),
])
def test_bad_settings_are_named_with_the_value(overrides, match):
  with pytest.raises(ValueError, match=match):
    flags_and_config.make_config(fashion_mnist, **overrides)
