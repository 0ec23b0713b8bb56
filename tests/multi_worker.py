"""Multi-worker test harness: N worker processes on 127.0.0.1, each with its TF_CONFIG.

``run_workers(target, num_workers=2, out_dir=tmp_path)`` starts one Python process per
worker and returns ``[WorkerResult(returncode, stdout, stderr), ...]`` in task order.
``target`` is a script path (``tests/workers/keras_fit.py``), a ``"module:function"``
string, or a module-level function (run as ``module:function``; ``tests/`` and the
project root are on the workers' ``PYTHONPATH``). Workers find their results folder in
``$MULTI_WORKER_OUT_DIR`` (see ``out_dir``) and their index in ``TF_CONFIG``
(``worker_index()`` below).

Each worker runs CPU only (``CUDA_VISIBLE_DEVICES=""``) with ``TF_CPP_MIN_LOG_LEVEL=2``.
Output goes to files, not pipes, so a chatty worker cannot block on a full pipe while
its peers wait for it in a collective. When a worker fails, the others get
``grace`` seconds to finish (they usually fail too, or hang in a collective) and are
then killed; at ``timeout`` every worker still running is killed. Only the processes
started here are ever killed.
"""

import collections
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
PROJECT_ROOT = TESTS_DIR.parent
WORKERS_DIR = TESTS_DIR / "workers"
OUT_DIR_ENV = "MULTI_WORKER_OUT_DIR"

WorkerResult = collections.namedtuple("WorkerResult", ["returncode", "stdout", "stderr"])


def free_ports(count):
  """``count`` distinct TCP ports free on 127.0.0.1 (all held open while choosing)."""
  sockets = []
  try:
    for _ in range(count):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind(("127.0.0.1", 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def worker_index():
  """In a worker: its index in the cluster (0 is the chief)."""
  return json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def worker_out_dir():
  """In a worker: the folder for its results."""
  return Path(os.environ[OUT_DIR_ENV])


def _command(target, args):
  if callable(target):
    if target.__module__ == "__main__" or "<locals>" in target.__qualname__:
      raise ValueError(f"`target` must be a module-level function of an importable module. "
                       f"Received: target={target!r}")
    target = f"{target.__module__}:{target.__qualname__}"
  target = str(target)
  if target.endswith(".py") or os.sep in target:
    return [sys.executable, str(Path(target).resolve()), *args]
  module, sep, function = target.partition(":")
  if not sep or not module or not function:
    raise ValueError(f"`target` must be a .py path, 'module:function' or a function. "
                     f"Received: target={target!r}")
  code = (f"import sys, importlib; sys.argv[1:] = {list(args)!r}; "
          f"importlib.import_module({module!r}).{function}()")
  return [sys.executable, "-c", code]


def run_workers(target, num_workers=2, timeout=240, env=None, out_dir=None, args=(),
                grace=20):
  """Runs ``target`` in ``num_workers`` processes forming one TF_CONFIG cluster.

  Args:
    target: a script path, a ``"module:function"`` string or a module-level function.
    num_workers: processes to start, >= 1.
    timeout: seconds for all of them together; the ones still running then are killed.
    env: extra environment variables for every worker.
    out_dir: folder for the workers' results, passed as ``$MULTI_WORKER_OUT_DIR``
      (a fresh temporary folder when None).
    args: command-line arguments for every worker.
    grace: seconds the other workers get once one has failed.

  Returns:
    A list of ``WorkerResult(returncode, stdout, stderr)`` in task order; a killed
    worker has a negative return code and a note at the end of its stderr.
  """
  if num_workers < 1:
    raise ValueError(f"`num_workers` must be >= 1. Received: num_workers={num_workers}")
  from tf_adacomp.distribute import tf_config  # pylint: disable=g-import-not-at-top

  command = _command(target, args)
  out_dir = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="workers-"))
  out_dir.mkdir(parents=True, exist_ok=True)
  addresses = [f"127.0.0.1:{port}" for port in free_ports(num_workers)]
  pythonpath = [str(PROJECT_ROOT), str(TESTS_DIR)]
  if os.environ.get("PYTHONPATH"):
    pythonpath.append(os.environ["PYTHONPATH"])

  logs = tempfile.mkdtemp(prefix="worker-logs-")
  processes, files = [], []
  try:
    for index in range(num_workers):
      worker_env = dict(os.environ)
      worker_env.update(env or {})
      worker_env.update({
          "TF_CONFIG": tf_config(addresses, index),
          "PYTHONPATH": os.pathsep.join(pythonpath),
          "TF_CPP_MIN_LOG_LEVEL": "2",
          "CUDA_VISIBLE_DEVICES": "",
          OUT_DIR_ENV: str(out_dir),
      })
      stdout = open(os.path.join(logs, f"{index}.out"), "w+")
      stderr = open(os.path.join(logs, f"{index}.err"), "w+")
      files.append((stdout, stderr))
      processes.append(subprocess.Popen(command, env=worker_env, cwd=str(PROJECT_ROOT),
                                        stdout=stdout, stderr=stderr,
                                        stdin=subprocess.DEVNULL))
    notes = [""] * num_workers
    deadline = time.monotonic() + timeout
    while True:
      codes = [p.poll() for p in processes]
      if all(code is not None for code in codes):
        break
      now = time.monotonic()
      if any(code not in (None, 0) for code in codes):
        deadline = min(deadline, now + grace)
      if now >= deadline:
        for index, p in enumerate(processes):
          if p.poll() is None:
            p.kill()
            notes[index] = f"\n[run_workers: killed worker {index} after {timeout} s " \
                           f"or {grace} s after a peer failed]\n"
        for p in processes:
          p.wait()
        break
      time.sleep(0.1)
  finally:
    for p in processes:  # only on an exception above: never leave a worker behind
      if p.poll() is None:
        p.kill()
        p.wait()
  results = []
  for index, (p, (stdout, stderr)) in enumerate(zip(processes, files)):
    stdout.seek(0)
    stderr.seek(0)
    results.append(WorkerResult(p.returncode, stdout.read(), stderr.read() + notes[index]))
    stdout.close()
    stderr.close()
  shutil.rmtree(logs, ignore_errors=True)
  return results


def describe(results):
  """The outputs of all workers, for assertion messages."""
  return "\n".join(f"=== worker {i}: returncode {r.returncode}\n--- stdout\n{r.stdout[-3000:]}"
                   f"\n--- stderr\n{r.stderr[-5000:]}" for i, r in enumerate(results))
