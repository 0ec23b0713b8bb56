"""Test set-up: split the CPU into logical devices before TensorFlow initialises.

Several devices on one CPU let the distribution tests run MirroredStrategy with real
collectives on a 2-core machine.
"""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

LOGICAL_CPUS = 4

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(LOGICAL_CPUS)])


@pytest.fixture
def unpatched_keras():
  """Keras as installed for the test, and as it was again afterwards (the multi-worker fix
  of tf_adacomp.keras_fixes reverted around the test)."""
  from tf_adacomp import keras_fixes  # pylint: disable=g-import-not-at-top
  was_applied = keras_fixes.keras_multi_worker_fix_applied()
  keras_fixes.revert_keras_multi_worker_fix()
  yield
  keras_fixes.revert_keras_multi_worker_fix()
  if was_applied:
    keras_fixes.apply_keras_multi_worker_fix()
