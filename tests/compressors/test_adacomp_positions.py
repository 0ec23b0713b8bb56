"""AdaComp's positions (positions="elias_fano", the default with buckets, "bin" or
"tensor") through the compressor contract: defaults, config, errors, and the same values
in fewer bytes.

(The bucket kernels' formats are checked against the NumPy reference in
tests/ops/test_adacomp_bucket.py.)"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp


def test_the_default_is_elias_fano_with_buckets_and_tensor_without_and_configs_are_unchanged():
  assert tf_adacomp.AdaComp().positions == "elias_fano"
  assert tf_adacomp.AdaComp(fuse=False).positions == "tensor"
  # A config saved before the option existed loads as the default it names nothing of.
  for compressor in (tf_adacomp.AdaComp(), tf_adacomp.AdaComp(fuse=False)):
    assert "positions" not in compressor.get_config()
  assert tf_adacomp.AdaComp(positions="elias_fano") == tf_adacomp.AdaComp()
  assert tf_adacomp.AdaComp(positions="bin") != tf_adacomp.AdaComp()


@pytest.mark.parametrize("positions", ["tensor", "bin"])
def test_positions_other_than_the_default_round_trip_through_configs(positions):
  compressor = tf_adacomp.get_compressor("adacomp", positions=positions, dense_bin_size=100)
  assert compressor.get_config()["positions"] == positions
  config = json.loads(json.dumps(tf_adacomp.serialize_compressor(compressor)))
  assert tf_adacomp.get_compressor(config) == compressor
  restored = keras.saving.deserialize_keras_object(
      keras.saving.serialize_keras_object(compressor))
  assert restored == compressor and restored.positions == positions
  assert restored != tf_adacomp.AdaComp(dense_bin_size=100)


@pytest.mark.parametrize("bad", ["bins", "Tensor", "", 2])
def test_a_bad_positions_is_named(bad):
  with pytest.raises(ValueError, match=f"`positions` must be one of .*Received: positions={bad!r}"):
    tf_adacomp.AdaComp(positions=bad)


@pytest.mark.parametrize("positions", ["bin", "elias_fano"])
def test_a_bucket_format_without_buckets_is_refused_naming_both(positions):
  with pytest.raises(ValueError, match=f"positions='{positions}', fuse=False"):
    tf_adacomp.AdaComp(positions=positions, fuse=False)


def test_the_same_values_and_residues_in_fewer_bytes():
  # A convolution and a dense layer, several steps of error feedback: the formats send
  # exactly the same values and keep the same residues; positions in bins cost less at
  # AdaComp's bin sizes (a few codes per bin of 50 or 500), Elias-Fano codes less still.
  rng = np.random.default_rng(0)
  shapes = {"conv/kernel": [3, 3, 32, 32], "dense/kernel": [256, 64], "dense/bias": [64]}
  sent = {}
  for positions in ("tensor", "bin", "elias_fano"):
    compressor = tf_adacomp.AdaComp(positions=positions)
    plans = [compressor.plan(shape, tf.float32, name) for name, shape in shapes.items()]
    buckets = compressor.buckets(plans)
    states = [compressor.init(plan) for plan in plans]
    rng = np.random.default_rng(0)
    values, nbytes = [], 0
    for _ in range(3):
      grads = [rng.standard_normal(shape).astype(np.float32) for shape in shapes.values()]
      for bucket in buckets:
        payload, new = compressor.compress([grads[i] for i in bucket],
                                           [states[i] for i in bucket],
                                           [plans[i] for i in bucket])
        for i, state in zip(bucket, new):
          states[i] = state
        nbytes += int(tf.reduce_sum(compressor.nbytes(payload, [plans[i] for i in bucket])))
        values += [x.numpy() for x in compressor.decompress(payload, [plans[i] for i in bucket])]
    sent[positions] = (values, [s[0].numpy() for s in states], nbytes)
  for positions in ("bin", "elias_fano"):
    for got, want in zip(sent[positions][0] + sent[positions][1],
                         sent["tensor"][0] + sent["tensor"][1]):
      np.testing.assert_array_equal(got, want)
  assert sent["elias_fano"][2] < sent["bin"][2] < sent["tensor"][2]
