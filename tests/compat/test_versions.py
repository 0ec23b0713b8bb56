"""The versions the compatibility code names in its messages."""

import keras
import pytest
import tensorflow as tf

from tf_adacomp.compat import versions


def test_installed_names_the_installed_tensorflow_and_keras():
  assert versions.installed() == f"TensorFlow {tf.__version__}, Keras {keras.__version__}"
  assert versions.tested() == (f"TensorFlow {versions.TESTED_TENSORFLOW}, "
                               f"Keras {versions.TESTED_KERAS}")


@pytest.mark.parametrize("version, expected", [
    ("3.15.1", (3, 15, 1)), ("3.0.0rc1", (3, 0, 0)), ("3.1.0.dev2024", (3, 1, 0)),
    ("2.15.0", (2, 15, 0)),
])
def test_keras_version_reads_numbers(monkeypatch, version, expected):
  monkeypatch.setattr(keras, "__version__", version)
  assert versions.keras_version() == expected
