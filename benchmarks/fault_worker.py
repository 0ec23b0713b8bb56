"""One worker of benchmarks/faults.py: ``model.fit`` with ``CompressedOptimizer(AdaComp)``
and ``tf_adacomp.BackupAndRestore``, with faults injected on request.

Under ``MultiWorkerMirroredStrategy`` (``TF_CONFIG`` set) or, with ``--replicas N``,
``MirroredStrategy`` over N logical CPUs in this process. Faults:

- ``--kill_at_step S --kill_worker W``: worker W sends itself SIGKILL once the optimizer
  has taken S steps (mid-epoch when S is not a multiple of the epoch's steps);
- ``--kill_during_save K --kill_worker W``: worker W dies while writing its K-th
  backup (after half the file is written, before it is renamed into place);
- ``--stall_at_step S --kill_worker W``: worker W sleeps ``--stall_seconds`` there,
  alive (TensorFlow's heartbeats go on): only the collective timeout can end the
  others' wait.

``--local_steps H`` (with ``--outer_optimizer average|nesterov``; nesterov is
``tf_adacomp.local_steps.diloco()``) runs rounds of H local steps: between round ends
each worker holds its own weights, and a backup taken mid-round stores the chief's.

Writes ``worker{index}.json`` to ``--out_dir``: the step it resumed at, the residue
totals it restored and those of every backup saved (summed over all replicas: what a
checkpoint stores), a digest of its weights after restoring and at the end, test
accuracy, the residue norm and resident memory over time, whether its replicas stayed
bit-identical, and on failure the error and when it was raised (``time.time()``; a
killed worker records when it killed itself). With ``--local_steps`` > 1 also the steps
at which rounds ended (the steps that sent bytes), and digests of the anchors and of
the outer optimizer's variables: as each backup file holds them (read back from the
file just written), the anchors as this worker held them when saving, and both as it
holds them after restoring.
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import time
import types


OUTER_OPTIMIZERS = ("average", "nesterov")


def positive_int(name):
  """An argparse type: an int >= 1, or an error naming ``--name`` and the value."""
  def parse_value(text):
    try:
      value = int(text)
    except ValueError:
      value = 0
    if value < 1:
      raise argparse.ArgumentTypeError(f"--{name} must be an integer >= 1. Received: "
                                       f"--{name}={text!r}")
    return value
  return parse_value


def parse(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--model", default="mlp", choices=("mlp", "cnn"))
  parser.add_argument("--data", default="digits", choices=("digits", "fashion_mnist"))
  parser.add_argument("--replicas", type=int, default=0,
                      help="MirroredStrategy over this many logical CPUs (0: TF_CONFIG)")
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--steps_per_epoch", type=int, default=10)
  parser.add_argument("--batch_size", type=int, default=64, help="global")
  parser.add_argument("--learning_rate", type=float, default=0.05)
  parser.add_argument("--save_freq", type=int, default=4, help="batches between backups")
  parser.add_argument("--backup_dir", required=True,
                      help="'{worker}' in it becomes the worker's index (a folder each: "
                           "the mistake BackupAndRestore must catch)")
  parser.add_argument("--kill_worker", type=int, default=1)
  parser.add_argument("--kill_at_step", type=int, default=-1)
  parser.add_argument("--kill_during_save", type=int, default=-1)
  parser.add_argument("--stall_at_step", type=int, default=-1,
                      help="worker --kill_worker sleeps here (alive, heartbeats going)")
  parser.add_argument("--stall_seconds", type=float, default=120.0)
  parser.add_argument("--collective_timeout", type=float, default=None,
                      help="seconds; multi_worker_strategy(collective_timeout=...)")
  parser.add_argument("--local_steps", type=positive_int("local_steps"), default=1,
                      help="steps per round (CompressedOptimizer(local_steps=...))")
  parser.add_argument("--outer_optimizer", default="average", choices=OUTER_OPTIMIZERS,
                      help="the round's outer step: the mean, or DiLoCo's Nesterov SGD "
                           "(tf_adacomp.local_steps.diloco())")
  parser.add_argument("--record_every", type=int, default=0,
                      help="steps between residue-norm and memory records (0: none)")
  parser.add_argument("--out_dir", required=True)
  return parser.parse_args(argv)


def load(data, seed=0):
  """``(x_train, y_train, x_test, y_test)`` as float32 images and int32 labels."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  if data == "digits":
    from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    return x[:1400], y[:1400], x[1400:], y[1400:]
  from tf_adacomp.examples import fashion_mnist  # pylint: disable=g-import-not-at-top
  arrays = fashion_mnist.load_arrays(types.SimpleNamespace(data_dir=None))
  (x, y), (xt, yt) = arrays["train"], arrays["test"]
  scale = lambda images: (images.astype("float32") / 255.0)[..., None]
  return scale(x), y.astype("int32"), scale(xt), yt.astype("int32")


def build(model, shape):
  import keras  # pylint: disable=g-import-not-at-top
  if model == "mlp":
    layers = [keras.layers.Flatten(), keras.layers.Dense(256, activation="relu"),
              keras.layers.Dense(10)]
  else:  # the Fashion-MNIST CNN of examples/fashion_mnist.py
    layers = [keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
              keras.layers.MaxPooling2D(), keras.layers.Conv2D(64, 3, padding="same",
                                                               activation="relu"),
              keras.layers.MaxPooling2D(), keras.layers.Flatten(),
              keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]
  return keras.Sequential([keras.Input(shape), *layers], name=f"faults_{model}")


def digest(arrays):
  h = hashlib.sha256()
  for a in arrays:
    h.update(a.tobytes())
  return h.hexdigest()[:16]


def local_copies(variable):
  """This worker's copies of ``variable``, one per local replica (no collective: a
  cross-replica read of an on-read variable would reduce over every worker)."""
  value = variable.value if hasattr(variable, "value") else variable
  if hasattr(value, "values"):
    return [c.numpy() for c in value.values]
  return [value.numpy()]


def stored_digest(path, indices):
  """Digest of the optimizer variables ``indices`` (positions in ``optimizer.variables``)
  as the Keras weights file ``path`` stores them (``optimizer/vars/<i>``)."""
  import h5py  # pylint: disable=g-import-not-at-top
  with h5py.File(path, "r") as f:
    return digest([f[f"optimizer/vars/{i}"][()] for i in indices])


def rss_mib():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv=None):
  args = parse(argv)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if args.replicas:
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(args.replicas)])
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tf_adacomp  # pylint: disable=g-import-not-at-top

  if args.replicas:
    strategy = tf_adacomp.distribute.mirrored_strategy(
        devices=[f"/cpu:{i}" for i in range(args.replicas)])
    index = 0
  else:
    strategy = tf_adacomp.distribute.multi_worker_strategy(
        num_workers=len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]),
        collective_timeout=args.collective_timeout)
    index = strategy.cluster_resolver.task_id
  record = {"worker": index, "replicas": strategy.num_replicas_in_sync, "saves": [],
            "records": [], "round_ends": [], "pid": os.getpid()}
  out = os.path.join(args.out_dir, f"worker{index}.json")

  def write():
    with open(out + ".partial", "w") as f:
      json.dump(record, f)
    os.replace(out + ".partial", out)

  def die(**what):
    record.update(killed_at=time.time(), **what)
    write()
    os.kill(os.getpid(), signal.SIGKILL)

  keras.utils.set_random_seed(0)
  x, y, x_test, y_test = load(args.data)
  with strategy.scope():
    model = build(args.model, x.shape[1:])
    outer = (tf_adacomp.local_steps.diloco() if args.outer_optimizer == "nesterov"
             else "average")
    model.compile(optimizer=tf_adacomp.CompressedOptimizer(
        keras.optimizers.SGD(args.learning_rate, momentum=0.9), "adacomp",
        local_steps=args.local_steps, outer_optimizer=outer),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  optimizer = model.optimizer
  rounds = args.local_steps > 1

  def state_indices():
    """Positions in ``optimizer.variables`` (the order a weights file stores them in) of
    the anchors and of the outer optimizer's variables (none with one local step)."""
    variables = optimizer.variables
    find = lambda wanted: [i for i, v in enumerate(variables) if any(v is w for w in wanted)]
    outer_variables = [] if outer == "average" else optimizer.outer_optimizer.variables
    return find(getattr(optimizer, "anchors", [])), find(outer_variables)

  def held_digest(indices):
    """Digest of those variables as this worker holds them (its first replica's copy)."""
    variables = optimizer.variables
    return digest([local_copies(variables[i])[0] for i in indices])

  def residue_totals():
    # A cross-replica read of a residue is the sum over all replicas (a collective under
    # MultiWorkerMirroredStrategy: every worker reads at the same step).
    return [np.asarray(r.numpy(), np.float64) for state in optimizer.residues for r in state
            if tf.as_dtype(r.dtype).is_floating]

  def replicas_identical():
    return all(all(np.array_equal(v.value.values[0].numpy(), c.numpy())
                   for c in v.value.values[1:])
               for v in model.trainable_variables if hasattr(v.value, "values"))

  saves = {"count": 0}
  real_save_weights = model.save_weights

  def save_weights(path, overwrite=True):
    saves["count"] += 1
    totals = residue_totals()  # what this save stores (read before: a collective)
    if args.kill_during_save == saves["count"] and index == args.kill_worker:
      real_save_weights(path, overwrite=overwrite)
      size = os.path.getsize(path)
      with open(path, "r+b") as f:  # a write cut off half way
        f.truncate(size // 2)
      die(step=int(optimizer.iterations.numpy()), during_save=saves["count"])
    weights = digest(model.get_weights())  # this worker's own: mid-round, its local ones
    real_save_weights(path, overwrite=overwrite)
    save = {"step": int(optimizer.iterations.numpy()),
            "residue_sums": [float(t.sum()) for t in totals],
            "residue_digest": digest([t.astype(np.float32) for t in totals]),
            "weights_digest": weights}
    if rounds:  # what the file holds, read back from it: the backup a resume reads
      anchors, outer_state = state_indices()
      save.update(anchor_digest=stored_digest(path, anchors),
                  outer_digest=stored_digest(path, outer_state),
                  # The anchor every replica holds: the file should hold it bit for bit.
                  anchor_held_digest=held_digest(anchors))
    record["saves"].append(save)

  model.save_weights = save_weights

  class Probe(keras.callbacks.Callback):
    """Records the restored state, kills on request, records norms and memory."""

    def on_train_begin(self, logs=None):
      if not optimizer.built:
        optimizer.build(model.trainable_variables)
      totals = residue_totals()
      record.update(resumed_at=int(optimizer.iterations.numpy()),
                    restored_weights=digest([w for w in model.get_weights()]),
                    restored_residue_sums=[float(t.sum()) for t in totals],
                    restored_residue_digest=digest([t.astype(np.float32) for t in totals]),
                    started=time.time())
      if rounds:
        anchors, outer_state = state_indices()
        record.update(restored_anchor_digest=held_digest(anchors),
                      restored_outer_digest=held_digest(outer_state))
      write()

    def on_train_batch_end(self, batch, logs=None):
      step = int(optimizer.iterations.numpy())
      if rounds and int(np.sum(optimizer.bytes_sent.numpy())) > 0:
        record["round_ends"].append(step)  # only a round's end sends anything
      if step == args.kill_at_step and index == args.kill_worker:
        die(step=step)
      if step == args.stall_at_step and index == args.kill_worker:
        record.update(stalled_at=time.time(), step=step)
        write()
        time.sleep(args.stall_seconds)  # then its next collective fails: peers are gone
      if args.record_every and step % args.record_every == 0:
        norm = float(np.sqrt(sum(float(np.sum(t * t)) for t in residue_totals())))
        record["records"].append({"step": step, "residue_norm": norm, "rss_mib": rss_mib(),
                                  "replicas_identical": replicas_identical(),
                                  "loss": float(logs["loss"]) if logs else None})

  backup = tf_adacomp.BackupAndRestore(args.backup_dir.replace("{worker}", str(index)),
                                       save_freq=args.save_freq, delete_checkpoint=False)
  data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(args.batch_size)
  try:
    model.fit(data, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
              callbacks=[backup, Probe()], verbose=0, shuffle=False)
  except Exception as error:  # pylint: disable=broad-except
    record.update(error=type(error).__name__, message=str(error)[:4000], failed_at=time.time())
    write()
    sys.exit(1)
  logits = model.predict(x_test, batch_size=500, verbose=0)
  record.update(steps=int(optimizer.iterations.numpy()),
                accuracy=float(np.mean(np.argmax(logits, -1) == y_test)),
                final_weights=digest(model.get_weights()),
                replicas_identical=replicas_identical(), finished=time.time())
  write()


if __name__ == "__main__":
  main()
