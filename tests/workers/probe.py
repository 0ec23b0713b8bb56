"""Workers for the harness's own tests: no TensorFlow, start in a fraction of a second."""

import json
import os
import sys
import time

from multi_worker import worker_index, worker_out_dir


def report():
  """Writes what the worker was given to probe{index}.json."""
  index = worker_index()
  with open(worker_out_dir() / f"probe{index}.json", "w") as f:
    json.dump({"index": index, "tf_config": json.loads(os.environ["TF_CONFIG"]),
               "argv": sys.argv[1:], "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
               "log_level": os.environ.get("TF_CPP_MIN_LOG_LEVEL"),
               "extra": os.environ.get("PROBE_EXTRA"), "cwd": os.getcwd()}, f)
  print(f"probe {index} done")


def hang():
  time.sleep(600)


def first_fails():
  if worker_index() == 0:
    print("worker 0 gives up", file=sys.stderr)
    sys.exit(3)
  hang()
