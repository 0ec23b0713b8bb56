"""The hierarchical exchange (tf_adacomp/hierarchy.py, Exchange.replica_exchange).

In one process, a MirroredStrategy over the 4 logical CPUs of conftest.py is told that
consecutive devices share a worker (2 workers x 2 devices, or 1 x 4). The same on 2
processes x 2 devices over gRPC is in tests/test_hierarchy_multi_worker.py.
"""

import logging
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from adasum_reference import np_adasum
from tf_adacomp import collective_keys
from tf_adacomp import hierarchy as hierarchy_lib

DEVICES = [f"/cpu:{i}" for i in range(4)]
SHAPES = ([300], [7, 5], [40])


def _strategy(replicas):
  return tf_adacomp.distribute.mirrored_strategy(devices=DEVICES[:replicas])


def _exchange(strategy, hierarchy, compressor, grads_of, states_of=None, reduction="sum",
              dense=None):
  """One ``replica_exchange`` on every replica: ``(sums, old states, new states, nbytes)``,
  each ``[replica][gradient]`` NumPy arrays (states: the residue, or an empty array)."""
  compressor = tf_adacomp.get_compressor(compressor)
  plans = [compressor.plan(tf.TensorShape(s), tf.float32, f"v{k}") for k, s in enumerate(SHAPES)]
  exchange = tf_adacomp.Exchange(compressor, reduction)

  def initial_states(replica):
    states = [tuple(compressor.init(p)) for p in plans]
    return states if states_of is None else states_of(replica, plans, states)

  @tf.function
  def run():
    def step():
      replica = tf.distribute.get_replica_context().replica_id_in_sync_group
      states = initial_states(replica)
      out = exchange.replica_exchange(plans, grads_of(replica, plans), states,
                                      None if dense is None else tf.constant(dense),
                                      hierarchy=hierarchy)
      first = lambda state: state[0] if state else tf.zeros([0])  # noqa: E731
      return (out.sums, [first(s) for s in states], [first(s) for s in out.states],
              out.nbytes)
    return strategy.run(step)

  results = run()
  return [[[local.numpy() for local in strategy.experimental_local_results(value)]
           for value in values] for values in results]


def _per_replica(values):
  """``[gradient][replica]`` -> ``[replica][gradient]``."""
  return [list(r) for r in zip(*values)]


def _integer_grads(replica, plans):
  # Distinct small integers per replica and element: every sum is exact in float32.
  return [tf.reshape(tf.cast((tf.range(p.num_elements) * (replica + 3)) % 17 - 8, tf.float32),
                     p.shape) for p in plans]


def _numpy_integer_grads(replica):
  return [np.reshape(((np.arange(int(np.prod(s))) * (replica + 3)) % 17 - 8).astype(np.float32),
                     s) for s in SHAPES]


# --- Which replicas share a worker ---------------------------------------------------------


def test_resolve_groups_consecutive_devices_of_a_mirrored_strategy():
  strategy = _strategy(4)
  assert hierarchy_lib.resolve(strategy, None, None) is None  # one host: the flat exchange
  assert hierarchy_lib.resolve(strategy, False, 2) is None
  found = hierarchy_lib.resolve(strategy, None, 2)
  assert (found.workers, found.devices_per_worker) == (2, 2)
  assert [found.position(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  assert [found.position(r).leads for r in range(4)] == [True, False, True, False]
  everything = hierarchy_lib.resolve(strategy, True, None)
  assert (everything.workers, everything.devices_per_worker) == (1, 4)
  assert hierarchy_lib.resolve(strategy, None, 1) is None


@pytest.mark.parametrize("hierarchical, devices_per_worker, error, match", [
    ("yes", None, ValueError, r"`hierarchical`.*Received: hierarchical='yes'"),
    (1, None, ValueError, r"`hierarchical`.*Received: hierarchical=1"),
    (None, 0, ValueError, r"`devices_per_worker` must be >= 1.*Received: devices_per_worker=0"),
    (None, 2.0, TypeError, r"`devices_per_worker` must be an int.*devices_per_worker=2.0"),
])
def test_bad_hierarchy_arguments_are_refused_by_name(hierarchical, devices_per_worker, error,
                                                     match):
  with pytest.raises(error, match=match):
    tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1), hierarchical=hierarchical,
                                   devices_per_worker=devices_per_worker)


def test_devices_per_worker_that_does_not_divide_the_replicas_is_refused_when_built():
  strategy = _strategy(4)
  with pytest.raises(ValueError, match=r"divide the strategy's 4 replicas.*"
                                       r"Received: devices_per_worker=3"):
    hierarchy_lib.resolve(strategy, None, 3)
  with strategy.scope():
    optimizer = tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1), devices_per_worker=3)
    with pytest.raises(ValueError, match=r"devices_per_worker=3"):
      optimizer.build([keras.Variable(np.zeros([3], np.float32))])


def _layout_warnings(caplog):
  return [r.getMessage() for r in caplog.records
          if r.name == "tf_adacomp" and "devices_per_worker" in r.getMessage()]


def test_a_saved_devices_per_worker_that_does_not_fit_falls_back_with_a_warning(caplog):
  # What from_config passes (a .keras file saved on 2 workers x 2 devices, restored onto
  # 3 or 1 replicas): the layout it would be without devices_per_worker, and one line.
  saved = hierarchy_lib.saved_devices_per_worker(2)
  assert saved == 2 and isinstance(saved, int)
  assert hierarchy_lib.check_devices_per_worker(saved) is saved  # stays marked
  assert hierarchy_lib.saved_devices_per_worker(None) is None
  for replicas, hierarchical, expected, used in (
      (3, None, None, "the flat exchange"), (3, True, (1, 3), "one worker of 3 devices"),
      (1, None, None, "the flat exchange"), (1, True, None, "the flat exchange")):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tf_adacomp"):
      found = hierarchy_lib.resolve(_strategy(replicas), hierarchical, saved)
    assert (found if found is None else (found.workers, found.devices_per_worker)) == expected
    lines = _layout_warnings(caplog)
    assert len(lines) == 1, lines
    assert (f"saved with devices_per_worker=2, which does not divide this strategy's "
            f"{replicas} replica") in lines[0] and used in lines[0], lines
  # hierarchical=False: the flat exchange either way, nothing to say.
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="tf_adacomp"):
    assert hierarchy_lib.resolve(_strategy(3), False, saved) is None
  assert not _layout_warnings(caplog)
  # One that fits is used, silently; the user's own that does not fit is still refused.
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="tf_adacomp"):
    found = hierarchy_lib.resolve(_strategy(4), None, saved)
  assert (found.workers, found.devices_per_worker) == (2, 2) and not _layout_warnings(caplog)
  with pytest.raises(ValueError, match=r"divide the strategy's 3 replicas"):
    hierarchy_lib.resolve(_strategy(3), None, 2)


class _MultiWorkerOf2Devices(tf.distribute.MultiWorkerMirroredStrategy):
  """What ``resolve`` reads of a MultiWorkerMirroredStrategy of 2 workers x 2 devices
  (a real one would configure this process' collectives for a cluster)."""

  def __init__(self):  # pylint: disable=super-init-not-called
    pass

  num_replicas_in_sync = 4
  extended = type("Extended", (), {"worker_devices": ("/cpu:0", "/cpu:1")})()


def test_a_saved_devices_per_worker_under_multi_worker_becomes_the_strategys_own(caplog):
  strategy = _MultiWorkerOf2Devices()
  with caplog.at_level(logging.WARNING, logger="tf_adacomp"):
    found = hierarchy_lib.resolve(strategy, None, hierarchy_lib.saved_devices_per_worker(4))
  assert (found.workers, found.devices_per_worker) == (2, 2)
  lines = _layout_warnings(caplog)
  assert len(lines) == 1 and "devices_per_worker=4" in lines[0], lines
  assert "its 2 devices per worker" in lines[0], lines
  with pytest.raises(ValueError, match=r"devices per worker \(2.*devices_per_worker=4"):
    hierarchy_lib.resolve(strategy, None, 4)


@pytest.mark.parametrize("value, error", [(0, ValueError), (2.0, TypeError), (True, TypeError)])
def test_a_bad_saved_devices_per_worker_is_refused_by_name(value, error):
  with pytest.raises(error, match=rf"`devices_per_worker`.*Received: devices_per_worker={value}"):
    hierarchy_lib.saved_devices_per_worker(value)


def test_group_keys_stay_clear_of_every_strategys_own():
  # mirrored_strategy's k-th strategy numbers its groups from k * 100,000 + 1, TensorFlow's
  # own from 1: the hierarchy's keys (its base .. base + workers) must be none of those
  # (the whole key space: tests/test_collective_keys.py).
  step = collective_keys.KEY_BLOCK
  for _ in range(3):
    hierarchy = hierarchy_lib.Hierarchy(collective_keys.MAX_HIERARCHY_WORKERS, 2)
    low = hierarchy._key_base  # pylint: disable=protected-access
    high = low + hierarchy.workers
    block = low // step
    assert block >= 1 and high // step == block
    # Strategies reach a few hundred keys into their block; these start half-way.
    assert low - block * step >= 50_000
    assert high < 2**31


def test_hierarchy_arguments_survive_get_config():
  optimizer = tf_adacomp.CompressedOptimizer(keras.optimizers.SGD(0.1), hierarchical=False,
                                             devices_per_worker=2)
  config = optimizer.get_config()
  assert (config["hierarchical"], config["devices_per_worker"]) == (False, 2)
  again = tf_adacomp.CompressedOptimizer.from_config(config)
  assert (again.hierarchical, again.devices_per_worker) == (False, 2)


# --- The exchange ----------------------------------------------------------------------


def test_no_compression_is_exact_and_the_same_on_every_replica():
  strategy = _strategy(4)
  hierarchy = hierarchy_lib.resolve(strategy, None, 2)
  sums, _, _, nbytes = _exchange(strategy, hierarchy, "none", _integer_grads)
  expected = [sum(g) for g in zip(*(_numpy_integer_grads(r) for r in range(4)))]
  for k, per_replica in enumerate(sums):
    for value in per_replica:
      np.testing.assert_array_equal(value, expected[k])
  # Each worker's first device counts the worker's bytes; the others sent nothing.
  for per_replica in nbytes:
    assert per_replica[1] == per_replica[3] == 0 and per_replica[0] > 0


def _with_residues(replica, plans, states):
  # A residue on every replica (as after a restore, which splits the saved total evenly),
  # exact in float32.
  out = []
  for grad, plan, state in zip(_integer_grads(replica, plans), plans, states):
    where = tf_adacomp.compressors.base.residue_position(state, plan.shape)
    state = list(state)
    state[where] = grad / 4.0
    out.append(tuple(state))
  return out


@pytest.mark.parametrize("compressor", [  # the whole suite only (fast: the exact exchange's)
    pytest.param("adacomp", marks=pytest.mark.slow), pytest.param("topk", marks=pytest.mark.slow)])
def test_error_feedback_total_is_kept_and_lives_on_each_workers_first_device(compressor):
  strategy = _strategy(4)
  hierarchy = hierarchy_lib.resolve(strategy, None, 2)
  sums, old, new, _ = _exchange(strategy, hierarchy, compressor, _integer_grads,
                                _with_residues)
  grads = _numpy_integer_grads
  for k in range(len(SHAPES)):
    for value in sums[k][1:]:
      np.testing.assert_array_equal(value, sums[k][0])  # bit-identical replicas
    # What was sent plus what is held back is what there was: gradients and residues.
    before = sum(grads(r)[k] for r in range(4)) + sum(old[k])
    np.testing.assert_allclose(sums[k][0] + sum(new[k]), before, atol=1e-5)
    assert not np.array_equal(sums[k][0], before)  # something was held back
    # The second device of each worker handed its residue to the first.
    assert not np.any(new[k][1]) and not np.any(new[k][3])
    assert np.any(old[k][1])


@pytest.mark.slow  # the warm-up's route (start_step) through the same collectives
def test_a_warm_up_step_sends_float32_sums_and_keeps_the_residues():
  strategy = _strategy(4)
  hierarchy = hierarchy_lib.resolve(strategy, None, 2)
  sums, old, new, _ = _exchange(strategy, hierarchy, "adacomp", _integer_grads,
                                _with_residues, dense=True)
  expected = [sum(g) for g in zip(*(_numpy_integer_grads(r) for r in range(4)))]
  for k in range(len(SHAPES)):
    # A warm-up step sends the float32 sums whole: the gradients, and the residues the
    # second devices hand over; the first devices keep theirs.
    handed_over = old[k][1] + old[k][3]
    for value in sums[k]:
      np.testing.assert_array_equal(value, expected[k] + handed_over)
    np.testing.assert_array_equal(new[k][0], old[k][0])
    np.testing.assert_array_equal(new[k][2], old[k][2])
    assert not np.any(new[k][1]) and not np.any(new[k][3])


@pytest.mark.slow  # five exchanges, each traced and compiled
def test_bytes_per_worker_do_not_depend_on_its_number_of_devices():
  # Each worker's gradient is the same sum whatever its devices (split exactly among
  # them): the hierarchical exchange sends the same bytes per worker; the flat one one
  # payload per device.
  def split_grads(devices):
    def grads_of(replica, plans):
      del replica
      return [g / devices for g in _integer_grads(tf.constant(5), plans)]
    return grads_of

  per_worker = {}
  for replicas, devices in ((2, 1), (4, 2), (4, 4)):
    strategy = _strategy(replicas)
    hierarchy = hierarchy_lib.resolve(strategy, True, devices)
    _, _, _, nbytes = _exchange(strategy, hierarchy, "adacomp", split_grads(devices))
    per_worker[devices] = sum(int(per_replica[0]) for per_replica in nbytes)
    if devices > 1:
      _, _, _, flat = _exchange(strategy, None, "adacomp", split_grads(devices))
      flat_per_worker = sum(int(sum(per_replica[:devices])) for per_replica in flat)
      assert flat_per_worker > 1.5 * per_worker[devices], (flat_per_worker, per_worker)
  assert per_worker[1] == per_worker[2] == per_worker[4] > 0, per_worker


@pytest.mark.slow  # the leaders' all-gather of summable payloads: Adasum's route only
def test_adasum_combines_the_workers_means():
  strategy = _strategy(4)
  hierarchy = hierarchy_lib.resolve(strategy, None, 2)
  sums, _, _, _ = _exchange(strategy, hierarchy, "none", _integer_grads, reduction="adasum")
  grads = [_numpy_integer_grads(r) for r in range(4)]
  for k in range(len(SHAPES)):
    means = [(grads[0][k] + grads[1][k]) / 2, (grads[2][k] + grads[3][k]) / 2]
    expected = np_adasum([m.astype(np.float64) for m in means]).reshape(SHAPES[k])
    for value in sums[k]:
      np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-5)
      np.testing.assert_array_equal(value, sums[k][0])


def test_eager_replicas_are_refused_with_advice():
  strategy = _strategy(4)
  hierarchy = hierarchy_lib.resolve(strategy, None, 2)

  def step():
    compressor = tf_adacomp.get_compressor("none")
    plan = compressor.plan(tf.TensorShape([3]), tf.float32, "v")
    return tf_adacomp.Exchange(compressor).replica_exchange(
        [plan], [tf.ones([3])], [()], hierarchy=hierarchy).sums

  with pytest.raises(RuntimeError, match="only inside a tf.function.*hierarchical=False"):
    strategy.run(step)


# --- Under model.fit ---------------------------------------------------------------------


def _fit(optimizer, replicas=4, steps=4, run_eagerly=False):
  # pylint: disable-next=g-import-not-at-top
  from replica_harness import data, fit_on_shards, linear_model
  strategy = _strategy(replicas)
  x, y = data(replicas, steps)
  with strategy.scope():
    net = linear_model()
    net.compile(optimizer=optimizer(), loss="mse", run_eagerly=run_eagerly)
  fit_on_shards(net, strategy, replicas, x, y, 0, steps)
  return net, strategy


_PLAIN_SGD = {}


def _plain_sgd_weights():
  """Plain Keras' SGD(0.1) fit on the 4 replicas: the same for every exchange, so fitted
  once per process (a 4-replica fit is mostly Keras tracing its step on each replica)."""
  if "weights" not in _PLAIN_SGD:
    plain, _ = _fit(lambda: keras.optimizers.SGD(0.1))
    _PLAIN_SGD["weights"] = plain.get_weights()
  return [np.copy(w) for w in _PLAIN_SGD["weights"]]


@pytest.mark.slow  # the exchange tests above cover the collectives; this is model.fit's path
@pytest.mark.parametrize("exchange, local_steps", [
    ("gradients", 1), ("updates", 1), ("updates", 2)])
def test_fit_keeps_replicas_identical_and_without_compression_trains_as_keras(exchange,
                                                                            local_steps):
  from replica_harness import replica_weights  # pylint: disable=g-import-not-at-top
  net, strategy = _fit(lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.SGD(0.1), "adacomp", exchange=exchange, local_steps=local_steps,
      devices_per_worker=2))
  assert net.optimizer.hierarchy.workers == 2
  for copies in replica_weights(net, strategy):  # 4 steps: 2 whole rounds of 2
    for copy in copies[1:]:
      np.testing.assert_array_equal(copy, copies[0])
  if local_steps > 1:
    return
  plain = _plain_sgd_weights()
  uncompressed, _ = _fit(lambda: tf_adacomp.CompressedOptimizer(
      keras.optimizers.SGD(0.1), "none", exchange=exchange, devices_per_worker=2))
  for a, b in zip(uncompressed.get_weights(), plain):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# --- CompressedAllReduce ---------------------------------------------------------------


def _all_reduce(replicas, devices_per_worker, compressor, grads_of):
  """``ctx.all_reduce(SUM)`` of every replica's gradients through a CompressedAllReduce:
  ``([gradient][replica] results, bytes one sender sent in all)``."""
  ops = tf_adacomp.CompressedAllReduce(compressor, devices_per_worker=devices_per_worker)
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES[:replicas],
                                                     cross_device_ops=ops)
  plans = [tf_adacomp.get_compressor("none").plan(tf.TensorShape(s), tf.float32, "v")
           for s in SHAPES]

  @tf.function
  def run():
    def step():
      replica = tf.distribute.get_replica_context().replica_id_in_sync_group
      return tf.distribute.get_replica_context().all_reduce(
          tf.distribute.ReduceOp.SUM, grads_of(replica, plans))
    return strategy.run(step)

  results = [[local.numpy() for local in strategy.experimental_local_results(value)]
             for value in run()]
  # Bytes per worker: what one sender sent, times the senders of a worker (a group's
  # first device alone, or each of its devices).
  senders = {len(per_sender) for per_sender in ops.residues.values()}
  assert senders == {replicas // (devices_per_worker or 1)}, senders
  return results, sum(ops.bytes_sent().values())


@pytest.mark.slow  # the fast tier keeps the optimizer's hierarchy; this is the cross-device ops'
def test_compressed_all_reduce_groups_are_exact_without_compression_and_identical():
  results, _ = _all_reduce(4, 2, "none", _integer_grads)
  expected = [sum(g) for g in zip(*(_numpy_integer_grads(r) for r in range(4)))]
  for k, per_replica in enumerate(results):
    for value in per_replica:
      np.testing.assert_array_equal(value, expected[k])
  adacomp, _ = _all_reduce(4, 2, "adacomp", _integer_grads)
  for per_replica in adacomp:
    for value in per_replica[1:]:
      np.testing.assert_array_equal(value, per_replica[0])


@pytest.mark.slow  # three strategies; the grouping itself is in the fast test above
def test_compressed_all_reduce_sends_one_payload_per_group():
  def split_grads(devices):
    return lambda replica, plans: [g / devices for g in _integer_grads(tf.constant(5), plans)]

  _, one = _all_reduce(2, 1, "adacomp", split_grads(1))
  _, grouped = _all_reduce(4, 2, "adacomp", split_grads(2))
  assert one == grouped > 0  # and one sender per group (_all_reduce checks)
  with pytest.raises(ValueError, match=r"divide the strategy's 4 devices.*"
                                       r"devices_per_worker=3"):
    _all_reduce(4, 3, "adacomp", split_grads(1))


# --- No silent cliff: the all-gather's crossover (tf_adacomp/scaling.py) ---------------


@pytest.mark.slow  # two model.fit runs
def test_a_job_is_told_once_its_senders_reach_the_all_gathers_crossover(monkeypatch):
  calls = []
  real = tf_adacomp.scaling.check_allgather

  def recording(senders, payload_bytes, dense_bytes, warn=True):
    calls.append((senders, payload_bytes, dense_bytes))
    return real(senders, payload_bytes, dense_bytes, warn=warn)

  monkeypatch.setattr(tf_adacomp.scaling, "check_allgather", recording)
  for devices_per_worker, senders in ((2, 2), (None, 4)):  # the workers, or the replicas
    calls.clear()
    net, _ = _fit(lambda d=devices_per_worker: tf_adacomp.CompressedOptimizer(
        keras.optimizers.SGD(0.1), "topk", devices_per_worker=d))
    optimizer = net.optimizer
    optimizer._scaling_watch.join(timeout=60)  # pylint: disable=protected-access
    assert not optimizer._scaling_watch.is_alive()  # pylint: disable=protected-access
    assert len(calls) == 1 and calls[0][0] == senders, calls
    dense = sum(p.dense_nbytes for p in optimizer.plans if not p.summable)
    assert calls[0][2] == dense and 0 < calls[0][1] < dense, calls
    crossover = tf_adacomp.scaling.crossover_senders(calls[0][2], calls[0][1])
    assert optimizer.check_scaling(warn=False) is (senders >= crossover)
  # Before the crossover nothing is said; at it (here made 4 and 2), the job is warned.
  monkeypatch.setattr(tf_adacomp.scaling, "crossover_senders", lambda dense, payload: 5)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert optimizer.check_scaling() is False
  monkeypatch.setattr(tf_adacomp.scaling, "crossover_senders", lambda dense, payload: 2)
  with pytest.warns(tf_adacomp.scaling.AllGatherScalingWarning, match="4 senders"):
    assert optimizer.check_scaling() is True
