"""Test set-up: split the CPU into logical devices before TensorFlow initialises.

Several devices on one CPU let the distribution tests run MirroredStrategy with real
collectives on a 2-core machine.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

LOGICAL_CPUS = 4

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(LOGICAL_CPUS)])
