"""Canaries of the private Keras and TensorFlow names tf_adacomp relies on.

One test per name of ``tf_adacomp/compat/internals.py``'s list. Each uses the real
attribute on a real strategy, model or optimizer the way the package does and checks
that the result is what the package needs, so an upstream change of behaviour fails
here as surely as a rename; the failure names the private name, its user and the
installed versions (``canaries.fail``).

The names only a multi-worker cluster exercises (``_in_multi_worker_mode``,
``_collective_all_reduce_multi_worker``) and the functions the Keras fix wraps are
canaried in ``test_keras_multi_worker.py``; ``LossScaleOptimizer.check_finite`` in
``test_loss_scale.py``.
"""

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import canaries
import tf_adacomp
from tf_adacomp import cross_device_ops
from tf_adacomp.compat import internals
from tf_adacomp.compat import patches

ROOT = pathlib.Path(__file__).resolve().parents[2]
CPUS = ["/cpu:0", "/cpu:1"]


def _mirrored(**kwargs):
  return tf_adacomp.distribute.mirrored_strategy(devices=CPUS, **kwargs)


def _built(optimizer, *shapes):
  variables = [keras.Variable(np.zeros(shape, np.float32)) for shape in shapes or ([3],)]
  optimizer.build(variables)
  return optimizer, variables


def _module(name, user):
  with canaries.watching(f"module `{name}`", user):
    return __import__(name, fromlist=["_"])


# --- Accessors of compat/internals.py ------------------------------------------------------


def test_cross_device_ops_of_is_what_the_strategy_reduces_with():
  name, user = "`MirroredExtended._cross_device_ops`", "internals.cross_device_ops_of"
  ops = tf.distribute.ReductionToOneDevice()
  with canaries.watching(name, user):
    found = internals.cross_device_ops_of(_mirrored(cross_device_ops=ops))
  canaries.require(found is ops, name, user,
                   f"expected the CrossDeviceOps given to MirroredStrategy, got {found!r}")
  canaries.require(
      isinstance(internals.cross_device_ops_of(_mirrored()), tf.distribute.CrossDeviceOps),
      name, user, "a MirroredStrategy made without cross_device_ops has its default ones")
  assert internals.cross_device_ops_of(object()) is None


def test_own_collective_keys_per_strategy_gives_each_strategy_its_own_group_keys():
  name = "`MirroredStrategy._collective_key_base`"
  user = "internals.own_collective_keys_per_strategy (tf_adacomp.distribute)"
  cls = tf.distribute.MirroredStrategy
  with canaries.watching(name, user):
    # tf_adacomp.distribute installed it on import; installing again changes nothing.
    internals.own_collective_keys_per_strategy(lambda: 0)
    first, second = cls(CPUS), cls(CPUS)
    keys = [s.extended._collective_keys.get_group_key(CPUS) for s in (first, second)]  # pylint: disable=protected-access
  canaries.require(keys[0] != keys[1] and min(keys) > 1, name, user,
                   f"read by MirroredExtended.__init__ as the first group key: two "
                   f"strategies over the same devices got group keys {keys}")
  canaries.require(cls._collective_key_base == 0, name, user,  # pylint: disable=protected-access
                   "read on the class, TensorFlow's base")


def test_own_collective_keys_per_strategy_covers_the_v1_mirrored_strategy():
  name = "`MirroredStrategyV1._collective_key_base` (tf.compat.v1.distribute.MirroredStrategy)"
  user = "internals.own_collective_keys_per_strategy (tf_adacomp.distribute)"
  with canaries.watching(name, user):
    mirrored_strategy = _module("tensorflow.python.distribute.mirrored_strategy", user)
    cls = tf.compat.v1.distribute.MirroredStrategy
    # A class of its own (were it a subclass, the v2 descriptor would already cover it):
    # TensorFlow's own attribute, which the descriptor replaced.
    canaries.require(cls is mirrored_strategy.MirroredStrategyV1
                     and not issubclass(cls, tf.distribute.MirroredStrategy)
                     and "_collective_key_base" in vars(cls), name, user,
                     f"expected MirroredStrategyV1, no MirroredStrategy subclass, with its "
                     f"own `_collective_key_base`; got {cls!r} (MRO {cls.__mro__})")
    internals.own_collective_keys_per_strategy(lambda: 0)  # idempotent
    first, second = cls(CPUS), cls(CPUS[:1])
    keys = [s.extended._collective_keys.get_group_key(s.extended.worker_devices)  # pylint: disable=protected-access
            for s in (first, second)]
  canaries.require(keys[0] != keys[1] and min(keys) > 1, name, user,
                   f"read by MirroredExtended.__init__ as the first group key: two v1 "
                   f"strategies got group keys {keys}")
  canaries.require(cls._collective_key_base == 0, name, user,  # pylint: disable=protected-access
                   "read on the class, TensorFlow's base")


def test_flatten_layers_gives_every_nested_layer():
  name, user = "`Layer._flatten_layers`", "internals.flatten_layers (resist.model)"
  inner = keras.Sequential([keras.layers.Dense(2, name="nested_dense")], name="inner")
  inputs = keras.Input([3])
  model = keras.Model(inputs, inner(keras.layers.Dense(3, name="top_dense")(inputs)))
  with canaries.watching(name, user):
    names = [layer.name for layer in internals.flatten_layers(model)]
    first = internals.flatten_layers(model, include_self=True)[0]
  canaries.require("nested_dense" in names and "top_dense" in names and model.name not in names,
                   name, user, f"expected nested layers without the model, got {names}")
  canaries.require(first is model, name, user, "include_self=True puts the model first")


def test_own_distribute_strategy_is_the_strategy_the_model_was_made_under():
  name, user = "`TensorFlowTrainer._distribute_strategy`", "internals.own_distribute_strategy"
  with canaries.watching(name, user):
    outside = internals.own_distribute_strategy(keras.Sequential([keras.layers.Dense(1)]))
    strategy = _mirrored()
    with strategy.scope():
      inside = internals.own_distribute_strategy(keras.Sequential([keras.layers.Dense(1)]))
  canaries.require(outside is None, name, user,
                   f"None for a model made outside any scope, got {outside!r}")
  canaries.require(inside is strategy, name, user,
                   f"the strategy of the scope the model was made in, got {inside!r}")


def test_set_initial_epoch_is_where_a_starting_fit_begins():
  # Keras' fit reads `_initial_epoch` after on_train_begin, where backup.BackupAndRestore
  # sets it: a fit of 3 epochs set to start at 2 runs one.
  name, user = "`Model._initial_epoch`", "internals.set_initial_epoch (backup)"
  model = keras.Sequential([keras.Input([2]), keras.layers.Dense(1)])
  model.compile(optimizer="sgd", loss="mse")
  epochs = []

  class StartAtTwo(keras.callbacks.Callback):

    def on_train_begin(self, logs=None):
      internals.set_initial_epoch(self.model, 2)

    def on_epoch_begin(self, epoch, logs=None):
      epochs.append(epoch)

  with canaries.watching(name, user):
    model.fit(np.zeros([4, 2]), np.zeros([4, 1]), epochs=3, verbose=0,
              callbacks=[StartAtTwo()])
  canaries.require(epochs == [2], name, user,
                   f"fit(epochs=3) set to start at 2 ran epochs {epochs}, not [2]")


# The start of a fresh process's code: a TF_CONFIG cluster of one worker on a free port.
ONE_WORKER_TF_CONFIG = textwrap.dedent("""
    import json, os, socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{port}"]},
                                          "task": {"type": "worker", "index": 0}})
    """)


def _result_lines_of_a_fresh_process(code):
  """Runs ``code`` in a new Python process (TensorFlow not yet started, no TF_CONFIG):
  its stdout lines starting with "RESULT", and the end of its stderr."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  env.pop("TF_CONFIG", None)
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)
  return ([line for line in result.stdout.splitlines() if line.startswith("RESULT")],
          result.stderr[-2000:])


def test_called_by_tf_keras_h5_writer_is_true_inside_the_writer_alone():
  import h5py  # pylint: disable=g-import-not-at-top
  import tf_keras  # pylint: disable=g-import-not-at-top
  name = f"`{internals.TF_KERAS_H5_MODULE}.{internals.TF_KERAS_H5_WRITER}`"
  user = "internals.called_by_tf_keras_h5_writer (tf_keras.CompressedOptimizer.variables)"
  seen = []

  class Asking(tf_keras.optimizers.SGD):
    @property
    def variables(self):
      seen.append(internals.called_by_tf_keras_h5_writer())
      return []

  optimizer = Asking()
  with canaries.watching(name, user):
    writer = getattr(_module(internals.TF_KERAS_H5_MODULE, user), internals.TF_KERAS_H5_WRITER)
    with h5py.File("in-memory.h5", "w", driver="core", backing_store=False) as f:
      writer(f, optimizer)
  canaries.require(seen == [True], name, user,
                   f"the writer should read optimizer.variables once; it asked {seen}")
  optimizer.variables  # pylint: disable=pointless-statement
  canaries.require(seen == [True, False], name, user, "outside the writer: False")


@pytest.mark.slow  # a process of its own
def test_eager_context_initialized_before_and_after_the_runtime_starts():
  # A process of its own: this one started TensorFlow's runtime long ago.
  name, user = "`tensorflow.python.eager.context.Context._initialized`", \
      "internals.eager_context_initialized (xla_cache.enable)"
  code = textwrap.dedent("""
      import tensorflow as tf
      from tf_adacomp.compat import internals
      before = internals.eager_context_initialized()
      tf.constant(1.0)
      print("RESULT", before, internals.eager_context_initialized())
      """)
  lines, stderr = _result_lines_of_a_fresh_process(code)
  canaries.require(lines == ["RESULT False True"], name, user,
                   f"expected False before the first op and True after; got {lines} "
                   f"(stderr: {stderr})")


@pytest.mark.slow  # a process of its own, with a cluster of one worker
def test_configure_coordination_service_is_kept_by_the_strategy():
  name, user = ("`context().configure_coordination_service`, "
                "`multi_worker_util.coordination_leader`, `CoordinatedJob`",
                "internals.configure_coordination_service (multi_worker_strategy's "
                "heartbeat_timeout)")
  code = ONE_WORKER_TF_CONFIG + textwrap.dedent("""
      import tensorflow as tf
      from tensorflow.python.eager import context
      from tf_adacomp.compat import internals
      spec = tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec()
      internals.configure_coordination_service(spec, 42000)
      strategy = tf.distribute.MultiWorkerMirroredStrategy()
      config = context.context().coordination_service
      print("RESULT", config.heartbeat_timeout_in_ms, config.service_type,
            strategy.num_replicas_in_sync)
      """)
  lines, stderr = _result_lines_of_a_fresh_process(code)
  canaries.require(lines == ["RESULT 42000 standalone 1"], name, user,
                   f"expected the strategy to keep a heartbeat timeout of 42000 ms; got "
                   f"{lines} (stderr: {stderr})")


@pytest.mark.slow  # a process of its own, with a cluster of one worker
def test_multi_worker_local_devices_are_the_strategys_devices():
  name, user = ("`CollectiveAllReduceExtended._initialize_local_devices`",
                "internals.multi_worker_local_devices (multi_worker_strategy's "
                "devices_per_worker)")
  code = ONE_WORKER_TF_CONFIG + textwrap.dedent("""
      import tensorflow as tf
      from tf_adacomp import distribute
      from tf_adacomp.compat import internals
      distribute.split_logical_devices(3)
      with internals.multi_worker_local_devices("CPU", 3):
          strategy = tf.distribute.MultiWorkerMirroredStrategy()
      print("RESULT", strategy.num_replicas_in_sync,
            [d.rsplit("/", 1)[1] for d in strategy.extended.worker_devices])
      """)
  lines, stderr = _result_lines_of_a_fresh_process(code)
  canaries.require(lines == ["RESULT 3 ['device:CPU:0', 'device:CPU:1', 'device:CPU:2']"],
                   name, user, f"expected a worker of 3 CPU devices; got {lines} "
                   f"(stderr: {stderr})")


def test_keras_tensorflow_trainer_holds_what_the_fix_wraps():
  name, user = f"module `{internals.KERAS_TENSORFLOW_TRAINER}`", "compat.keras_multi_worker"
  with canaries.watching(name, user):
    trainer = internals.keras_tensorflow_trainer()
  for attribute in ("TensorFlowTrainer", "reduce_per_replica",
                    "_collective_all_reduce_multi_worker"):
    canaries.require(callable(getattr(trainer, attribute, None)), name, user,
                     f"it has no `{attribute}`")
  canaries.require(keras.Model.__mro__.count(trainer.TensorFlowTrainer) == 1, name, user,
                   "keras.Model is a TensorFlowTrainer (the class the fix patches)")


# --- Names used in place: optimizer.py -------------------------------------------------------


def _apply_per_replica_gradients(strategy, optimizer, variable):
  """One ``optimizer.apply`` in every replica, replica r with the gradient r + 1."""

  @tf.function
  def step():
    def replica_fn():
      replica = tf.distribute.get_replica_context().replica_id_in_sync_group
      optimizer.apply([tf.cast(replica + 1, tf.float32) * tf.ones([2])], [variable])
    strategy.run(replica_fn)

  step()


@pytest.mark.parametrize("make", [keras.optimizers.SGD, keras.optimizers.Adam,
                                  keras.optimizers.AdamW, keras.optimizers.RMSprop])
def test_all_reduce_sum_gradients_is_the_only_all_reduce_of_apply(make):
  """CompressedOptimizer switches the inner optimizer's all-reduce off by replacing this
  method on the instance: with it, the replicas' copies agree; without it, each replica
  applies its own gradient (no other all-reduce is left to double the sum)."""
  name = "`Optimizer._all_reduce_sum_gradients`"
  user = f"optimizer.ALL_REDUCE_HOOK ({make.__name__}), resist.trainer"
  copies = {}
  for hooked in (True, False):
    strategy = _mirrored()
    with strategy.scope():
      variable = keras.Variable(np.zeros([2], np.float32))
      optimizer = make(0.1)
      optimizer.build([variable])
    if not hooked:
      with canaries.watching(name, user):
        getattr(optimizer, "_all_reduce_sum_gradients")
      # As steps.inner.build switches it off: the package's instance patch.
      patches.patch_instance(optimizer, internals.ALL_REDUCE_SUMMED, list)

    with canaries.watching(name, user):
      _apply_per_replica_gradients(strategy, optimizer, variable)
    copies[hooked] = [c.numpy() for c in strategy.experimental_local_results(variable.value)]
  canaries.require(np.array_equal(*copies[True]), name, user,
                   f"with the method in place the replicas' copies agree: {copies[True]}")
  canaries.require(not np.array_equal(*copies[False]), name, user,
                   f"replaced by an identity, nothing all-reduces the gradients: "
                   f"{copies[False]}")


@pytest.mark.parametrize("make, attribute, first_moment", [
    (lambda: keras.optimizers.SGD(0.1, momentum=0.9), "momentums", lambda g: -0.1 * g),
    (lambda: keras.optimizers.Adam(0.1, beta_1=0.9), "_momentums", lambda g: 0.1 * g),
    (lambda: keras.optimizers.AdamW(0.1, beta_1=0.9), "_momentums", lambda g: 0.1 * g),
], ids=["SGD", "Adam", "AdamW"])
def test_first_moment_slots_hold_the_first_moment_in_variable_order(make, attribute,
                                                                     first_moment):
  """Momentum masking (steps.momentum_masking.first_moment_slots) zeroes these slots where a value
  was sent: after one step from zeros they hold SGD's velocity (-lr * g) or Adam's
  first moment ((1 - beta_1) * g), in the order of ``_get_variable_index``."""
  name, user = f"`{attribute}`", "steps.momentum_masking.first_moment_slots (momentum masking)"
  optimizer, variables = _built(make(), [3], [2])
  grads = [tf.constant([1.0, -2.0, 4.0]), tf.constant([0.5, 8.0])]
  optimizer.apply(grads, variables)
  with canaries.watching(name, user):
    slots = getattr(optimizer, attribute)
    for variable, grad in zip(variables, grads):
      slot = slots[optimizer._get_variable_index(variable)]  # pylint: disable=protected-access
      canaries.require(np.allclose(slot.numpy(), first_moment(grad.numpy()), rtol=1e-5), name,
                       user, f"after one step with {grad.numpy()} it holds {slot.numpy()}")


@pytest.mark.parametrize("make", [lambda: keras.optimizers.Adam(0.1, beta_1=0.9, beta_2=0.99),
                                  lambda: keras.optimizers.AdamW(0.1, beta_1=0.9, beta_2=0.99)],
                         ids=["Adam", "AdamW"])
def test_moment_slots_hold_adams_moments_in_variable_order(make):
  """The shared second moment (shared_moment.moment_slots) reads and writes these: after
  one step from zeros they hold (1 - beta_1) g and (1 - beta_2) g^2."""
  from tf_adacomp import shared_moment  # pylint: disable=g-import-not-at-top

  name, user = "`_momentums`/`_velocities`", "shared_moment.moment_slots"
  optimizer, variables = _built(make(), [3], [2])
  grads = [tf.constant([1.0, -2.0, 4.0]), tf.constant([0.5, 8.0])]
  optimizer.apply(grads, variables)
  with canaries.watching(name, user):
    momentums, velocities = shared_moment.moment_slots(optimizer)
    for variable, grad in zip(variables, grads):
      index = optimizer._get_variable_index(variable)  # pylint: disable=protected-access
      g = grad.numpy()
      for slot, want in ((momentums[index], 0.1 * g), (velocities[index], 0.01 * g * g)):
        canaries.require(np.allclose(slot.numpy(), want, rtol=1e-5), name, user,
                         f"after one step with {g} a slot holds {slot.numpy()}, not {want}")


def test_uses_weight_decay_follows_exclude_from_weight_decay():
  name, user = "`Optimizer._use_weight_decay`", "shared_moment.decayed (AdamW's decay)"
  optimizer = keras.optimizers.AdamW(0.1, weight_decay=0.5)
  optimizer.exclude_from_weight_decay(var_names=["bias"])
  kernel = keras.Variable(np.ones([2], np.float32), name="kernel")
  bias = keras.Variable(np.ones([2], np.float32), name="bias")
  optimizer.build([kernel, bias])
  with canaries.watching(name, user):
    decays = [internals.uses_weight_decay(optimizer, v) for v in (kernel, bias)]
  canaries.require(decays == [True, False], name, user,
                   f"kernel, bias (excluded by name) gave {decays}")


def test_get_variable_index_is_the_build_order():
  name, user = "`Optimizer._get_variable_index`", "CompressedOptimizer (plans, residues, slots)"
  optimizer, variables = _built(keras.optimizers.SGD(0.1), [3], [2], [4])
  with canaries.watching(name, user):
    indices = [optimizer._get_variable_index(v) for v in reversed(variables)]  # pylint: disable=protected-access
  canaries.require(indices == [2, 1, 0], name, user, f"got {indices} for the built list reversed")


def test_distribution_strategy_is_the_scope_the_optimizer_was_made_in():
  name, user = "`Optimizer._distribution_strategy`", "CompressedOptimizer (build, slots)"
  strategy = _mirrored()
  with strategy.scope():
    optimizer = keras.optimizers.SGD(0.1)
  with canaries.watching(name, user):
    found = optimizer._distribution_strategy  # pylint: disable=protected-access
  canaries.require(found is strategy, name, user, f"got {found!r}")


def test_track_variable_makes_a_variable_the_optimizers_own():
  name, user = "`Optimizer._track_variable`", "steps.variables.Maker.one"
  optimizer, _ = _built(keras.optimizers.SGD(0.1))
  residue = keras.Variable(np.zeros([3], np.float32), trainable=False, name="residue")
  with canaries.watching(name, user):
    optimizer._track_variable(residue)  # pylint: disable=protected-access
  canaries.require(any(v is residue for v in optimizer.variables), name, user,
                   "a tracked variable is in optimizer.variables (so checkpoints save it)")


def test_an_optimizers_checkpoint_children_hold_its_variables_list_by_name():
  # CompressedOptimizer._trackable_children drops that list from a checkpoint's children
  # (compat.internals.checkpoint_children_by_name): under another name it would stay,
  # and a checkpoint would match the wrapper's variables by place again.
  name = "`Trackable._trackable_children` of a Keras optimizer"
  user = "CompressedOptimizer._trackable_children"
  optimizer, _ = _built(keras.optimizers.SGD(0.1, momentum=0.9))
  with canaries.watching(name, user):
    children = optimizer._trackable_children("checkpoint")  # pylint: disable=protected-access
  canaries.require("_variables" in children, name, user,
                   f"the optimizer's variables list is the child '_variables': {sorted(children)}")
  canaries.require(
      "_variables" not in internals.checkpoint_children_by_name(children, "checkpoint"),
      name, user, "checkpoint_children_by_name drops it")


def test_variables_is_the_optimizers_own_list():
  name, user = "`Optimizer._variables`", "CompressedOptimizer.variables"
  optimizer, _ = _built(keras.optimizers.SGD(0.1, momentum=0.9))
  with canaries.watching(name, user):
    own = list(optimizer._variables)  # pylint: disable=protected-access
  canaries.require([id(v) for v in own] == [id(v) for v in optimizer.variables], name, user,
                   "a plain optimizer's variables are its _variables")
  canaries.require(any(v is optimizer.iterations for v in own), name, user,
                   "they include `iterations`")


def test_trainable_variables_is_the_built_list():
  name, user = "`Optimizer._trainable_variables`", "CompressedOptimizer.apply"
  optimizer, variables = _built(keras.optimizers.SGD(0.1), [3], [2])
  with canaries.watching(name, user):
    found = list(optimizer._trainable_variables)  # pylint: disable=protected-access
  canaries.require([id(v) for v in found] == [id(v) for v in variables], name, user,
                   "the variables the optimizer was built with, in order")


def test_strategy_supports_no_merge_call_is_false_for_mirrored_on_cpus():
  name = "`tf.__internal__.distribute.strategy_supports_no_merge_call`"
  user = "replica_steps.on_every_replica_if (steps.guard)"
  strategy = _mirrored()

  found = []

  @tf.function
  def step():
    def replica_fn():
      found.append(tf.__internal__.distribute.strategy_supports_no_merge_call())
    strategy.run(replica_fn)

  with canaries.watching(name, user):
    step()
  canaries.require(found == [False, False], name, user,
                   f"MirroredStrategy on CPUs takes the merge-call path, got {found}")


def test_maybe_merge_call_runs_in_cross_replica_context_with_the_strategy():
  name = "`tf.__internal__.distribute.interim.maybe_merge_call`"
  user = "replica_steps.assign_per_replica (steps.guard)"
  strategy = _mirrored()
  seen = []

  def merged(distribution, value):
    seen.append((distribution is strategy, tf.distribute.in_cross_replica_context()))
    return distribution.experimental_local_results(value)[0] * 0 + 7.0

  @tf.function
  def step():
    return strategy.run(lambda: tf.__internal__.distribute.interim.maybe_merge_call(
        merged, strategy, tf.constant(1.0)))

  with canaries.watching(name, user):
    results = [float(r) for r in strategy.experimental_local_results(step())]
  canaries.require(seen and all(s == (True, True) for s in seen), name, user,
                   f"fn gets the strategy, in cross-replica context: {seen}")
  canaries.require(results and set(results) == {7.0}, name, user,
                   f"its result returns to every replica: {results}")


# --- Names used in place: cross_device_ops.py ---------------------------------------------


class _Spy(tf.distribute.ReductionToOneDevice):
  """Records which of the subclass hooks the strategy called."""

  def __init__(self):
    super().__init__()
    self.called = []

  def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
    self.called.append("reduce_implementation")
    return super().reduce_implementation(reduce_op, per_replica_value, destinations, options)

  def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
    self.called.append("batch_reduce_implementation")
    return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)

  def _gather_implementation(self, per_replica_value, destinations, axis, options):
    self.called.append("_gather_implementation")
    return super()._gather_implementation(per_replica_value, destinations, axis, options)


def _per_replica(strategy):
  """A per-replica value, each component on its replica's device: replica r holds
  ``[r + 1, r + 1]``."""
  return strategy.run(lambda: tf.fill([2], tf.cast(
      tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32)))


@pytest.mark.parametrize("hook", ["reduce_implementation", "batch_reduce_implementation",
                                  "_gather_implementation"])
def test_cross_device_ops_subclass_hooks_are_what_reductions_call(hook):
  """``CrossDeviceOps.reduce`` reaches ``reduce_implementation``; a replica's
  ``all_reduce`` (Keras' gradient all-reduce) reaches ``batch_reduce_implementation``;
  ``strategy.gather`` reaches ``_gather_implementation``."""
  name, user = f"`CrossDeviceOps.{hook}`", "CompressedAllReduce"
  spy = _Spy()
  strategy = _mirrored(cross_device_ops=spy)
  value = _per_replica(strategy)
  with canaries.watching(name, user):
    if hook == "reduce_implementation":
      with strategy.scope():
        destination = tf.Variable(tf.zeros([2]))
      result = spy.reduce(tf.distribute.ReduceOp.SUM, value, destination)
    elif hook == "batch_reduce_implementation":
      result = strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
          tf.distribute.ReduceOp.SUM, tf.fill([2], tf.cast(
              tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32))))
    else:
      result = strategy.gather(value, axis=0)
  canaries.require(hook in spy.called, name, user,
                   f"the strategy called {spy.called}, not the subclass's {hook}")
  expected = [1, 1, 2, 2] if hook == "_gather_implementation" else [3, 3]
  found = strategy.experimental_local_results(result)[0].numpy().tolist()
  canaries.require(found == expected, name, user, f"expected {expected}, got {found}")


def test_reduction_to_one_device_gather_concatenates_replicas():
  name, user = "`ReductionToOneDevice._gather`", "CompressedAllReduce._gather_implementation"
  strategy = _mirrored()
  with canaries.watching(name, user):
    gathered = tf.distribute.ReductionToOneDevice()._gather(  # pylint: disable=protected-access
        _per_replica(strategy), CPUS[0], axis=0, options=None)
  found = strategy.experimental_local_results(gathered)[0].numpy().tolist()
  canaries.require(found == [1, 1, 2, 2], name, user, f"got {found}")


def test_get_devices_from_resolves_destinations():
  name = "`tensorflow.python.distribute.cross_device_ops.get_devices_from`"
  user = "CompressedAllReduce (the targets of a reduction)"
  module = _module("tensorflow.python.distribute.cross_device_ops", user)
  strategy = _mirrored()
  with strategy.scope():
    variable = tf.Variable(tf.zeros([2]))  # a destination: a mirrored variable
  with canaries.watching(name, user):
    of_value = tuple(module.get_devices_from(variable))
    of_string = tuple(module.get_devices_from("/cpu:1"))
  canaries.require([d.split("/")[-1] for d in of_value] == ["device:CPU:0", "device:CPU:1"],
                   name, user, f"a mirrored variable's devices, got {of_value}")
  canaries.require(len(of_string) == 1 and of_string[0].endswith("CPU:1"), name, user,
                   f"a device string resolves to itself, got {of_string}")


def test_regroup_makes_a_mirrored_value_from_per_device_results():
  name = "`tensorflow.python.distribute.distribute_utils.regroup`"
  user = "CompressedAllReduce (the Mirrored result)"
  distribute_utils = _module("tensorflow.python.distribute.distribute_utils", user)
  values = _module("tensorflow.python.distribute.values", user)
  parts = []
  for device in CPUS:
    with tf.device(device):
      parts.append(tf.constant([1.0, 2.0]))
  with canaries.watching(name, user):
    result = distribute_utils.regroup(parts, wrap_class=values.Mirrored)
  canaries.require(isinstance(result, values.Mirrored) and list(result.values) == parts,
                   name, user, f"got {result!r}")


def test_values_distributed_classes_are_what_strategies_make():
  name, user = "`tensorflow.python.distribute.values`", "CompressedAllReduce"
  values = _module("tensorflow.python.distribute.values", user)
  canaries.require(isinstance(_per_replica(_mirrored()), values.DistributedValues), name, user,
                   "a strategy's per-replica value is a values.DistributedValues")
  canaries.require(issubclass(values.Mirrored, values.DistributedValues)
                   and issubclass(values.Mirrored, tf.distribute.DistributedValues), name,
                   user, "values.Mirrored is a DistributedValues (both the class and the "
                   "public type)")


def test_resource_variable_is_one_plain_variable_in_a_strategy_scope():
  """CompressedAllReduce keeps one residue per device: a variable that a strategy's
  scope does not turn into a mirrored one, placed where it was made."""
  name = "`tensorflow.python.ops.resource_variable_ops.ResourceVariable`"
  user = "CompressedAllReduce (per-device residues)"
  module = _module("tensorflow.python.ops.resource_variable_ops", user)
  strategy = _mirrored()
  with strategy.scope(), tf.device(CPUS[1]):
    with canaries.watching(name, user):
      variable = module.ResourceVariable(tf.zeros([2]), trainable=False)
  canaries.require(not isinstance(variable, tf.distribute.DistributedValues)
                   and variable.device.endswith("CPU:1"), name, user,
                   f"got {type(variable).__name__} on {variable.device}")


# --- The list itself ------------------------------------------------------------------------


def _private_imports(path):
  """The private framework modules a file imports (``keras.src``, ``tensorflow.python``,
  ``tensorflow.compiler``), at any depth, by ``import`` or ``importlib.import_module``
  of a literal name."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      found.add(node.module)
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
      found.add(node.value)
  return {m for m in found
          if m.startswith(("keras.src", "tensorflow.python", "tensorflow.compiler"))}


def test_private_framework_modules_are_imported_only_where_listed():
  """Every private module the package imports is one internals.py lists, in a module it
  names: a new private dependency is added to the list (and given a canary) first."""
  allowed = {
      "tf_adacomp/compat/internals.py": {"tensorflow.python.eager",
                                         "tensorflow.python.distribute",
                                         "tensorflow.compiler.xla.tsl.protobuf",
                                         internals.KERAS_TENSORFLOW_TRAINER,
                                         internals.KERAS_SAVEABLE},
      "tf_adacomp/cross_device_ops.py": {"tensorflow.python.distribute",
                                         "tensorflow.python.ops"},
  }
  found = {}
  for path in sorted((ROOT / "tf_adacomp").rglob("*.py")):
    relative = str(path.relative_to(ROOT))
    private = _private_imports(path)
    if private and not private <= allowed.get(relative, set()):
      found[relative] = sorted(private - allowed.get(relative, set()))
  assert not found, (f"Private framework modules imported where compat/internals.py does not "
                     f"list them: {found}")


def test_trackable_hooks_save_and_restore_compressed_all_reduce_states(tmp_path):
  name = ("`Trackable._serialize_to_tensors`, `_restore_from_tensors` and "
          "`_lookup_dependency`")
  user = "cross_device_ops._DeviceStates (CompressedAllReduce's checkpoints)"

  def module(*per_device):
    holder = tf.Module()
    holder.states = cross_device_ops._DeviceStates(  # pylint: disable=protected-access
        [[tf.Variable(values)] for values in per_device])
    return holder

  with canaries.watching(name, user):
    path = tf.train.Checkpoint(ops=module([1.0, 2.0], [3.0, 4.0])).save(str(tmp_path / "new"))
    saved = [name for name, _ in tf.train.list_variables(path)]
    restored = module([0.0, 0.0])
    tf.train.Checkpoint(ops=restored).restore(path).assert_consumed()
    split = restored.states[0][0].numpy().tolist()
    legacy = tf.Module()
    legacy.states = [[tf.Variable([5.0, 6.0])]]  # the earlier layout: states/{device}/{state}
    legacy_path = tf.train.Checkpoint(ops=legacy).save(str(tmp_path / "legacy"))
    tf.train.Checkpoint(ops=restored).restore(legacy_path)
  canaries.require("ops/states/.ATTRIBUTES/state_0" in saved, name, user,
                   f"_serialize_to_tensors saves one stacked tensor per state, got {saved}")
  canaries.require(split == [4.0, 6.0], name, user,
                   f"_restore_from_tensors sums 2 devices' values onto 1, got {split}")
  canaries.require(restored.states[0][0].numpy().tolist() == [5.0, 6.0], name, user,
                   "a checkpoint of the per-device layout restores through _lookup_dependency")


def test_checkpoint_child_of_a_variable_is_saved_and_restored_after_it(tmp_path):
  """What replica_state relies on: a child tracked on a distributed variable (Keras 3's
  and tf.distribute's) is saved with it and restored after it, in one restore and in a
  deferred one (the variable made after the restore began)."""
  name = ("`Trackable._track_trackable` and `_lookup_dependency` on a variable, and a "
          "restore's parent-before-child order")
  user = "replica_state.attach (each replica's copy of a per-replica state)"
  order = []

  class Child(tf.__internal__.tracking.Trackable):
    def __init__(self, variable):
      self.variable = variable

    def _serialize_to_tensors(self):
      return {"value": tf.constant(7.0)}

    def _restore_from_tensors(self, restored_tensors):
      order.append(("child", float(self.variable.numpy())))
      return tf.no_op()

  strategy = _mirrored()

  def holder(value):
    module = tf.Module()
    with strategy.scope():
      module.v = keras.Variable(value, aggregation="mean", synchronization="on_read")
    return module

  with canaries.watching(name, user):
    saved = holder(3.0)
    internals.add_checkpoint_child(saved.v, "child", Child(saved.v))
    found = internals.checkpoint_child(saved.v, "child")
    path = tf.train.Checkpoint(m=saved).write(str(tmp_path / "ckpt"))
    keys = [key for key, _ in tf.train.list_variables(path)]
    restored = holder(0.0)
    internals.add_checkpoint_child(restored.v, "child", Child(restored.v))
    tf.train.Checkpoint(m=restored).read(path).assert_consumed()
    deferred = tf.Module()
    tf.train.Checkpoint(m=deferred).read(path)
    with strategy.scope():
      deferred.v = keras.Variable(0.0, aggregation="mean", synchronization="on_read")
    internals.add_checkpoint_child(deferred.v, "child", Child(deferred.v))
  canaries.require(isinstance(found, Child), name, user, f"_lookup_dependency gave {found!r}")
  canaries.require("m/v/child/.ATTRIBUTES/value" in keys, name, user,
                   f"the child's tensor is saved under the variable, got {keys}")
  canaries.require(order == [("child", 3.0), ("child", 3.0)], name, user,
                   f"the child restored after its variable's value (3.0), got {order}")


def test_keras_saveable_is_what_keras_files_save():
  name, user = f"`{internals.KERAS_SAVEABLE}.KerasSaveable`", "replica_state.FileCopies"
  with canaries.watching(name, user):
    saveable = internals.keras_saveable_class()
  canaries.require(isinstance(keras.optimizers.Adam(), saveable), name, user,
                   f"a Keras optimizer is not a {saveable!r}")


# --- tf_keras.py: the tf_keras wrapper -------------------------------------------------

TF_KERAS_WRAPPER = "tf_adacomp.tf_keras.CompressedOptimizer"


# What tf_keras' Optimizer.__init__ sets, which the wrapper's __init__ (it skips the
# base class's) must account for: set by hand, forwarded to the inner optimizer, or not
# needed (its own `iterations` and the builders of sharded slots the wrapper never makes).
_SET_BY_HAND = {"name", "_variables", "_mesh", "_run_with_dtensor", "_distribution_strategy"}
_FORWARDED = {"weight_decay", "clipnorm", "clipvalue", "global_clipnorm", "use_ema",
              "ema_momentum", "ema_overwrite_frequency", "jit_compile"}
_NOT_NEEDED = {"_iterations", "_sharded_variable_builders"}


def test_tf_keras_optimizer_init_sets_the_names_the_wrapper_sets_instead():
  import tf_keras  # pylint: disable=import-outside-toplevel
  from tf_adacomp import tf_keras as wrapper_lib  # pylint: disable=import-outside-toplevel

  class Bare(tf_keras.optimizers.Optimizer):
    def __init__(self):
      super().__init__(name="bare")

  set_by_init = {a for a in vars(Bare()) if not a.startswith("_self_")}  # not tracking's
  accounted = _SET_BY_HAND | _FORWARDED | _NOT_NEEDED
  canaries.require(set_by_init == accounted, "`tf_keras Optimizer.__init__`", TF_KERAS_WRAPPER,
                   f"sets exactly the attributes the wrapper accounts for; new: "
                   f"{sorted(set_by_init - accounted)}, gone: {sorted(accounted - set_by_init)}")
  inner = tf_keras.optimizers.SGD(0.1, clipnorm=2.0)
  wrapper = wrapper_lib.CompressedOptimizer(inner, "none")
  assert _SET_BY_HAND <= set(vars(wrapper))
  for attribute in _FORWARDED:
    assert getattr(wrapper, attribute) == getattr(inner, attribute), attribute
  wrapper.clipnorm = 3.0
  assert inner.clipnorm == 3.0
  optimizer = tf_keras.optimizers.SGD(0.1)
  optimizer.build([tf.Variable([1.0])])
  canaries.require(getattr(optimizer, "_built", None) is True, "`tf_keras Optimizer._built`",
                   TF_KERAS_WRAPPER, "True after build (the base class's build checks it)")
  with canaries.watching("`AutoTrackable._no_dependency`", TF_KERAS_WRAPPER):
    optimizer.kept = optimizer._no_dependency([])  # pylint: disable=protected-access
  canaries.require(type(optimizer.kept) is list, "`AutoTrackable._no_dependency`",
                   TF_KERAS_WRAPPER, f"an attribute set to it is a plain list, not tracked "
                   f"(got {type(optimizer.kept).__name__})")


def test_check_variables_are_known_refuses_a_variable_the_optimizer_was_not_built_with():
  """CompressedOptimizer.apply calls Keras' own check first, so that a variable it was
  not built with (a layer unfrozen later) gets Keras' ValueError before anything runs."""
  name = "`BaseOptimizer._check_variables_are_known`"
  user = "optimizer.CompressedOptimizer.apply"
  known, unknown = keras.Variable(np.zeros(2, np.float32)), keras.Variable(np.zeros(2, np.float32))
  optimizer = keras.optimizers.SGD(0.1)
  optimizer.build([known])
  with canaries.watching(name, user):
    optimizer._check_variables_are_known([known])  # pylint: disable=protected-access
  try:
    optimizer._check_variables_are_known([known, unknown])  # pylint: disable=protected-access
  except ValueError as error:
    canaries.require("Unknown variable" in str(error), name, user,
                     f"its ValueError names the unknown variable: {error}")
  else:
    canaries.fail(name, user, "a variable the optimizer was not built with passed")


def test_ema_hooks_are_what_apply_calls_for_the_average():
  """tf_adacomp.ema replaces these two methods on the inner optimizer and reads its
  averages: replaced by no-ops, ``apply`` must leave the average alone."""
  from tf_adacomp import ema  # pylint: disable=import-outside-toplevel
  name = f"`BaseOptimizer.{ema.UPDATE}`/`{ema.OVERWRITE}`/`{ema.AVERAGES}`"
  user = "tf_adacomp.ema"
  variable = keras.Variable(np.ones(2, np.float32))
  optimizer = keras.optimizers.SGD(0.25, use_ema=True, ema_overwrite_frequency=1)
  with canaries.watching(name, user):
    optimizer.build([variable])
    ema.defer(optimizer)
    average = getattr(optimizer, ema.AVERAGES)[0]
    with ema.deferred():
      optimizer.apply([tf.ones(2)], [variable])
  canaries.require(np.array_equal(average.numpy(), np.zeros(2, np.float32))
                   and np.array_equal(variable.numpy(), np.full(2, 0.75, np.float32)),
                   name, user, "deferred, apply neither updates the average nor overwrites "
                   f"the weights: average {average.numpy()}, weights {variable.numpy()}")
  optimizer.apply([tf.ones(2)], [variable])
  canaries.require(not np.array_equal(average.numpy(), np.zeros(2, np.float32)), name, user,
                   f"outside deferred(), apply updates the average: {average.numpy()}")


def test_tf_keras_private_names_the_tf_keras_wrapper_relies_on():
  """tf_adacomp.tf_keras builds a legacy inner optimizer with ``_create_all_weights`` (as
  tf_keras' own .h5 loader does) and lists its checkpoint children through
  ``AutoTrackable._trackable_children`` (bypassing tf_keras' cached answer)."""
  tf_keras = pytest.importorskip("tf_keras")
  user = "tf_adacomp.tf_keras"
  name = "`tf_keras.optimizers.legacy.Optimizer._create_all_weights`"
  variable = tf.Variable(np.zeros(2, np.float32))
  legacy = tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9)
  with canaries.watching(name, user):
    legacy._create_all_weights([variable])  # pylint: disable=protected-access
  canaries.require(len(legacy.weights) == 2, name, user,
                   f"it makes the step counter and the momentum: {legacy.weights}")
  name = "`tf.__internal__.tracking.AutoTrackable._trackable_children`"
  holder = tf.__internal__.tracking.AutoTrackable()
  holder.kept = tf.Variable(1.0)
  with canaries.watching(name, user):
    children = tf.__internal__.tracking.AutoTrackable._trackable_children(  # pylint: disable=protected-access
        holder, "checkpoint")
  canaries.require("kept" in children, name, user,
                   f"it lists an attribute's variable: {sorted(children)}")
