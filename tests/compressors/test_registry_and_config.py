"""The compressor contract: registry, plans, configs and bad arguments."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp.compressors import base

ALL = ["adacomp", "bf16", "fft", "fp16", "none", "topk"]


def test_registry_lists_every_compressor():
  assert tf_adacomp.available_compressors() == ALL


@pytest.mark.parametrize("name", ALL)
def test_config_round_trip_through_json(name):
  compressor = tf_adacomp.get_compressor(name)
  config = json.loads(json.dumps(tf_adacomp.serialize_compressor(compressor)))
  assert tf_adacomp.get_compressor(config) == compressor
  assert type(compressor).from_config(compressor.get_config()) == compressor


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
  compressor = tf_adacomp.get_compressor(name)
  restored = keras.saving.deserialize_keras_object(
      keras.saving.serialize_keras_object(compressor))
  assert restored == compressor


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
  payload, state = compressor.compress(grad, (), plan)
  np.testing.assert_array_equal(compressor.decompress(payload, plan), grad)
  assert int(compressor.payload_nbytes(payload, plan)) == 40


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
