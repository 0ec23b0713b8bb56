"""A quiet ``tf-adacomp``: TensorFlow's C++ start-up lines hidden, everything else kept.

TensorFlow prints a dozen lines when it loads and starts its devices (CUDA stubs,
cuInit on a machine without a GPU, oneDNN, cpu_feature_guard, XLA service). The
``tf-adacomp`` command hides them unless ``TF_CPP_MIN_LOG_LEVEL`` is set or
``tf-adacomp --verbose ...`` is given:

- the runs (``train``, each ``demo`` run) are child processes whose stderr passes through
  a line filter (``is_start_up_noise``): some of these lines come from absl's C++
  logging, which ``TF_CPP_MIN_LOG_LEVEL`` does not reach;
- in the command's own process, ``tf_adacomp/__init__.py`` imports TensorFlow inside
  ``quiet_tensorflow_import()``, the only moment when it prints.

Standard library only: this module runs before TensorFlow loads.
"""

import contextlib
import os
import re
import subprocess
import sys
import threading

# TensorFlow's C++ log lines ("I0000 00:00:1795426589.056564    3750 file.cc:31] ...") and
# absl's notice before its first one; the W and E lines kept are those not listed below.
_LOG_LINE = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ ([\w.-]+):\d+\] ")
_NOISY_SOURCES = {  # W and E lines that every CPU-only or GPU start prints, harmless
    "cuda_platform.cc", "cuda_dnn.cc", "cuda_fft.cc", "cuda_blas.cc", "dataset.cc",
    "cuda_executor.cc", "gpu_device.cc", "cudart_stub.cc",
}
_NOISY_LINES = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "To enable the following instructions:",  # cpu_feature_guard's second line
    "oneDNN custom operations are on.",
)


def is_start_up_noise(line: str) -> bool:
  """Whether a stderr line is TensorFlow start-up noise (hidden unless --verbose)."""
  match = _LOG_LINE.match(line)
  if match:
    return match.group(1) == "I" or match.group(2) in _NOISY_SOURCES
  return line.startswith(_NOISY_LINES)


# The environment the process started with, read when this module loads, before
# TensorFlow: where JAX is installed TensorFlow imports it (tf.lite), and JAX's import
# sets TF_CPP_MIN_LOG_LEVEL, which must not read as the user's choice.
STARTING_ENVIRON = dict(os.environ)


def wants_verbose(argv, environ=None) -> bool:
  """``--verbose`` before the command, or a TF_CPP_MIN_LOG_LEVEL the user chose.

  Args:
    argv: the command's arguments, without the program.
    environ: the user's environment; by default the process's as it started.

  Returns:
    Whether TensorFlow's start-up lines are to be shown.
  """
  environ = STARTING_ENVIRON if environ is None else environ
  options = []
  for arg in argv:
    if not arg.startswith("-"):
      break
    options.append(arg)
  return "--verbose" in options or "TF_CPP_MIN_LOG_LEVEL" in environ


def is_this_command() -> bool:
  """Whether this process is the ``tf-adacomp`` command (script or ``-m tf_adacomp.cli``)."""
  if os.path.basename(sys.argv[0]).startswith("tf-adacomp"):
    return True
  orig = getattr(sys, "orig_argv", [])
  return any(a == "-m" and b == "tf_adacomp.cli" for a, b in zip(orig, orig[1:]))


@contextlib.contextmanager
def quiet_tensorflow_import():
  """Around the package's ``import tensorflow``: in the quiet command, stderr (fd 2) is
  sent to /dev/null for the import alone (only start-up lines are printed there; an
  import error is raised, and printed, after it). Elsewhere: nothing."""
  if not is_this_command() or wants_verbose(sys.argv[1:]):
    yield
    return
  sys.stderr.flush()
  saved = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  try:
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(devnull)


def run(command, quiet) -> int:
  """Runs ``command`` as a child process and waits for it.

  Args:
    command: the argument list (``[sys.executable, "-m", ...]``).
    quiet: True: the child gets ``TF_CPP_MIN_LOG_LEVEL=2`` and its stderr passes through
      ``is_start_up_noise``; False: it runs untouched.

  Returns:
    The child's exit status.
  """
  if not quiet:
    return subprocess.run(command, check=False).returncode
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True,
                             errors="replace", bufsize=1)

  def forward():
    for line in process.stderr:
      if not is_start_up_noise(line):
        sys.stderr.write(line)
        sys.stderr.flush()

  thread = threading.Thread(target=forward, daemon=True)
  thread.start()
  try:
    code = process.wait()
  except KeyboardInterrupt:  # the child got the signal too; let it finish
    code = process.wait()
  thread.join()
  return code
