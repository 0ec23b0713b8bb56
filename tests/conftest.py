"""Test set-up: tiers, a cache directory per run, and several logical CPU devices.

- Tiers: ``pytest`` runs the fast tier (kernels against NumPy, exchange and optimizer
  mechanics on small models, configuration and error cases). Tests marked
  ``@pytest.mark.slow`` (several processes, the examples' and benchmarks' runs, packaging,
  the CLI) run only with ``--full``, the README's second command and CI.
- A cache directory per run (``XDG_CACHE_HOME``) for the processes the tests start, and
  no persistent XLA cache directory from the user's ``TF_XLA_FLAGS``, so that nothing is
  written to the user's own cache.
- Several devices on one CPU let the distribution tests run MirroredStrategy with real
  collectives on a 2-core machine.
"""

import json
import os
import resource
import shutil
import tempfile
import time

import pytest

from startup import lean_imports  # tests/startup: a namespace package beside this file

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Neither this process nor those it starts import JAX, scikit-learn and matplotlib for
# TensorFlow's and Keras' optional integrations, which no test uses (1.8 CPU-s a process:
# tests/startup/lean_imports.py). Before TensorFlow is imported; xdist's workers and the
# tests' processes find sitecustomize.py in tests/startup first on their PYTHONPATH.
if lean_imports.install():
  _STARTUP = os.path.dirname(os.path.abspath(lean_imports.__file__))
  os.environ["PYTHONPATH"] = os.pathsep.join(
      [_STARTUP] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                    if p and p != _STARTUP])

# Examples run in their own processes keep compiled XLA programs in the user's cache
# (tf_adacomp.xla_cache): a test run gives them a cache of its own, removed when the run
# ends. (The test processes themselves keep no XLA cache: writing each program to disk
# cost more than loading it saved, for programs compiled once per device.)
_CACHE_OWNER = "TF_ADACOMP_TEST_CACHE"  # "pid:directory" of the process that made it
if _CACHE_OWNER not in os.environ:
  os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="tf_adacomp-test-cache-")
  os.environ[_CACHE_OWNER] = f"{os.getpid()}:{os.environ['XDG_CACHE_HOME']}"
# A cache directory in the user's TF_XLA_FLAGS (docs/performance.md shows how to set one)
# would win over XDG_CACHE_HOME (xla_cache.enable keeps the environment's choice): the
# test processes and every process they start would write their programs there. The
# run's other XLA flags stay.
_PERSISTENT_CACHE = "--tf_xla_persistent_cache_directory="
if _PERSISTENT_CACHE in os.environ.get("TF_XLA_FLAGS", ""):
  os.environ["TF_XLA_FLAGS"] = " ".join(
      flag for flag in os.environ["TF_XLA_FLAGS"].split()
      if not flag.startswith(_PERSISTENT_CACHE))

# The tests compile hundreds of small XLA programs, most run a few times on small
# tensors, where compiling costs more than running:
# - LLVM's optimisation passes cost more compile time than they save (about a fifth of
#   a kernel test file's CPU time);
# - XLA:CPU's MLIR fusion emitters compile slower than its LLVM IR ones (measured on
#   tests/ops/test_adacomp.py's fast tier: 67 CPU-s with them, 42 without; the same
#   tests pass).
# Set before TensorFlow reads XLA_FLAGS; the processes the tests start inherit them. A
# flag the user set wins.
for _flag, _value in (("--xla_backend_optimization_level", "0"),
                      ("--xla_cpu_use_fusion_emitters", "false")):
  if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}={_value}".strip()

import tiers  # noqa: E402  (tests/, on sys.path as for every test module)

LOGICAL_CPUS = 4


def split_cpu():
  """Makes ``LOGICAL_CPUS`` logical CPU devices (before TensorFlow's runtime starts)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpus = tf.config.list_physical_devices("CPU")
  tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(LOGICAL_CPUS)])


def _runs_tests(config) -> bool:
  """False in pytest-xdist's controller, which hands tests to its workers and runs none:
  it need not import TensorFlow (6-8 s before the workers start)."""
  if os.environ.get("PYTEST_XDIST_WORKER"):
    return True
  return not getattr(config.option, "numprocesses", None)


def pytest_addoption(parser):
  parser.addoption("--full", action="store_true", default=False,
                   help="run the whole suite: the slow tier (marked slow) too")
  parser.addoption("--part", default=None, metavar="K/N",
                   help="run only part K of N of the selected tests, whole files each "
                   "(every file in exactly one part): N runs, one after the other, "
                   "each in fresh processes")


def pytest_configure(config):
  tiers.record(config.getoption("--full"))
  if config.getoption("--part"):
    parse_part(config.getoption("--part"))  # a bad value stops the run before collection
  if _runs_tests(config):
    split_cpu()
  config.addinivalue_line(
      "markers", "slow: several processes, an example's or a benchmark's run, packaging; "
      "runs only with --full")


# The files of the whole suite that take longest (summed --durations, 2-core VM), longest
# first. pytest-xdist hands out files in collection order (pyproject.toml turns off its
# default reordering by number of tests, which put these few-test files last): started
# first, none of them is left running alone at the end of a run.
HEAVY_FILES_FIRST = (
    "tests/benchmarks/test_benchmark_runs.py",
    "tests/benchmarks/test_faults.py",
    "tests/test_optimizer.py",
    "tests/ops/test_adacomp_bucket.py",
    "tests/test_readme.py",
    "tests/test_tf_keras.py",
    "tests/test_hierarchy_multi_worker.py",
    "tests/test_hierarchy.py",
    "tests/test_cli.py",
    "tests/benchmarks/test_network_devices.py",
    "tests/test_optimizer_corrupt_payloads.py",
    "tests/test_optimizer_multi_worker.py",
    "tests/examples/test_horovod_migration.py",
    "tests/benchmarks/test_scaling_benchmark.py",
    "tests/benchmarks/test_convergence.py",
    "tests/examples/test_imagenet_resnet50.py",
    "tests/test_packaging.py",
)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs: parts of the rest
def pytest_collection_modifyitems(config, items):
  rank = {path: i for i, path in enumerate(HEAVY_FILES_FIRST)}
  # A stable sort: the other files keep their order, and every file its tests' order.
  items.sort(key=lambda item: rank.get(_file_of(item), len(rank)))
  if not config.getoption("--full"):
    _deselect(config, items, lambda item: item.get_closest_marker("slow"))
  if config.getoption("--part"):
    files = list(dict.fromkeys(_file_of(item) for item in items))  # in run order
    kept = set(files_of_part(files, *parse_part(config.getoption("--part"))))
    _deselect(config, items, lambda item: _file_of(item) not in kept)


def _file_of(item):
  return item.nodeid.split("::")[0]


def _deselect(config, items, dropped):
  gone = [item for item in items if dropped(item)]
  if gone:
    config.hook.pytest_deselected(items=gone)
    items[:] = [item for item in items if not dropped(item)]


def parse_part(value):
  """``"K/N"`` -> ``(K, N)`` with 1 <= K <= N; raises pytest.UsageError naming the value."""
  k, _, n = str(value).partition("/")
  if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
    raise pytest.UsageError(f"--part takes K/N with 1 <= K <= N (e.g. --part=1/3). "
                            f"Received: --part={value}")
  return int(k), int(n)


def files_of_part(files, k: int, n: int):
  """The files of part ``k`` of ``n``: ``files`` (heaviest first) dealt out in turn, so
  that each part starts with some of the heaviest."""
  return [path for i, path in enumerate(files) if i % n == k - 1]


def pytest_unconfigure(config):
  """The process that made the run's cache removes it (xdist workers leave it)."""
  del config
  owner, _, cache = os.environ.get(_CACHE_OWNER, "").partition(":")
  if owner == str(os.getpid()):
    shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(autouse=True)
def _package_log_reaches_caplog(monkeypatch):
  """The ``tf_adacomp`` logger's records also go to the root logger, where ``caplog``
  listens (for users, ``tf_adacomp.log`` stops them at its own handler, so that absl
  does not print them a second time: tests/test_log.py checks that in a process)."""
  from tf_adacomp import log  # pylint: disable=g-import-not-at-top
  log._configured()  # pylint: disable=protected-access  (its handler first, then this)
  monkeypatch.setattr(log.LOGGER, "propagate", True)


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
# segfaults, so a process must not compile the whole suite's programs: the suite runs in
# two (pytest-xdist, -n 2 --dist loadfile, in pyproject.toml), and this stops a run, with
# the reason, before a process gets there (under xdist too: the run ends with the
# message and exit status 3).
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
        f"process ends, and TensorFlow segfaults at the limit. Run the tests in more "
        f"processes (pytest -n 4), or raise the limit (sysctl -w "
        f"vm.max_map_count=262144).", returncode=3)


# The suite's time on a 2-core machine is its CPU-seconds over 2 (docs/development.md):
# TF_ADACOMP_CPU_LOG=FILE appends, for each test, a JSON line with the CPU-seconds of its
# own process and of the processes it started and waited for, to find where they go.
_CPU_LOG = os.environ.get("TF_ADACOMP_CPU_LOG")


def cpu_seconds():
  """``(this process, its waited-for children)``: user + system CPU-seconds so far."""
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def cpu_record(nodeid, before, after, wall):
  """One line of the CPU log: a test's CPU-seconds from two ``cpu_seconds()`` readings."""
  return json.dumps({"test": nodeid, "own": round(after[0] - before[0], 3),
                     "children": round(after[1] - before[1], 3), "wall": round(wall, 3),
                     "pid": os.getpid()})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """With TF_ADACOMP_CPU_LOG=FILE: each test's CPU (set-up, call and tear-down) to FILE."""
  del nextitem
  if not _CPU_LOG:
    yield
    return
  before, start = cpu_seconds(), time.perf_counter()
  yield
  line = cpu_record(item.nodeid, before, cpu_seconds(), time.perf_counter() - start)
  with open(_CPU_LOG, "a") as log:
    log.write(line + "\n")
