"""The ResIST example: ResIST, local SGD or data-parallel on one ResNet, bytes per round."""

import numpy as np
import pytest

import example_runs
import tf_adacomp
from tf_adacomp import resist
from tf_adacomp.examples import cifar10_resist
from tf_adacomp.examples import cifar10_resnet
from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import training


@pytest.mark.slow
def test_trains_with_resist_and_reports_bytes_per_round(tmp_path):
  config = example_runs.small_config(cifar10_resist, tmp_path, synthetic=True, depth=14,
                                     width=4, local_steps=2)
  summary = training.train(cifar10_resist, config)
  example_runs.check_summary(summary, tmp_path, kinds=())
  figures = summary["resist"]
  assert summary["method"] == "resist" and figures["rounds"] == 2  # 2 steps, then 1
  assert summary["bytes_per_round"] == figures["bytes_per_round"]
  assert summary["bytes_sent_per_step"] == pytest.approx(figures["bytes_per_round"] / 2)
  assert figures["bytes_per_round"] < figures["local_sgd_bytes_per_round"]
  assert figures["data_parallel_bytes_per_step"] == 4 * summary["parameters"]
  assert summary["compression_ratio"] == pytest.approx(
      figures["data_parallel_bytes_per_step"] / summary["bytes_sent_per_step"])


def test_data_parallel_reports_the_references_on_the_same_model():
  config = flags_and_config.make_config(cifar10_resist, method="data_parallel", local_steps=10,
                                        compressor="adacomp")  # compression: data-parallel only
  (callback,) = cifar10_resist.callbacks(config)
  with tf_adacomp.distribute.mirrored_strategy(devices=["/cpu:0", "/cpu:1"]).scope():
    model = resist.resnet(14, width=4)
  callback.set_model(model)
  summary = callback.summary()
  assert summary["method"] == "data_parallel"
  assert summary["bytes_per_round"] == 10 * 4 * sum(
      int(np.prod(v.shape)) for v in model.trainable_weights)
  assert summary["resist"]["resist_bytes_per_round"] < summary["resist"][
      "local_sgd_bytes_per_round"]
  assert cifar10_resist.load_data is cifar10_resnet.load_data  # the same data


@pytest.mark.parametrize("overrides,match", [
    ({"method": "gossip"}, "method='gossip'"),
    ({"compressor": "adacomp"}, "compressor='adacomp'"),
    ({"reduction": "adasum"}, "reduction='adasum'"),
    ({"local_steps": 0}, "local_steps=0"),
    ({"min_blocks": -1}, "min_blocks=-1"),
])
def test_bad_settings_are_named(overrides, match):
  config = flags_and_config.make_config(cifar10_resist, **overrides)
  with pytest.raises(ValueError, match=match):
    cifar10_resist.callbacks(config)
