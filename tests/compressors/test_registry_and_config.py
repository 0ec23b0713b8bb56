"""The compressor contract: registry, plans, configs and bad arguments."""

import inspect
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp.compressors import base
from tf_adacomp.compressors import registry

ALL = ["adacomp", "bf16", "fft", "fp16", "none", "sign", "topk"]


def test_registry_lists_every_compressor():
  assert tf_adacomp.available_compressors() == ALL


# Every argument away from its default: a default compressor round-trips even through a
# config that drops an argument (the default comes back), and == compares configs.
NON_DEFAULT = {
    "adacomp": dict(conv_bin_size=64, dense_bin_size=1000, recurrent_bin_size=250,
                    bin_sizes={"^head/": 7}, max_density=0.5, min_size=100, scale="bin",
                    fuse=False),
    "bf16": dict(min_size=100),
    "fft": dict(theta=0.8, final_theta=0.5, theta_decay_steps=100, exponent_bits=5,
                mantissa_bits=2, min_size=100),
    "fp16": dict(min_size=100),
    "none": dict(min_size=100),
    "sign": dict(stride=3, block=64, min_size=100),
    "topk": dict(density=0.05, min_size=100),
}


def _assert_restored(restored, name):
  kwargs = NON_DEFAULT[name]
  assert {k: getattr(restored, k) for k in kwargs} == kwargs
  assert restored == tf_adacomp.get_compressor(name, **kwargs)
  assert restored != tf_adacomp.get_compressor(name)


def test_every_compressor_has_non_default_arguments_here():
  assert sorted(NON_DEFAULT) == ALL


@pytest.mark.parametrize("name", ALL)
def test_config_round_trip_through_json(name):
  compressor = tf_adacomp.get_compressor(name, **NON_DEFAULT[name])
  config = json.loads(json.dumps(tf_adacomp.serialize_compressor(compressor)))
  _assert_restored(tf_adacomp.get_compressor(config), name)
  _assert_restored(type(compressor).from_config(compressor.get_config()), name)


def test_config_keeps_non_default_arguments():
  compressor = tf_adacomp.get_compressor(
      "AdaComp", conv_bin_size=64, dense_bin_size=1000, bin_sizes={"lstm": 250},
      max_density=0.5, min_size=100)
  restored = tf_adacomp.get_compressor(tf_adacomp.serialize_compressor(compressor))
  assert restored.get_config() == {
      "min_size": 100, "conv_bin_size": 64, "dense_bin_size": 1000,
      "recurrent_bin_size": 500, "bin_sizes": {"lstm": 250}, "max_density": 0.5}


@pytest.mark.parametrize("name", ALL)
def test_keras_serialization_round_trip(name):
  compressor = tf_adacomp.get_compressor(name, **NON_DEFAULT[name])
  restored = keras.saving.deserialize_keras_object(
      keras.saving.serialize_keras_object(compressor))
  _assert_restored(restored, name)


def test_instances_and_none_pass_through():
  compressor = tf_adacomp.TopK(density=0.1)
  assert tf_adacomp.get_compressor(compressor) is compressor
  assert isinstance(tf_adacomp.get_compressor(None), tf_adacomp.NoCompression)


@pytest.mark.parametrize("identifier", ["adacmop", "", 3, {"name": "adacomp"}])
def test_unknown_compressor_names_the_value(identifier):
  with pytest.raises(ValueError, match="Received: identifier="):
    tf_adacomp.get_compressor(identifier)


def test_kwargs_with_an_instance_are_rejected():
  with pytest.raises(ValueError, match="kwargs"):
    tf_adacomp.get_compressor(tf_adacomp.AdaComp(), conv_bin_size=3)


@pytest.mark.parametrize("kwargs,match", [
    ({"conv_bin_size": 0}, "conv_bin_size=0"),
    ({"dense_bin_size": -5}, "dense_bin_size=-5"),
    ({"recurrent_bin_size": 2.5}, "recurrent_bin_size=2.5"),
    ({"max_density": 0}, "max_density=0"),
    ({"max_density": 1.5}, "max_density=1.5"),
    ({"min_size": -1}, "min_size=-1"),
    ({"bin_sizes": {"x": 0}}, "bin_sizes\\['x'\\]=0"),
    ({"bin_sizes": [50]}, "bin_sizes=\\[50\\]"),
])
def test_adacomp_rejects_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tf_adacomp.AdaComp(**kwargs)


@pytest.mark.parametrize("density", [0, -0.1, 2, "0.1"])
def test_topk_rejects_bad_density(density):
  with pytest.raises(ValueError, match=f"density={density!r}"):
    tf_adacomp.TopK(density=density)


@pytest.mark.parametrize("shape,name,kind,bin_size", [
    ([3, 3, 16, 32], "conv2d/kernel", "conv", 50),
    ([5, 8, 16], "conv1d/kernel", "conv", 50),
    ([128, 10], "dense/kernel", "dense", 500),
    ([32, 128], "lstm/lstm_cell/recurrent_kernel", "recurrent", 500),
    ([10], "dense/bias", "vector", 500),
    ([], "scalar", "vector", 500),
])
def test_adacomp_bin_size_follows_the_variable_kind(shape, name, kind, bin_size):
  plan = tf_adacomp.AdaComp().plan(shape, tf.float32, name)
  assert (plan.kind, plan.bin_size, plan.summable, plan.dense) == (kind, bin_size, False, False)


def test_bin_size_overrides_by_name_and_kind():
  compressor = tf_adacomp.AdaComp(bin_sizes={"^head/": 7})
  assert compressor.plan([64, 10], tf.float32, "head/kernel").bin_size == 7
  assert compressor.plan([64, 10], tf.float32, "body/kernel").bin_size == 500
  assert compressor.plan([64, 10], tf.float32, "x", kind="conv").bin_size == 50


def test_small_tensors_go_dense_and_are_counted():
  compressor = tf_adacomp.AdaComp(min_size=100)
  plan = compressor.plan([10], tf.float32, "bias")
  assert plan.dense and plan.summable
  assert compressor.init(plan) == ()
  grad = tf.range(10, dtype=tf.float32)
  payload, (state,) = compressor.compress([grad], [()], [plan])
  np.testing.assert_array_equal(compressor.decompress(payload, [plan])[0], grad)
  assert int(compressor.nbytes(payload, [plan])[0]) == 40


@pytest.mark.parametrize("kwargs,error,match", [
    ({"shape": [None, 3], "dtype": tf.float32}, ValueError, "shape"),
    ({"shape": [3], "dtype": tf.int32}, TypeError, "dtype=int32"),
    ({"shape": [3], "dtype": tf.float32, "kind": "lstm"}, ValueError, "kind='lstm'"),
])
def test_plan_rejects_bad_input(kwargs, error, match):
  with pytest.raises(error, match=match):
    tf_adacomp.AdaComp().plan(**kwargs)


@pytest.mark.parametrize("shape,name,kind", [
    ([3, 3, 1, 8], "k", "conv"), ([4, 4], "k", "dense"), ([4], "b", "vector"),
    ([4, 4], "gru/recurrent_kernel", "recurrent"),
    ([16, 128], "lstm/lstm_cell/kernel", "recurrent"),
    ([128], "lstm/lstm_cell/bias", "vector"),
    ([3, 3, 4, 8], "conv_lstm/kernel", "conv"),
    ([8, 10], "char_lstm/dense/kernel", "dense"),
    ([8, 10], "recurrent_net/dense/kernel", "dense")])
def test_infer_kind(shape, name, kind):
  assert base.infer_kind(tf.TensorShape(shape), name) == kind


# ---------------------------------------------------------------------------------------
# Configs of other releases: format version and unknown arguments

def test_serialize_writes_the_format_version():
  config = tf_adacomp.serialize_compressor(tf_adacomp.TopK(0.05))
  assert config == {"name": "topk", "config": {"min_size": 0, "density": 0.05},
                    "version": registry.FORMAT_VERSION}
  assert registry.FORMAT_VERSION == 1


def test_configs_without_a_version_still_load():
  """Written before "version" existed (and by CompressedOptimizer.get_config then)."""
  old = {"name": "adacomp", "config": {"min_size": 0, "conv_bin_size": 64,
                                       "dense_bin_size": 500, "recurrent_bin_size": 500,
                                       "bin_sizes": {}, "max_density": 0.25}}
  assert tf_adacomp.get_compressor(old) == tf_adacomp.AdaComp(conv_bin_size=64)


def test_a_newer_format_version_is_refused():
  config = dict(tf_adacomp.serialize_compressor(tf_adacomp.AdaComp()), version=2)
  with pytest.raises(ValueError) as error:
    tf_adacomp.get_compressor(config)
  message = str(error.value)
  assert "format version 2, written by a newer tf_adacomp" in message
  assert f"installed tf_adacomp {tf_adacomp.__version__} reads versions up to 1" in message
  assert f"Received: identifier={config!r}" in message


@pytest.mark.parametrize("version", [0, -1, "1", 1.0, True, None])
def test_a_bad_format_version_is_refused(version):
  config = dict(tf_adacomp.serialize_compressor(tf_adacomp.AdaComp()), version=version)
  with pytest.raises(ValueError, match=r"'version' must be an int >= 1\. Received: identifier="):
    tf_adacomp.get_compressor(config)


def test_unknown_arguments_are_refused_not_dropped():
  """A newer release's argument: building without it would train another compressor."""
  config = tf_adacomp.serialize_compressor(tf_adacomp.TopK(0.05))
  config["config"]["error_feedback"] = False
  with pytest.raises(ValueError) as error:
    tf_adacomp.get_compressor(config)
  message = str(error.value)
  assert "The TopK config has argument(s) ['error_feedback']" in message
  assert f"installed tf_adacomp {tf_adacomp.__version__} does not know" in message
  assert "may come from a newer tf_adacomp" in message
  assert f"Received: identifier={config!r}" in message
  # The same through the class and through Keras' deserialization.
  with pytest.raises(ValueError, match=r"\['error_feedback'\].*Received: config="):
    tf_adacomp.TopK.from_config(config["config"])
  saved = keras.saving.serialize_keras_object(tf_adacomp.TopK(0.05))
  saved["config"]["error_feedback"] = False
  with pytest.raises(ValueError, match=r"\['error_feedback'\].*Received: config="):
    keras.saving.deserialize_keras_object(saved)


@pytest.mark.parametrize("make, owner, typo, meant", [
    (tf_adacomp.AdaComp, "AdaComp", "dense_bin_sise", "dense_bin_size"),
    (tf_adacomp.TopK, "TopK", "densty", "density"),
    (tf_adacomp.FFTCompressor, "FFTCompressor", "Theta", "theta"),
    # The casts inherit Compressor's constructor, and are named themselves.
    (tf_adacomp.FP16, "FP16", "minsize", "min_size"),
    (tf_adacomp.BF16, "BF16", "min_sizes", "min_size"),
    (tf_adacomp.NoCompression, "NoCompression", "min_size_", "min_size"),
    (lambda **kwargs: tf_adacomp.get_compressor("adacomp", **kwargs), "AdaComp",
     "max_densty", "max_density"),
])
def test_a_misspelt_keyword_is_refused_naming_the_closest_one(make, owner, typo, meant):
  with pytest.raises(TypeError) as error:
    make(**{typo: 3})
  assert str(error.value) == (f"{owner}() got an unexpected keyword argument {typo!r} "
                              f"(Received: {typo}=3). Did you mean {meant!r}?")


def test_an_unknown_keyword_without_a_close_one_lists_the_valid_names():
  with pytest.raises(TypeError) as error:
    tf_adacomp.TopK(0.1, error_feedback=False)
  assert str(error.value) == ("TopK() got an unexpected keyword argument 'error_feedback' "
                              "(Received: error_feedback=False). TopK() takes: density, "
                              "min_size.")


def test_a_misspelt_config_key_is_named_with_the_closest_one():
  # The constructors' signatures are still theirs (their checks wrap them): the config
  # check reads them.
  assert list(inspect.signature(tf_adacomp.TopK).parameters) == ["density", "min_size"]
  config = {"name": "topk", "config": {"densty": 0.1}}
  with pytest.raises(ValueError, match=r"\['densty'\].*did you mean 'density' for "
                                       r"'densty'\?.*Received: identifier="):
    tf_adacomp.get_compressor(config)


@pytest.mark.parametrize("config, match", [
    ({"name": "topk", "config": {}, "version": 1, "codec": "x"},
     r"Keys \['codec'\] may come from a newer tf_adacomp \(installed: "),
    ({"name": "topk", "config": [0.1]}, r"'config' must be a dict.*Received: identifier="),
    ({"name": "zip", "config": {}}, r"Unknown compressor\. Received: identifier="),
    ({"name": None, "config": {}}, r"Unknown compressor\. Received: identifier="),
])
def test_malformed_configs_name_the_config(config, match):
  with pytest.raises(ValueError, match=match):
    tf_adacomp.get_compressor(config)


def test_compressed_optimizer_from_a_newer_release_is_refused():
  """keras.optimizers.deserialize surfaces the compressor's error as it is."""
  optimizer = tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1), tf_adacomp.TopK(0.05))
  saved = json.loads(json.dumps(keras.optimizers.serialize(optimizer)))
  assert saved["config"]["compressor"]["version"] == 1
  restored = keras.optimizers.deserialize(json.loads(json.dumps(saved)))
  assert restored.compressor == tf_adacomp.TopK(0.05)
  saved["config"]["compressor"]["version"] = 2
  with pytest.raises(ValueError, match=r"format version 2, written by a newer tf_adacomp; "
                                       r"the installed tf_adacomp .* reads versions up to 1"):
    keras.optimizers.deserialize(saved)
  del saved["config"]["compressor"]["version"]  # an optimizer saved before versions: loads
  assert keras.optimizers.deserialize(saved).compressor == tf_adacomp.TopK(0.05)


@pytest.mark.parametrize("bin_sizes, match", [
    ({"(": 64}, r"`bin_sizes` pattern '\(' is not a valid regular expression \(missing \)"),
    ({"dense": 8, "[a-": 64}, r"`bin_sizes` pattern '\[a-' is not a valid regular"),
    ({3: 64}, r"`bin_sizes` patterns must be strings.*Received: bin_sizes=\{3: 64\}"),
])
def test_adacomp_refuses_a_bad_bin_sizes_pattern_when_built(bin_sizes, match):
  # In the constructor, not at the first plan(): the error names the argument.
  with pytest.raises(ValueError, match=match):
    tf_adacomp.AdaComp(bin_sizes=bin_sizes)


def test_a_config_with_a_bad_bin_sizes_pattern_is_refused_naming_it():
  config = tf_adacomp.serialize_compressor(tf_adacomp.AdaComp())
  config["config"]["bin_sizes"] = {"(": 64}
  match = r"`bin_sizes` pattern '\(' is not a valid regular expression"
  with pytest.raises(ValueError, match=match):
    tf_adacomp.get_compressor(config)
  with pytest.raises(ValueError, match=match):
    tf_adacomp.AdaComp.from_config(config["config"])
  saved = keras.saving.serialize_keras_object(tf_adacomp.AdaComp())
  saved["config"]["bin_sizes"] = {"(": 64}
  with pytest.raises(ValueError, match=match):
    keras.saving.deserialize_keras_object(saved)
  optimizer = tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1), tf_adacomp.AdaComp())
  saved = keras.optimizers.serialize(optimizer)
  saved["config"]["compressor"]["config"]["bin_sizes"] = {"(": 64}
  with pytest.raises(ValueError, match=match):
    keras.optimizers.deserialize(saved)


def test_bin_sizes_values_are_stored_as_ints():
  import numpy as np  # pylint: disable=g-import-not-at-top
  compressor = tf_adacomp.AdaComp(bin_sizes={"x": np.int64(7)})
  assert type(compressor.get_config()["bin_sizes"]["x"]) is int  # JSON-serializable
