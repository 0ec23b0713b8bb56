"""The argument checks of tf_adacomp.ops.checks: values accepted, and the messages."""

import math
import re

import numpy as np
import pytest
import tensorflow as tf

from tf_adacomp.ops import checks


def _raises(error, message):
  return pytest.raises(error, match="^" + re.escape(message) + "$")


def test_is_int_and_is_number_never_take_a_bool():
  assert checks.is_int(3) and checks.is_int(np.int64(3))
  assert not checks.is_int(True) and not checks.is_int(3.0) and not checks.is_int("3")
  assert checks.is_number(3) and checks.is_number(0.5) and checks.is_number(np.float32(0.5))
  assert not checks.is_number(False) and not checks.is_number("0.5") and not checks.is_number(None)


@pytest.mark.parametrize("value", [0, 7, np.int32(2)])
def test_non_negative_int_accepts(value):
  result = checks.non_negative_int(value, "min_size")
  assert result == value and type(result) is int


@pytest.mark.parametrize("value", [-1, 1.0, True, "2", None])
def test_non_negative_int_message(value):
  with _raises(ValueError, f"`min_size` must be an integer >= 0. Received: min_size={value!r}"):
    checks.non_negative_int(value, "min_size")


@pytest.mark.parametrize("value", [0, False, 2.5])
def test_positive_int_message(value):
  with _raises(ValueError, f"`learners` must be an integer >= 1. Received: learners={value!r}"):
    checks.positive_int(value, "learners")


def test_int_at_least_with_the_word_int():
  assert checks.int_at_least(4, "width", 1, word="int") == 4
  with _raises(ValueError, "`width` must be an int >= 1. Received: width=0"):
    checks.int_at_least(0, "width", 1, word="int")
  with _raises(ValueError, "`seed` must be an integer >= 0. Received: seed=True"):
    checks.int_at_least(True, "seed", 0)


def test_int_in_range():
  assert checks.int_in_range(8, "exponent_bits", 1, 8) == 8
  for value in (0, 9, 4.0, True):
    with _raises(ValueError, f"`exponent_bits` must be an integer in [1, 8]. "
                 f"Received: exponent_bits={value!r}"):
      checks.int_in_range(value, "exponent_bits", 1, 8)


def test_typed_int_raises_type_error_then_value_error():
  assert checks.typed_int(np.int64(2), "count", 1) == 2
  with _raises(TypeError, "`count` must be an int. Received: count=2.0 of type float"):
    checks.typed_int(2.0, "count", 1)
  with _raises(TypeError, "`count` must be an int. Received: count=True of type bool"):
    checks.typed_int(True, "count", 1)
  with _raises(ValueError, "`count` must be >= 1. Received: count=0"):
    checks.typed_int(0, "count", 1)


def test_number_in_range_and_fraction():
  assert checks.number_in_range(0, "theta", 0, 1, high_open=True) == 0.0
  for value in (1, 1.0, -0.1, math.nan, True, "0.5"):
    with _raises(ValueError, f"`theta` must be a number in [0, 1). Received: theta={value!r}"):
      checks.number_in_range(value, "theta", 0, 1, high_open=True)
  assert checks.fraction(1, "max_density") == 1.0
  for value in (0, 0.0, 1.5, math.nan, False):
    with _raises(ValueError, f"`max_density` must be a number in (0, 1]. "
                 f"Received: max_density={value!r}"):
      checks.fraction(value, "max_density")


def test_positive_number():
  assert checks.positive_number(2, "peak") == 2.0
  for value in (0, -1.0, math.inf, math.nan, True, "1"):
    with _raises(ValueError, f"`peak` must be a finite number > 0. Received: peak={value!r}"):
      checks.positive_number(value, "peak")
  assert checks.positive_number(None, "local_clipnorm", optional=True) is None
  with _raises(ValueError, "`local_clipnorm` must be None or a finite number > 0. "
               "Received: local_clipnorm=0.0"):
    checks.positive_number(0.0, "local_clipnorm", optional=True)
  with _raises(ValueError, "`peak` must be a finite number > 0. Received: peak=None"):
    checks.positive_number(None, "peak")


def test_boolean():
  assert checks.boolean(True, "momentum_masking") is True
  assert checks.boolean(False, "momentum_masking") is False
  for value in (1, 0, None, "yes", np.bool_(True)):
    with _raises(ValueError, f"`momentum_masking` must be True or False. "
                 f"Received: momentum_masking={value!r}"):
      checks.boolean(value, "momentum_masking")


def test_compute_dtype():
  assert checks.compute_dtype(tf.float16) == tf.float32
  assert checks.compute_dtype(tf.bfloat16, tf.float32) == tf.float32
  assert checks.compute_dtype(tf.float32, tf.float64) == tf.float64
