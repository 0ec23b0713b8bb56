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
  of tf_adacomp.compat.keras_multi_worker reverted around the test)."""
  from tf_adacomp.compat import keras_multi_worker  # pylint: disable=g-import-not-at-top
  was_applied = keras_multi_worker.keras_multi_worker_fix_applied()
  keras_multi_worker.revert_keras_multi_worker_fix()
  yield
  keras_multi_worker.revert_keras_multi_worker_fix()
  if was_applied:
    keras_multi_worker.apply_keras_multi_worker_fix()


# XLA:CPU maps about three memory regions per compiled kernel (code, constants, data)
# and keeps them for the life of the process; an AdaComp program has ~50 kernels. Past
# Linux's vm.max_map_count (65530 by default) the next mmap fails and TensorFlow
# segfaults, so a process must not compile the whole suite's programs: the README runs
# it in two (pytest-xdist, -n 2 --dist loadfile), and this stops a run, with the reason,
# before it gets there.
_MAPS = "/proc/self/maps"
_MAPS_LIMIT = "/proc/sys/vm/max_map_count"
_MAPS_LOG = os.environ.get("TF_ADACOMP_MAPS_LOG")


def _count_lines(path):
  with open(path) as f:
    return sum(1 for _ in f)


def pytest_runtest_logfinish(nodeid, location):
  """Stops the run at 90% of vm.max_map_count; with TF_ADACOMP_MAPS_LOG=FILE, also
  appends each test's mapping count and id to FILE (to find the tests that compile most)."""
  del location
  if not (os.path.exists(_MAPS) and os.path.exists(_MAPS_LIMIT)):
    return  # not Linux
  count = _count_lines(_MAPS)
  if _MAPS_LOG:
    with open(_MAPS_LOG, "a") as log:
      log.write(f"{count} {nodeid}\n")
  with open(_MAPS_LIMIT) as f:
    limit = int(f.read())
  if count > 0.9 * limit:
    pytest.exit(
        f"after {nodeid}, this test process holds {count} memory mappings, near "
        f"vm.max_map_count ({limit}): XLA:CPU keeps ~3 per compiled kernel until the "
        f"process ends, and TensorFlow segfaults at the limit. Run the suite in two "
        f"processes as the README does (python -m pytest tests -n 2 --dist loadfile), or "
        f"raise vm.max_map_count.", returncode=3)
