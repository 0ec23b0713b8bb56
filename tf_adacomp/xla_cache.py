"""Compile once: TensorFlow's persistent XLA compilation cache, for the package's kernels.

TensorFlow keeps its compiled XLA programs per device. Under a ``MirroredStrategy`` of N
logical devices every kernel therefore compiles N times, and every new process (a
worker of a multi-worker job, the next run of a script) compiles them all again.
TensorFlow can persist compiled programs in a directory (``TF_XLA_FLAGS=
--tf_xla_persistent_cache_directory=DIR``): a program compiled for one device is then
loaded from that directory for the next device of the same kind and by the next
process. ``enable`` sets that flag; docs/performance.md ("Compiling") has what it saves.

TensorFlow reads the flag once, when its runtime starts: ``enable`` must run before
the first tensor, device setting, strategy or model of the process.

The directory holds executables that TensorFlow loads and runs: like any cache of
compiled code it must be writable only by you. ``enable`` creates it with mode 0700,
and the default is per user and per TensorFlow version.
"""

import os

import tensorflow as tf

from tf_adacomp.compat import internals

FLAG = "--tf_xla_persistent_cache_directory"
ENVIRONMENT = "TF_XLA_FLAGS"


def default_directory() -> str:
  """``$XDG_CACHE_HOME/tf_adacomp/xla/tf-<version>`` (``~/.cache`` without it)."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "tf_adacomp", "xla", f"tf-{tf.__version__}")


def current_directory():
  """The cache directory that ``TF_XLA_FLAGS`` names, or None."""
  for flag in os.environ.get(ENVIRONMENT, "").split():
    if flag.startswith(FLAG + "="):
      return flag[len(FLAG) + 1:]
  return None


def can_enable() -> bool:
  """Whether ``enable`` can still take effect: TensorFlow's runtime has not started."""
  return not internals.eager_context_initialized()


def enable(directory=None) -> str:
  """Makes TensorFlow keep compiled XLA programs in ``directory`` and reuse them.

  Args:
    directory: a path (str or os.PathLike); None: ``default_directory()``. Created
      (mode 0700) if missing.

  Returns:
    The directory in use. If ``TF_XLA_FLAGS`` already names one, that one is kept and
    returned (the environment's choice wins).

  Raises:
    TypeError: ``directory`` is not a path.
    RuntimeError: TensorFlow's runtime has already started, so the flag would be
      ignored; set ``TF_XLA_FLAGS`` in the environment instead.
  """
  if directory is not None and not isinstance(directory, (str, os.PathLike)):
    raise TypeError(f"`directory` must be a path. Received: directory={directory!r}")
  existing = current_directory()
  if existing is not None:
    return existing
  if not can_enable():
    raise RuntimeError(
        "tf_adacomp.xla_cache.enable() must run before TensorFlow starts its runtime (the "
        "first tensor, device setting, strategy or model): TensorFlow reads "
        f"{ENVIRONMENT} once. Received: a call after it started. Set {ENVIRONMENT}="
        f"{FLAG}=DIR in the environment instead.")
  directory = os.fspath(directory if directory is not None else default_directory())
  os.makedirs(directory, mode=0o700, exist_ok=True)
  flags = os.environ.get(ENVIRONMENT, "")
  os.environ[ENVIRONMENT] = f"{flags} {FLAG}={directory}".strip()
  return directory
