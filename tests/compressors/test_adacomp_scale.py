"""AdaComp(scale="bin") through the compressor contract: config, bytes, error feedback.

(The kernels' mathematics are checked exactly against NumPy in tests/ops/test_adacomp.py;
training with it under MirroredStrategy runs in tests/benchmarks/test_convergence.py.)"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp.ops import adacomp as adacomp_ops


def test_default_is_tensor_and_its_config_is_unchanged():
  compressor = tf_adacomp.AdaComp()
  assert compressor.scale == "tensor" and "scale" not in compressor.get_config()
  assert tf_adacomp.AdaComp(scale="tensor") == compressor


def test_config_round_trips():
  compressor = tf_adacomp.get_compressor("adacomp", scale="bin", dense_bin_size=100)
  assert compressor.get_config()["scale"] == "bin"
  config = json.loads(json.dumps(tf_adacomp.serialize_compressor(compressor)))
  assert tf_adacomp.get_compressor(config) == compressor
  assert tf_adacomp.AdaComp.from_config(compressor.get_config()) == compressor
  restored = keras.saving.deserialize_keras_object(
      keras.saving.serialize_keras_object(compressor))
  assert restored == compressor and restored.scale == "bin"
  assert restored != tf_adacomp.AdaComp(dense_bin_size=100)


@pytest.mark.parametrize("bad", ["row", "Bin", "", None, 2])
def test_bad_scale_is_named(bad):
  with pytest.raises(ValueError, match=f"`scale` must be one of .*Received: scale={bad!r}"):
    tf_adacomp.AdaComp(scale=bad)


def test_error_feedback_loses_nothing_and_scales_are_counted():
  # fuse=False: a tensor's payload in the per-tensor format (ops.adacomp) counted below.
  compressor = tf_adacomp.AdaComp(scale="bin", max_density=1.0, fuse=False)
  plan = compressor.plan([40, 30], tf.float32, "dense/kernel")
  bins = -(-1200 // plan.bin_size)
  assert compressor.width([plan]) == (adacomp_ops.payload_words(1200, 1.0)
                                            + 1 + -(-bins // 2))
  state = compressor.init(plan)
  rng = np.random.default_rng(0)
  sent = np.zeros([40, 30], np.float64)
  total = np.zeros([40, 30], np.float64)
  for _ in range(5):
    grad = rng.standard_normal([40, 30]).astype(np.float32)
    total += grad
    payload, (state,) = compressor.compress([grad], [state], [plan])
    assert payload.shape == [compressor.width([plan])]
    count = int(payload[0])
    bits = adacomp_ops.index_bits(1200) + 1
    assert int(compressor.nbytes(payload, [plan])[0]) == 4 * (
        4 + -(-bins // 2) + -(-count * bits // 32))
    sent += compressor.decompress(payload, [plan])[0].numpy()
  np.testing.assert_allclose(sent + state[0].numpy(), total, atol=1e-4)
  assert np.count_nonzero(sent) < sent.size
