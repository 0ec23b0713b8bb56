"""How far a resumed run ends from an uninterrupted one, per inner optimizer state.

Under the update exchange each replica keeps its own optimizer state. A checkpoint or
``.keras`` file keeps every replica's copy (``tf_adacomp.replica_state``), which a load
onto as many replicas gives back to each: the resume is then exact (0 here), with Adam
too. This trains the 5x3 linear
model of tests/replica_harness.py on 2 CPU replicas with ``CompressedOptimizer(inner,
"none")`` for 12 steps, once straight through and once saved as ``.keras`` after 5 steps,
loaded and continued, and prints the largest weight difference at the end, per
configuration (and, with --no_bound, with the shared moment's bound between averages
switched off).

    python benchmarks/resume_drift.py --json out/resume_drift.json
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import tensorflow as tf  # pylint: disable=wrong-import-position

# Two logical CPU devices, before TensorFlow starts.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

import tf_adacomp  # pylint: disable=wrong-import-position
from tf_adacomp import shared_moment  # pylint: disable=wrong-import-position
from replica_harness import PER_REPLICA, data, linear_model  # pylint: disable=wrong-import-position

REPLICAS, STEPS, SAVED_AT = 2, 12, 5
CONFIGS = {
    "SGD(0.05, momentum=0.9)": (lambda: keras.optimizers.SGD(0.05, momentum=0.9), {}),
    "Adam(0.01), second_moment='local'": (lambda: keras.optimizers.Adam(0.01),
                                          {"second_moment": "local"}),
    "Adam(0.01), second_moment='shared'": (lambda: keras.optimizers.Adam(0.01),
                                           {"second_moment": "shared"}),
    "Adam(0.01), second_moment='global'": (lambda: keras.optimizers.Adam(0.01),
                                           {"second_moment": "global"}),
}


def run(make, options, resume, folder):
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=["/cpu:0", "/cpu:1"])
  x, y = data(REPLICAS, STEPS)
  batch = REPLICAS * PER_REPLICA
  with strategy.scope():
    model = linear_model()
    model.compile(optimizer=tf_adacomp.CompressedOptimizer(make(), "none", **options),
                  loss="mse")
  if not resume:
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    return model.get_weights()
  cut = SAVED_AT * batch
  model.fit(x[:cut], y[:cut], batch_size=batch, shuffle=False, verbose=0)
  path = os.path.join(folder, "model.keras")
  model.save(path)
  with strategy.scope():
    model = keras.models.load_model(path)
  model.fit(x[cut:], y[cut:], batch_size=batch, shuffle=False, verbose=0)
  return model.get_weights()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--json", help="write the figures to this file")
  parser.add_argument("--no_bound", action="store_true",
                      help="also run Adam's shared moments without the bound between averages")
  args = parser.parse_args()
  results = {}
  bounds = [False, True] if args.no_bound else [False]
  with tempfile.TemporaryDirectory() as folder:
    for unbounded in bounds:
      original = shared_moment.step_bound
      if unbounded:
        shared_moment.step_bound = lambda alpha, b1, b2: alpha * float("inf")
      try:
        for label, (make, options) in CONFIGS.items():
          if unbounded and "shared" not in label and "global" not in label:
            continue
          straight = run(make, options, False, folder)
          resumed = run(make, options, True, folder)
          drift = max(float(np.max(np.abs(a - b))) for a, b in zip(straight, resumed))
          key = label + (", no bound" if unbounded else "")
          results[key] = drift
          print(f"{key:48s} max |resumed - uninterrupted| = {drift:.3g}", flush=True)
      finally:
        shared_moment.step_bound = original
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump({"replicas": REPLICAS, "steps": STEPS, "saved_at": SAVED_AT,
                 "max_abs_difference": results}, f, indent=1)


if __name__ == "__main__":
  main()
