"""Argument checks shared by the kernels and the package's classes: clear errors naming
the argument and value ("`name` must be ... Received: name=value").

They run in Python on static properties (dtype, static shape, Python ints), before any
tensor is touched, so a bad call raises and leaves every residue as it was. A bool is
never taken for a number, although Python makes it an int.
"""

import math
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


def compute_dtype(*dtypes) -> tf.DType:
  """The dtype the kernels compute in: float64 if any of ``dtypes`` is, else float32."""
  return tf.float64 if tf.float64 in dtypes else tf.float32


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


def is_int(value) -> bool:
  """True for a Python or NumPy integer; False for a bool (an int subclass) and the rest."""
  return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def is_number(value) -> bool:
  """True for a real Python or NumPy number (ints included); False for a bool."""
  return not isinstance(value, bool) and isinstance(value, numbers.Real)


def int_at_least(value, name: str, minimum: int, *, word: str = "integer") -> int:
  """Returns ``value`` as an int >= ``minimum``, or raises ValueError naming it.

  The message reads "`name` must be an integer >= minimum. Received: name=value"
  (``word="int"`` writes "an int" instead, as some call sites always have).
  """
  if not is_int(value) or value < minimum:
    raise ValueError(f"`{name}` must be an {word} >= {minimum}. Received: {name}={value!r}")
  return int(value)


def non_negative_int(value, name: str) -> int:
  """Returns ``value`` as an int >= 0, or raises ValueError naming it."""
  return int_at_least(value, name, 0)


def positive_int(value, name: str) -> int:
  """Returns ``value`` as an int >= 1, or raises ValueError naming it."""
  return int_at_least(value, name, 1)


def int_in_range(value, name: str, low: int, high: int) -> int:
  """Returns ``value`` as an int in [low, high], or raises ValueError naming it."""
  if not is_int(value) or not low <= value <= high:
    raise ValueError(f"`{name}` must be an integer in [{low}, {high}]. "
                     f"Received: {name}={value!r}")
  return int(value)


def typed_int(value, name: str, minimum: int) -> int:
  """Returns ``value`` as an int >= ``minimum``: TypeError if it is no integer (a bool
  included), ValueError if it is too small; both name it and the value."""
  if not is_int(value):
    raise TypeError(f"`{name}` must be an int. Received: {name}={value!r} "
                    f"of type {type(value).__name__}")
  if value < minimum:
    raise ValueError(f"`{name}` must be >= {minimum}. Received: {name}={value!r}")
  return int(value)


def number_in_range(value, name: str, low, high, *, low_open: bool = False,
                    high_open: bool = False) -> float:
  """Returns ``value`` as a float in the interval from ``low`` to ``high`` (each end
  closed unless ``*_open``), or raises ValueError naming it; NaN is outside."""
  ok = is_number(value) and (float(value) > low if low_open else float(value) >= low) and (
      float(value) < high if high_open else float(value) <= high)
  if not ok:
    interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    raise ValueError(f"`{name}` must be a number in {interval}. Received: {name}={value!r}")
  return float(value)


def fraction(value, name: str) -> float:
  """Returns ``value`` as a float in (0, 1], or raises ValueError naming it."""
  return number_in_range(value, name, 0, 1, low_open=True)


def positive_number(value, name: str, *, optional: bool = False):
  """Returns ``value`` as a finite float > 0, or raises ValueError naming it.

  With ``optional``, None is accepted (and returned) too, and the message says so.
  """
  if optional and value is None:
    return None
  if not is_number(value) or not math.isfinite(value) or value <= 0:
    allowed = "None or a finite number" if optional else "a finite number"
    raise ValueError(f"`{name}` must be {allowed} > 0. Received: {name}={value!r}")
  return float(value)


def boolean(value, name: str) -> bool:
  """Returns ``value`` if it is True or False (not merely truthy), else raises ValueError."""
  if not isinstance(value, bool):
    raise ValueError(f"`{name}` must be True or False. Received: {name}={value!r}")
  return value


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
