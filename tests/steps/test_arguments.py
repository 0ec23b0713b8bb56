"""tf_adacomp/steps/arguments.py: the defaults ``CompressedOptimizer`` resolves."""

import keras
import pytest

import tf_adacomp


@pytest.mark.parametrize("inner,options,bins", [
    # An Adam or AdamW inside rounds, dividing by its estimate (the default): bins of 150.
    ("adam", dict(local_steps=8), 150),
    ("adamw", dict(local_steps=2, compressor="AdaComp"), 150),
    ("adam", dict(local_steps=8, second_moment="global"), 150),
    # Anything else keeps AdaComp's own 500.
    ("adam", dict(), 500),
    ("adam", dict(local_steps=8, second_moment="local"), 500),
    ("sgd", dict(local_steps=8), 500),
    # A compressor given as an instance or a config is the user's.
    ("adam", dict(local_steps=8, compressor=tf_adacomp.AdaComp()), 500),
    ("adam", dict(local_steps=8, compressor=tf_adacomp.serialize_compressor(
        tf_adacomp.AdaComp())), 500),
])
def test_adam_inside_rounds_takes_adacomp_with_smaller_bins(inner, options, bins):
  optimizer = {"adam": keras.optimizers.Adam, "adamw": keras.optimizers.AdamW,
               "sgd": keras.optimizers.SGD}[inner]()
  wrapper = tf_adacomp.CompressedOptimizer(optimizer, **options)
  assert (wrapper.compressor.dense_bin_size, wrapper.compressor.recurrent_bin_size) == (
      bins, bins)
  assert wrapper.compressor.conv_bin_size == 50  # convolutions' bins as they were
  # The config keeps the compressor it resolved to.
  again = tf_adacomp.CompressedOptimizer.from_config(wrapper.get_config())
  assert again.compressor.dense_bin_size == bins
