"""The Keras and TensorFlow versions the compatibility code was checked against.

The guards of ``compat`` decide from the installed code itself (what an attribute holds,
what a function still does), not from version numbers, because no upstream release is
known to change what they guard; these are for messages: a canary that fails names the
versions installed and the versions its guard was written for.
"""

import re
from typing import Tuple

import keras
import tensorflow as tf

__all__ = ["TESTED_KERAS", "TESTED_TENSORFLOW", "installed", "keras_version", "tested"]

# The pair every private name and patch of ``compat`` was last checked against.
TESTED_TENSORFLOW = "2.21.0"
TESTED_KERAS = "3.15.1"


def installed() -> str:
  """The installed versions, for messages: ``"TensorFlow 2.21.0, Keras 3.15.1"``."""
  return f"TensorFlow {tf.__version__}, Keras {keras.__version__}"


def tested() -> str:
  """The versions the guards were written for, worded as ``installed()``."""
  return f"TensorFlow {TESTED_TENSORFLOW}, Keras {TESTED_KERAS}"


def keras_version() -> Tuple[int, ...]:
  """The installed Keras version as numbers: ``(3, 15, 1)``; ``"3.0.0rc1"`` gives
  ``(3, 0, 0)`` (a pre-release counts as its release, which is what a guard compares)."""
  parts = []
  for part in str(keras.__version__).split("."):
    digits = re.match(r"\d+", part)
    if not digits:
      break
    parts.append(int(digits.group()))
    if digits.group() != part:  # "0rc1", "0dev": stop after the number
      break
  return tuple(parts)
