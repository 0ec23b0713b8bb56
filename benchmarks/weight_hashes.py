"""Weight hashes: proof that a refactor leaves training bit-identical.

Trains a fixed set of small configurations of the wrappers (Keras 3
``tf_adacomp.CompressedOptimizer``, the tf_keras ``tf_adacomp.tf_keras.CompressedOptimizer``,
``CompressedAllReduce`` cross-device ops, mixed precision) for a few steps on fixed
seeded data, and records per configuration one SHA-256 over

- the model's weights (every replica's copy of a mirrored variable, in order),
- the optimizer's variables (``optimizer.variables``; every replica's copy where the
  variable is distributed; for ``CompressedAllReduce``, its residues, counters and byte
  counts), and
- the wrapper's ``bytes_sent``,

with, for human diffing, each component's own hash and the float sum of each weight.
Run it before a refactor and after, on the same machine and environment, and compare:

    python benchmarks/weight_hashes.py --out before.json
    # ... refactor ...
    python benchmarks/weight_hashes.py --out after.json --compare before.json

``--compare`` prints "same", "DIFFERENT" or "missing" per configuration and exits 1 if
any differ; ``--only a,b`` runs only the named configurations (``--list`` names them).
Two runs of the same code give the same hashes (TF_DETERMINISTIC_OPS=1, fixed seeds,
one intra-op thread, ``shuffle=False``); a hash depends on the TensorFlow, Keras and
NumPy versions and on XLA_FLAGS, which the JSON's "meta" records and ``--compare``
checks. A configuration that raises is recorded as "error: ..." and the run goes on.
"""

import argparse
import hashlib
import inspect
import json
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_DETERMINISTIC_OPS"] = "1"
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # the CPU's numbers, on any machine
# As in tests/conftest.py: LLVM's optimisation passes cost more compile time than they
# save on these few steps. Part of the recorded environment (meta): set by the tool
# itself so that every run of it compiles the same way.
_XLA_OPT = "--xla_backend_optimization_level"
if _XLA_OPT not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_XLA_OPT}=0".strip()

import numpy as np  # pylint: disable=wrong-import-position
import tensorflow as tf  # pylint: disable=wrong-import-position

LOGICAL_CPUS = 4
# Before TensorFlow starts: 4 logical CPU devices (MirroredStrategy with real
# collectives on one CPU, as in tests/conftest.py), one intra-op thread (a kernel's
# reduction is split the same way whatever the machine's core count).
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration() for _ in range(LOGICAL_CPUS)])
tf.config.threading.set_intra_op_parallelism_threads(1)

import keras  # pylint: disable=wrong-import-position
import tf_keras  # pylint: disable=wrong-import-position

import tf_adacomp  # pylint: disable=wrong-import-position
from tf_adacomp import tf_keras as adacomp_tf_keras  # pylint: disable=wrong-import-position

SEED = 0
FEATURES, CLASSES = 64, 10
BATCH = 32        # global batch: 16 rows per replica on 2, 8 on 4
STEPS = 8         # with local_steps=4: two rounds end
VOCABULARY, TOKENS = 1000, 4
TWO = ["/cpu:0", "/cpu:1"]
FOUR = [f"/cpu:{i}" for i in range(LOGICAL_CPUS)]


# --- Data, models ------------------------------------------------------------------


def _data(embedding=False):
  """Fixed rows of a seeded RNG: (x, y), STEPS * BATCH of them."""
  rng = np.random.default_rng(SEED)
  rows = STEPS * BATCH
  if embedding:
    x = rng.integers(0, VOCABULARY, size=(rows, TOKENS)).astype("int32")
    y = (x[:, 0] % CLASSES).astype("int32")
  else:
    x = rng.random((rows, FEATURES), dtype=np.float32)
    y = rng.integers(0, CLASSES, size=rows).astype("int32")
  return x, y


def _keras_model(embedding=False):
  """64 -> 256 -> 32 -> 10 (the 16k-element kernel is compressed by AdaComp), or an
  Embedding(1000, 16) (16k rows' elements, an IndexedSlices gradient) -> Dense(10)."""
  keras.utils.set_random_seed(SEED)
  if embedding:
    return keras.Sequential([keras.Input([TOKENS], dtype="int32"),
                             keras.layers.Embedding(VOCABULARY, 16),
                             keras.layers.Flatten(), keras.layers.Dense(CLASSES)])
  return keras.Sequential([keras.Input([FEATURES]),
                           keras.layers.Dense(256, activation="relu"),
                           keras.layers.Dense(32, activation="relu"),
                           # float32 logits under mixed_float16 (Keras' advice)
                           keras.layers.Dense(CLASSES, dtype="float32")])


def _tf_keras_model():
  tf_keras.utils.set_random_seed(SEED)
  return tf_keras.Sequential([tf_keras.layers.Dense(256, activation="relu",
                                                    input_shape=(FEATURES,)),
                              tf_keras.layers.Dense(32, activation="relu"),
                              tf_keras.layers.Dense(CLASSES)])


def _strategy(devices, cross_device_ops=None):
  if devices is None:  # one replica: the default strategy
    return tf.distribute.get_strategy()
  return tf_adacomp.distribute.mirrored_strategy(devices=devices,
                                                 cross_device_ops=cross_device_ops)


# --- Reading state ------------------------------------------------------------------


def _components(variable):
  """Each replica's copy of ``variable`` as NumPy arrays (one for a plain variable)."""
  if isinstance(variable, keras.Variable):
    variable = variable.value
  if isinstance(variable, tf.distribute.DistributedValues):
    return [np.asarray(v.numpy()) for v in variable.values]
  return [np.asarray(variable.numpy())]


def _digest(arrays):
  digest = hashlib.sha256()
  for array in arrays:
    array = np.ascontiguousarray(array)
    digest.update(f"{array.dtype.str}{array.shape}".encode())
    digest.update(array.tobytes())
  return digest.hexdigest()


def _optimizer_variables(optimizer):
  variables = optimizer.variables
  return list(variables() if callable(variables) else variables)


def _all_reduce_state(ops):
  """A ``CompressedAllReduce``'s residues, step counters and byte counts, by key."""
  arrays = []
  for key in sorted(ops.residues):
    for device_state in ops.residues[key]:
      for variable in device_state:
        arrays.append(variable.numpy())
  for table in (ops.steps, ops.nbytes):
    for key in sorted(table):
      arrays.append(table[key].numpy())
  return arrays


def _record(model, optimizer_arrays, bytes_sent):
  weights = [a for v in model.weights for a in _components(v)]
  bytes_array = np.asarray(bytes_sent if bytes_sent is not None else [], np.int64)
  return {
      "hash": _digest(weights + optimizer_arrays + [bytes_array]),
      "weights_hash": _digest(weights),
      "optimizer_hash": _digest(optimizer_arrays),
      "optimizer_arrays": len(optimizer_arrays),
      "bytes_sent": bytes_array.tolist(),
      "weight_sums": [float(np.sum(w, dtype=np.float64)) for w in model.get_weights()],
  }


# --- Runs ---------------------------------------------------------------------------


def keras_run(make_optimizer, devices=TWO, embedding=False, mixed=False):
  """Keras 3: ``make_optimizer()`` compiled into the model under a MirroredStrategy over
  ``devices`` (None: no strategy), fitted STEPS steps."""
  previous = keras.mixed_precision.global_policy()
  if mixed:
    keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    x, y = _data(embedding)
    with _strategy(devices).scope():
      model = _keras_model(embedding)
      optimizer = make_optimizer()
      model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  finally:
    keras.mixed_precision.set_global_policy(previous)
  # model.optimizer: the LossScaleOptimizer that compile put around it, with mixed_float16.
  arrays = [a for v in _optimizer_variables(model.optimizer) for a in _components(v)]
  sent = getattr(optimizer, "bytes_sent", None)
  return _record(model, arrays, None if sent is None else sent.numpy())


def compressed(inner, make_outer=None, **options):
  """A factory of ``CompressedOptimizer(inner(), **options)``, called in the strategy's
  scope (the inner and outer optimizers' variables are the strategy's), every exchange
  compressed (``dense_when_faster=False``, where the library has it)."""
  def make():
    outer = {} if make_outer is None else {"outer_optimizer": make_outer()}
    if "dense_when_faster" in inspect.signature(tf_adacomp.CompressedOptimizer).parameters:
      # Its default follows measured times: not the same from one run to the next.
      outer["dense_when_faster"] = False
    return tf_adacomp.CompressedOptimizer(inner(), **options, **outer)
  return make


def sgd_momentum():
  return keras.optimizers.SGD(0.1, momentum=0.9)


def cross_device_ops_run():
  """Plain Keras SGD with momentum, the strategy's reductions through
  ``CompressedAllReduce`` (the strategy keeps a copy of the ops: ``of`` finds it)."""
  x, y = _data()
  strategy = _strategy(TWO, tf_adacomp.CompressedAllReduce())
  with strategy.scope():
    model = _keras_model()
    model.compile(sgd_momentum(), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  ops = tf_adacomp.CompressedAllReduce.of(strategy)
  arrays = [a for v in _optimizer_variables(model.optimizer) for a in _components(v)]
  sent = ops.bytes_sent()
  return _record(model, arrays + _all_reduce_state(ops), [sent[k] for k in sorted(sent)])


def tf_keras_run(make_inner, **options):
  """tf_keras: ``tf_adacomp.tf_keras.CompressedOptimizer(make_inner(), **options)`` on 2
  replicas."""
  x, y = _data()
  with _strategy(TWO).scope():
    model = _tf_keras_model()
    optimizer = adacomp_tf_keras.CompressedOptimizer(make_inner(), **options)
    model.compile(optimizer, tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  arrays = [a for v in _optimizer_variables(optimizer) for a in _components(v)]
  return _record(model, arrays, optimizer.bytes_sent.numpy())


CONFIGURATIONS = {
    "sgd_mom_updates": lambda: keras_run(compressed(sgd_momentum)),
    "sgd_mom_gradients": lambda: keras_run(compressed(sgd_momentum, exchange="gradients")),
    "adam_global": lambda: keras_run(compressed(lambda: keras.optimizers.Adam(1e-3))),
    "adam_shared_after": lambda: keras_run(compressed(
        lambda: keras.optimizers.Adam(1e-3), second_moment="shared", precondition="after")),
    "adam_local": lambda: keras_run(compressed(lambda: keras.optimizers.Adam(1e-3),
                                               second_moment="local")),
    "adamw_local_steps": lambda: keras_run(compressed(lambda: keras.optimizers.AdamW(1e-3),
                                                      local_steps=4)),
    "sgd_local_steps_diloco": lambda: keras_run(compressed(
        sgd_momentum, local_steps=4, make_outer=tf_adacomp.local_steps.diloco)),
    "hierarchy_4": lambda: keras_run(compressed(sgd_momentum, devices_per_worker=2),
                                     devices=FOUR),
    "adasum_gradients": lambda: keras_run(compressed(
        lambda: keras.optimizers.SGD(0.1), reduction="adasum", exchange="gradients")),
    "adasum_updates": lambda: keras_run(compressed(
        lambda: keras.optimizers.SGD(0.1), reduction="adasum", exchange="updates")),
    "momentum_masking": lambda: keras_run(compressed(sgd_momentum, momentum_masking=True)),
    "warmup_clip": lambda: keras_run(compressed(sgd_momentum, start_step=3,
                                                local_clipnorm=1.0)),
    "embedding_adam_global": lambda: keras_run(
        compressed(lambda: keras.optimizers.Adam(1e-3)), embedding=True),
    "embedding_sgd_gradients": lambda: keras_run(
        compressed(sgd_momentum, exchange="gradients"), embedding=True),
    "one_replica_none": lambda: keras_run(
        compressed(lambda: keras.optimizers.Adam(1e-3), compressor="none"), devices=None),
    "ema": lambda: keras_run(compressed(
        lambda: keras.optimizers.SGD(0.1, momentum=0.9, use_ema=True))),
    "topk": lambda: keras_run(compressed(sgd_momentum, compressor="topk")),
    "fp16": lambda: keras_run(compressed(sgd_momentum, compressor="fp16")),
    "tfk_sgd_updates": lambda: tf_keras_run(
        lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9)),
    "tfk_adam_updates_clip": lambda: tf_keras_run(
        lambda: tf_keras.optimizers.Adam(1e-3), local_clipnorm=0.5),
    "tfk_adam_gradients": lambda: tf_keras_run(
        lambda: tf_keras.optimizers.Adam(1e-3), exchange="gradients"),
    "tfk_legacy_sgd": lambda: tf_keras_run(
        lambda: tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9), exchange="gradients"),
    "cross_device_ops": cross_device_ops_run,
    "mixed_float16": lambda: keras_run(compressed(sgd_momentum), mixed=True),
}


def meta():
  """What a hash depends on besides the code: two files' hashes compare only if equal."""
  return {"tensorflow": tf.__version__, "keras": keras.__version__,
          "tf_keras": tf_keras.__version__, "numpy": np.__version__,
          "python": sys.version.split()[0], "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}


def run(names):
  """{"meta", "hashes": name -> hash or "error: ...", "details": name -> dict}."""
  hashes, details = {}, {}
  for name in names:
    start = time.perf_counter()
    try:
      detail = CONFIGURATIONS[name]()
      hashes[name] = detail.pop("hash")
    except Exception as error:  # pylint: disable=broad-except
      # Recorded, not raised: the other configurations still get their hashes.
      lines = traceback.format_exception_only(type(error), error)
      hashes[name] = "error: " + " ".join(line.strip() for line in lines)[:2000]
      detail = {}
    detail["seconds"] = round(time.perf_counter() - start, 2)
    details[name] = detail
    shown = hashes[name] if hashes[name].startswith("error") else hashes[name][:16]
    print(f"{name:26s} {shown}  {detail['seconds']:.1f}s", flush=True)
  return {"meta": meta(), "hashes": hashes, "details": details}


def compare(new, old):
  """Prints, per configuration, same / DIFFERENT / missing; returns whether any differ."""
  if new["meta"] != old.get("meta"):
    print(f"note: environments differ (hashes may too): {old.get('meta')} -> {new['meta']}")
  differ = False
  old_hashes = old["hashes"]
  for name in list(new["hashes"]) + [n for n in old_hashes if n not in new["hashes"]]:
    if name not in old_hashes or name not in new["hashes"]:
      side = "in the old file" if name not in old_hashes else "in this run"
      print(f"{name:26s} missing ({side})")
    elif old_hashes[name] == new["hashes"][name]:
      both_failed = " (error in both)" if old_hashes[name].startswith("error") else ""
      print(f"{name:26s} same{both_failed}")
    else:
      differ = True
      parts = [part for part in ("weights_hash", "optimizer_hash", "bytes_sent")
               if old.get("details", {}).get(name, {}).get(part)
               != new["details"][name].get(part)]
      print(f"{name:26s} DIFFERENT ({', '.join(parts) or 'hash'})")
  return differ


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", help="JSON file to write")
  parser.add_argument("--compare", help="an earlier run's JSON: exit 1 if a hash differs")
  parser.add_argument("--only", help="comma-separated configuration names")
  parser.add_argument("--list", action="store_true", help="print the configurations' names")
  args = parser.parse_args(argv)
  if args.list:
    print("\n".join(CONFIGURATIONS))
    return 0
  if not args.out:
    parser.error("--out is required")
  names = list(CONFIGURATIONS)
  if args.only:
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown:
      parser.error(f"unknown configuration(s) {unknown}; known: {list(CONFIGURATIONS)}")
  start = time.perf_counter()
  result = run(names)
  result["meta"]["seconds"] = round(time.perf_counter() - start, 1)
  print(f"{len(names)} configurations in {result['meta']['seconds']:.0f}s")
  with open(args.out, "w", encoding="utf-8") as file:
    json.dump(result, file, indent=1)
  if args.compare:
    with open(args.compare, encoding="utf-8") as file:
      old = json.load(file)
    old.get("meta", {}).pop("seconds", None)
    new = dict(result, meta={k: v for k, v in result["meta"].items() if k != "seconds"})
    return 1 if compare(new, old) else 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
