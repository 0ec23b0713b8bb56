"""Argument checks shared by the kernels: clear errors naming the argument and value.

They run in Python on static properties (dtype, static shape, Python ints), before any
tensor is touched, so a bad call raises and leaves every residue as it was.
"""

import numbers

import tensorflow as tf

FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
MAX_ELEMENTS = 2**31 - 1  # positions are sent as at most 31-bit unsigned integers


def float_dtype(value, name: str) -> tf.DType:
  """Returns ``value`` as a tf.DType, raising TypeError unless it is a float type."""
  try:
    dtype = tf.as_dtype(value)
  except TypeError as e:
    raise TypeError(f"`{name}` must be a floating-point dtype. Received: {name}={value!r}") from e
  if dtype not in FLOAT_DTYPES:
    raise TypeError(
        f"`{name}` must be one of float16, bfloat16, float32, float64. "
        f"Received: {name}={dtype.name}")
  return dtype


def float_tensor(value, name: str) -> tf.Tensor:
  """Converts ``value`` to a tensor with a static shape and a floating-point dtype."""
  if isinstance(value, (tf.SparseTensor, tf.IndexedSlices)):
    raise TypeError(f"`{name}` must be a dense tensor. Received: {name} of type "
                    f"{type(value).__name__}")
  # A variable is read here: the compiled kernels take values, never variables.
  value = tf.convert_to_tensor(value)
  float_dtype(value.dtype, name)
  static_shape(value.shape, name)
  return value


def static_shape(shape, name: str) -> tf.TensorShape:
  """Returns ``shape`` as a fully-defined TensorShape small enough to index in 31 bits."""
  try:
    shape = tf.TensorShape(shape)
  except (TypeError, ValueError) as e:
    raise ValueError(f"`{name}` must be a shape. Received: {name}={shape!r}") from e
  if not shape.is_fully_defined():
    raise ValueError(f"`{name}` needs a fully-defined static shape (the kernels are "
                     f"compiled per shape). Received: {name} with shape {shape}")
  if shape.num_elements() > MAX_ELEMENTS:
    raise ValueError(f"`{name}` has {shape.num_elements()} elements; at most {MAX_ELEMENTS} "
                     f"are supported. Received: shape {shape}")
  return shape


def positive_int(value, name: str) -> int:
  """Returns ``value`` as an int >= 1, or raises ValueError naming it."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
  return int(value)


def fraction(value, name: str) -> float:
  """Returns ``value`` as a float in (0, 1], or raises ValueError naming it."""
  if (isinstance(value, bool) or not isinstance(value, numbers.Real)
      or not 0.0 < float(value) <= 1.0):
    raise ValueError(f"`{name}` must be a number in (0, 1]. Received: {name}={value!r}")
  return float(value)


def same_shape(a: tf.Tensor, b: tf.Tensor, a_name: str, b_name: str) -> None:
  if a.shape != b.shape:
    raise ValueError(f"`{b_name}` must have the shape of `{a_name}` {a.shape}. "
                     f"Received: {b_name} with shape {b.shape}")


def payload_tensor(value, name: str = "payload") -> tf.Tensor:
  """Checks a payload: int32, rank 1 (one replica) or 2 (gathered), static shape."""
  value = tf.convert_to_tensor(value)
  if value.dtype != tf.int32:
    raise TypeError(f"`{name}` must be an int32 tensor. Received: {name} with dtype "
                    f"{value.dtype.name}")
  if value.shape.rank not in (1, 2) or not value.shape.is_fully_defined():
    raise ValueError(f"`{name}` must have a static shape [words] or [replicas, words]. "
                     f"Received: {name} with shape {value.shape}")
  return value
