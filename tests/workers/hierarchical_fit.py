"""Worker: the hierarchical exchange on 2 local devices per worker, over gRPC.

Usage: ``hierarchical_fit.py`` (no arguments). Makes 2 logical CPU devices, then
``tf_adacomp.distribute.multi_worker_strategy(devices_per_worker=2)``, and writes to
``$MULTI_WORKER_OUT_DIR/worker{i}.npz`` and ``worker{i}.json``:

- ``exchange_{compressor}_*``: one ``Exchange.replica_exchange`` with the strategy's
  hierarchy, on gradients made from each replica's global id (integers, so that every
  sum is exact), and non-zero residues on every replica: each local replica's decoded
  totals, old and new residues and bytes (``replica{r}_...``, r the local index);
- ``fit_{run}_*``: final weights of ``model.fit`` (the digits model of ``keras_fit.py``)
  with ``CompressedOptimizer`` run ``hierarchical`` (default), ``flat``
  (``hierarchical=False``) or ``none`` (no compression, hierarchical), each replica's
  copy of every weight; the json has each run's history, evaluation and bytes sent.
"""

import json

import numpy as np

DEVICES = 2
SHAPES = ([300], [7, 5], [40])  # AdaComp: two bin sizes (a dense and a vector kind)


def exchange_arrays(strategy, hierarchy, compressor_name):
  """The exchange of integer gradients with residues: ``{name: array}`` per local replica."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_adacomp  # pylint: disable=g-import-not-at-top

  compressor = tf_adacomp.get_compressor(compressor_name)
  plans = [compressor.plan(tf.TensorShape(s), tf.float32, f"v{k}") for k, s in enumerate(SHAPES)]
  exchange = tf_adacomp.exchange.Exchange(compressor)

  def grads_of(replica):
    # Distinct integers per replica and element: exact in float32, and AdaComp sends some.
    return [tf.reshape(tf.cast((tf.range(p.num_elements) * (replica + 3)) % 17 - 8, tf.float32),
                       p.shape) for p in plans]

  def states_of(replica):
    states = []
    for grad, plan in zip(grads_of(replica), plans):
      state = list(compressor.init(plan))
      where = tf_adacomp.compressors.base.residue_position(state, plan.shape)
      if where is not None:
        state[where] = tf.cast(grad, state[where].dtype) / 4.0  # exact, non-zero
      states.append(tuple(state))
    return states

  @tf.function
  def run():
    def step():
      ctx = tf.distribute.get_replica_context()
      replica = ctx.replica_id_in_sync_group
      grads, states = grads_of(replica), states_of(replica)
      out = exchange.replica_exchange(plans, grads, states, hierarchy=hierarchy)
      first = lambda state: state[0] if state else tf.zeros([0])  # noqa: E731 (stateless)
      return (out.sums, [first(s) for s in out.states], [first(s) for s in states],
              out.nbytes)
    return strategy.run(step)

  sums, new_states, old_states, nbytes = run()
  arrays = {}
  for name, values in (("sum", sums), ("new_state", new_states), ("old_state", old_states),
                       ("nbytes", nbytes)):
    for k, value in enumerate(values):
      for r, local in enumerate(strategy.experimental_local_results(value)):
        arrays[f"exchange_{compressor_name}_replica{r}_{name}_{k}"] = local.numpy()
  # Every replica's gradients, for the reference sums.
  for replica in range(strategy.num_replicas_in_sync):
    for k, grad in enumerate(grads_of(tf.constant(replica))):
      arrays[f"exchange_{compressor_name}_grad{replica}_{k}"] = grad.numpy()
  return arrays


def fit_arrays(strategy, run, x, y):
  import keras  # pylint: disable=g-import-not-at-top
  import tf_adacomp  # pylint: disable=g-import-not-at-top
  import keras_fit  # pylint: disable=g-import-not-at-top

  keras.utils.set_random_seed(0)
  with strategy.scope():
    model = keras_fit.make_model()
    model.compile(
        optimizer=tf_adacomp.CompressedOptimizer(
            keras.optimizers.SGD(keras_fit.LEARNING_RATE),
            "none" if run == "none" else "adacomp", exchange="gradients",
            hierarchical=False if run == "flat" else None),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
  history, evaluation = keras_fit.fit(model, x, y)
  arrays = {}
  for k, weight in enumerate(model.weights):
    for r, local in enumerate(strategy.experimental_local_results(weight.value)):
      arrays[f"fit_{run}_replica{r}_weight{k}"] = local.numpy()
  log = {"history": history, "evaluation": evaluation,
         "bytes_sent": int(np.sum(model.optimizer.bytes_sent.numpy())),
         "hierarchy": repr(model.optimizer.hierarchy)}
  return arrays, log


def main():
  from multi_worker import worker_index, worker_out_dir  # pylint: disable=g-import-not-at-top
  import tf_adacomp  # pylint: disable=g-import-not-at-top

  # Built under the strategy, the optimizer must not warn that the worker trains alone
  # (issue 42): as an error, a false alarm fails the job.
  import warnings  # pylint: disable=g-import-not-at-top
  warnings.simplefilter("error", tf_adacomp.UnsynchronizedWorkersWarning)
  tf_adacomp.distribute.split_logical_devices(DEVICES)
  strategy = tf_adacomp.distribute.multi_worker_strategy(devices_per_worker=DEVICES,
                                                         heartbeat_timeout=45)
  import keras_fit  # pylint: disable=g-import-not-at-top

  hierarchy = tf_adacomp.hierarchy.resolve(strategy, None, None)
  arrays, logs = {}, {"replicas": strategy.num_replicas_in_sync, "hierarchy": repr(hierarchy),
                      "devices": list(strategy.extended.worker_devices)}
  import sys  # pylint: disable=g-import-not-at-top
  parts = sys.argv[1:] or ["exchange", "hierarchical", "flat", "none"]
  if "exchange" in parts:
    for compressor in ("none", "adacomp"):
      arrays.update(exchange_arrays(strategy, hierarchy, compressor))
  x, y = keras_fit.load_digits()
  for run in [p for p in parts if p != "exchange"]:
    fitted, logs[run] = fit_arrays(strategy, run, x, y)
    arrays.update(fitted)
  index = worker_index()
  np.savez(worker_out_dir() / f"worker{index}.npz", **arrays)
  with open(worker_out_dir() / f"worker{index}.json", "w") as f:
    json.dump(logs, f)
  print(f"worker {index}: done", flush=True)


if __name__ == "__main__":
  main()
