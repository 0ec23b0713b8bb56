"""Worker: ``model.fit`` with ``CompressedOptimizer`` under MultiWorkerMirroredStrategy.

Usage: ``compressed_fit.py RUN [RUN ...]``, each RUN one of
  - ``plain``: the plain SGD optimizer of ``keras_fit.py`` (no wrapper), the reference;
  - ``COMPRESSOR[:REDUCTION[:ADASUM_MODE]]``: the same SGD wrapped in
    ``tf_adacomp.CompressedOptimizer`` (a registered name, e.g. ``none`` or ``adacomp``;
    "sum" or "adasum"; "gradient" or "delta");
  - ``adam+plain``: Adam (``ADAM_LEARNING_RATE``) instead of the SGD, no wrapper;
  - ``adam+COMPRESSOR+SECOND_MOMENT[+INTERVAL]``: that Adam wrapped, with the update
    exchange, ``second_moment=SECOND_MOMENT`` ("local", "shared" or "global") and
    ``second_moment_interval=INTERVAL`` (e.g. "doubling"; default None);
  - ``local+COMPRESSOR+OUTER``: the SGD wrapped with ``local_steps=LOCAL_STEPS`` and
    ``outer_optimizer`` "average" or "nesterov" (``tf_adacomp.local_steps.diloco()``);
  - ``local+adam+COMPRESSOR``: the Adam wrapped with ``local_steps=LOCAL_STEPS`` and the
    rest of the defaults (each worker's estimate of the global second moment).

The runs train one after the other in this process, under one strategy
(``tf_adacomp.distribute.multi_worker_strategy()``): one cluster start-up for them all.
Each is the model, data and steps of ``keras_fit.py``, from the same seed. Writes to
``$MULTI_WORKER_OUT_DIR``, per run (``:`` in RUN becomes ``-``): ``{run}/worker{i}.npz``
(final weights, this worker's residues and anchors, and for an Adam inside local steps
its first and second moments and the moving average of its first moment squared) and
``{run}/worker{i}.json`` (history, with the logs of every step as ``batch_logs``,
evaluation, compression statistics of the last step, and the message of every
``tf_adacomp.UnsynchronizedWorkersWarning`` the run raised: none, under the strategy).
"""

import json
import sys
import warnings

import keras
import numpy as np

import keras_fit  # the plain multi-worker run: same model, data and steps


def run_name(run):
  """The folder of ``run``'s results (``adacomp:adasum:delta`` -> ``adacomp-adasum-delta``)."""
  return run.replace(":", "-")


ADAM_LEARNING_RATE = 0.01
# multi_worker_strategy's heartbeat timeout (checked: workers write what TensorFlow has).
HEARTBEAT_S = 45
# Rounds of local steps: the 10 steps of keras_fit.py end two rounds, at each epoch's end.
LOCAL_STEPS = 5


def _adam_optimizer(run):
  import tf_adacomp  # pylint: disable=g-import-not-at-top

  if run.startswith("local+adam+"):
    return tf_adacomp.CompressedOptimizer(keras.optimizers.Adam(ADAM_LEARNING_RATE),
                                          run.split("+")[2], local_steps=LOCAL_STEPS)
  _, compressor, *moment = run.split("+")
  inner = keras.optimizers.Adam(ADAM_LEARNING_RATE)
  if compressor == "plain":
    return inner
  return tf_adacomp.CompressedOptimizer(inner, compressor, exchange="updates",
                                        second_moment=moment[0],
                                        second_moment_interval=(moment + [None])[1])


def train(strategy, run, x, y):
  """One run: returns (model, history, evaluation)."""
  import tf_adacomp  # pylint: disable=g-import-not-at-top

  keras.utils.set_random_seed(0)
  with strategy.scope():
    model = keras_fit.make_model()  # compiled with the plain SGD
    if run.startswith(("adam+", "local+adam+")):
      model.compile(optimizer=_adam_optimizer(run),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"])
    elif run.startswith("local+"):
      _, compressor, outer = run.split("+")
      model.compile(
          optimizer=tf_adacomp.CompressedOptimizer(
              keras.optimizers.SGD(keras_fit.LEARNING_RATE), compressor,
              local_steps=LOCAL_STEPS,
              outer_optimizer=(tf_adacomp.local_steps.diloco() if outer == "nesterov"
                               else outer)),
          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
          metrics=["accuracy"])
    elif run != "plain":
      compressor, reduction, adasum_mode = (run.split(":") + ["sum", "gradient"])[:3]
      model.compile(
          optimizer=tf_adacomp.CompressedOptimizer(
              keras.optimizers.SGD(keras_fit.LEARNING_RATE), compressor, reduction=reduction,
              adasum_mode=adasum_mode),
          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
          metrics=["accuracy"])
  batch_logs = BatchLogs()
  history, evaluation = keras_fit.fit(model, x, y, callbacks=[batch_logs])
  return model, dict(history, batch_logs=batch_logs.logs), evaluation


class BatchLogs(keras.callbacks.Callback):
  """The logs every step hands the callbacks (``{name: value}`` per step)."""

  def __init__(self):
    super().__init__()
    self.logs = []

  def on_train_batch_end(self, batch, logs=None):
    self.logs.append({k: float(v) for k, v in sorted((logs or {}).items())})


def _record_unsynchronized_warnings():
  """A list that collects the message of every UnsynchronizedWorkersWarning from now on
  (each one, not the first per place), still shown on stderr as usual."""
  import tf_adacomp  # pylint: disable=g-import-not-at-top

  caught = []
  show = warnings.showwarning

  def record(message, category, *args, **kwargs):
    if issubclass(category, tf_adacomp.UnsynchronizedWorkersWarning):
      caught.append(str(message))
    show(message, category, *args, **kwargs)

  warnings.showwarning = record
  warnings.simplefilter("always", tf_adacomp.UnsynchronizedWorkersWarning)
  return caught


def _held(variable):
  """This worker's value of ``variable`` (its one replica's, where it is per replica)."""
  if hasattr(variable.value, "values"):
    return variable.value.values[0].numpy()
  return variable.numpy()


def _adam_moments(optimizer):
  """``{name_i: array}``: the inner Adam's first and second moments (``m_i``, ``v_i``) and
  ``w_i``, of an Adam inside local steps that estimates the global second moment."""
  from tf_adacomp import shared_moment  # pylint: disable=g-import-not-at-top

  if not getattr(optimizer, "estimates_own_moment", False):
    return {}
  momentums, velocities = shared_moment.moment_slots(optimizer.inner_optimizer)
  found = {}
  for name, slots in (("m", momentums), ("v", velocities),
                      ("w", optimizer.momentum_squares)):
    found.update({f"{name}_{i}": _held(x) for i, x in enumerate(slots)})
  return found


def _heartbeat_timeout_ms():
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  return context.context().coordination_service.heartbeat_timeout_in_ms


def main():
  from multi_worker import worker_index, worker_out_dir  # pylint: disable=g-import-not-at-top
  from tf_adacomp.distribute import multi_worker_strategy  # pylint: disable=g-import-not-at-top

  runs = sys.argv[1:]
  if not runs:
    raise SystemExit("usage: compressed_fit.py RUN [RUN ...]")
  strategy = multi_worker_strategy(heartbeat_timeout=HEARTBEAT_S)
  x, y = keras_fit.load_digits()
  index = worker_index()
  unsynchronized = _record_unsynchronized_warnings()
  for run in runs:
    unsynchronized.clear()
    model, history, evaluation = train(strategy, run, x, y)
    residues = [_held(r) for state in getattr(model.optimizer, "residues", ())
                for r in state]
    shared = [_held(v) for v in getattr(model.optimizer, "shared_velocities", ())]
    anchors = [_held(v) for v in getattr(model.optimizer, "anchors", ())]
    out = worker_out_dir() / run_name(run)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"worker{index}.npz",
             **{f"final_{i}": w for i, w in enumerate(model.get_weights())},
             **{f"residue_{i}": r for i, r in enumerate(residues)},
             **{f"shared_velocity_{i}": v for i, v in enumerate(shared)},
             **{f"anchor_{i}": a for i, a in enumerate(anchors)},
             **_adam_moments(model.optimizer))
    stats = (model.optimizer.compression_stats()
             if hasattr(model.optimizer, "compression_stats") else None)
    with open(out / f"worker{index}.json", "w") as f:
      json.dump({"run": run, "history": history, "evaluation": evaluation,
                 "heartbeat_timeout_ms": _heartbeat_timeout_ms(),
                 "replicas": strategy.num_replicas_in_sync, "stats": stats,
                 "unsynchronized_warnings": list(unsynchronized)}, f)
    print(f"worker {index}: {run} trained, history {history}", flush=True)


if __name__ == "__main__":
  main()
