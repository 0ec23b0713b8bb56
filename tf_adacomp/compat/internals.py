"""Accessors of the private Keras and TensorFlow names tf_adacomp relies on.

Where a public route exists the package takes it (``optimizer.learning_rate`` in
``resist/sync.py``, ``keras.tree`` in ``compat.keras_multi_worker``). Where none does,
the access goes through one small function of this module, so that an upstream rename
is fixed here once, and ``tests/compat/test_internals.py`` holds a canary per name that
uses the real attribute the way the package does and fails naming it and the installed
versions (``compat.versions``).

Accessors
---------
- ``cross_device_ops_of(strategy)``: ``strategy.extended._cross_device_ops``, the
  ``CrossDeviceOps`` a ``MirroredStrategy`` reduces with (TensorFlow has no public
  getter). Used by ``callbacks.CompressionStats`` (to find a ``CompressedAllReduce``)
  and ``CompressedAllReduce.of`` (the one to add to a checkpoint).
- ``own_collective_keys_per_strategy(allocate)``: ``MirroredStrategy._collective_key_base``
  and ``MirroredStrategyV1._collective_key_base`` (``tf.compat.v1.distribute.MirroredStrategy``,
  a class of its own, not a subclass, with its own copy of the attribute), which
  ``MirroredExtended.__init__`` reads as the start of the strategy's collective keys (0
  for every instance in TensorFlow), replaced on each class by a descriptor that gives
  each instance a base of its own from ``allocate()``: the patches ``COLLECTIVE_KEY_BASE``
  and ``COLLECTIVE_KEY_BASE_V1`` (``compat.patches``). Used by ``tf_adacomp.distribute``
  when it is imported, so that every ``MirroredStrategy`` of either API made after that
  (the user's own included) numbers its collectives from a key range of its own (why at
  import: the function's docstring).
  ``MultiWorkerMirroredStrategy`` (and its v1 class) keeps TensorFlow's base 0: across
  workers its keys must agree, which a per-process counter cannot promise, and no
  ``MirroredStrategy`` range starts at 0. The other strategies (``OneDeviceStrategy``,
  ``CentralStorageStrategy``, ``ParameterServerStrategy``) make no collective keys.
- ``flatten_layers(model)``: ``keras.Layer._flatten_layers(include_self, recursive)``,
  every nested layer, not only ``model.layers``. Used by ``resist.model.partitionable_blocks``.
- ``in_multi_worker_mode(strategy)``: ``strategy.extended._in_multi_worker_mode()`` of
  ``CollectiveAllReduceExtended``. Used by ``backup.BackupAndRestore`` and by
  ``compat.keras_multi_worker`` when Keras lacks its own
  ``_collective_all_reduce_multi_worker``.
- ``own_distribute_strategy(model)``: ``TensorFlowTrainer._distribute_strategy`` (None
  when the model was not made under a strategy scope; the public
  ``distribute_strategy`` falls back to the current strategy instead). Used by
  ``compat.keras_multi_worker`` (the wrapped ``_maybe_symbolic_build``).
- ``eager_context_initialized()``: ``tensorflow.python.eager.context.context()._initialized``
  (whether TensorFlow's runtime has started, after which it no longer reads
  ``TF_XLA_FLAGS``). Used by ``xla_cache.enable``.
- ``set_initial_epoch(model, epoch)``: ``keras.Model._initial_epoch``, the epoch a
  ``fit`` that is starting begins at (Keras' own ``BackupAndRestore`` sets it the same
  way; there is no public route). Used by ``backup.BackupAndRestore``.
- ``uses_weight_decay(optimizer, variable)``: ``keras.optimizers.Optimizer._use_weight_decay``
  (whether ``exclude_from_weight_decay`` left ``variable`` in). Used by
  ``shared_moment.decayed``, which applies AdamW's decoupled decay itself.
- ``configure_coordination_service(cluster_spec, heartbeat_timeout_ms)``:
  ``context().configure_coordination_service`` as ``CollectiveAllReduceExtended``
  (``tensorflow/python/distribute/collective_all_reduce_strategy.py``) would call it,
  with ``multi_worker_util.coordination_leader`` and ``CoordinatedJob``, but a heartbeat
  timeout of our choosing; the strategy keeps a service configured before it is made.
  Used by ``distribute.multi_worker_strategy(heartbeat_timeout=...)``.
- ``multi_worker_local_devices(device_type, count)``: a context manager during which
  ``CollectiveAllReduceExtended._initialize_local_devices`` (what a
  ``MultiWorkerMirroredStrategy`` made from ``TF_CONFIG`` takes as its worker's devices:
  every GPU, else one CPU) gives ``count`` devices of ``device_type``, the way
  TensorFlow's own multi-worker tests give a worker several: the patch
  ``LOCAL_DEVICES``, for a while (``patches.patched``). Used by
  ``distribute.multi_worker_strategy(devices_per_worker=...)``.
- ``called_by_tf_keras_h5_writer()``: whether the code asking is run by
  ``tf_keras.src.saving.legacy.hdf5_format.save_optimizer_weights_to_hdf5_group``, tf_keras'
  legacy ``.h5`` writer of an optimizer's state, which stores each entry of
  ``optimizer.variables`` by its ``name`` and ``numpy()`` and offers no other hook. Used by
  ``tf_keras.CompressedOptimizer.variables``, which adds each replica's copies there.
- ``keras_tensorflow_trainer()``: the module ``keras.src.backend.tensorflow.trainer``,
  with ``TensorFlowTrainer._maybe_symbolic_build``, ``reduce_per_replica`` and
  ``_collective_all_reduce_multi_worker``: what ``compat.keras_multi_worker`` patches.

Every replacement of a framework attribute (of a class, a module or one object) goes
through ``compat.patches``; its docstring lists each patch with its canary.

Names used in place
-------------------
Modules whose whole purpose is to extend a framework class keep its private names where
they are used; their canaries are in ``tests/compat/test_internals.py`` too:

- ``optimizer.py`` and ``steps/``:
  - ``steps.arguments.ALL_REDUCE_HOOK = "_all_reduce_sum_gradients"``: the method of
    Keras' TensorFlow optimizers (``keras/src/backend/tensorflow/optimizer.py``) that
    all-reduces the gradients in ``apply``; replaced on the inner optimizer by
    ``CompressedOptimizer`` (the instance patch ``ALL_REDUCE_SUMMED`` of this module, in
    ``steps.inner.build``) and by ``resist.trainer.ResIST`` (``ALL_REDUCE_LOCAL``), both
    replacing ``ALL_REDUCE_METHOD``, the same name.
  - ``steps.momentum_masking.first_moment_slots(optimizer)``: SGD's ``momentums``
    (undocumented) and Adam's / AdamW's private ``_momentums``
    (``keras/src/optimizers/sgd.py``, ``adam.py``).
  - ``Optimizer._get_variable_index`` (on the inner optimizer and on itself),
    ``_distribution_strategy``, ``_track_variable``, ``_variables`` and
    ``_trainable_variables`` of ``keras.optimizers.Optimizer``
    (``keras/src/optimizers/base_optimizer.py``, ``keras/src/backend/tensorflow/optimizer.py``).
  - ``_check_variables_are_known``: Keras' "Unknown variable" ValueError, raised by
    ``apply`` before a step on a variable it was not built with.
- ``optimizer.py``: ``tf.__internal__.tracking.Trackable._trackable_children`` (the
  checkpoint children of the Keras 3 wrapper: ``checkpoint_children_by_name``).
- ``tf_keras.py``: ``tf_keras.optimizers.legacy.Optimizer._create_all_weights`` (a legacy
  inner optimizer's build) and ``tf.__internal__.tracking.AutoTrackable._trackable_children``
  (the wrapper's checkpoint children, past tf_keras' cached answer).
- ``ema.py``: ``UPDATE``, ``OVERWRITE`` and ``AVERAGES``, the base optimizer's EMA methods
  (replaced on the inner optimizer instance: the instance patches ``ema.DEFERRED``) and
  its averages.
- ``replica_steps.py`` (for both optimizer wrappers):
  ``tf.__internal__.distribute.strategy_supports_no_merge_call`` and
  ``tf.__internal__.distribute.interim.maybe_merge_call`` (as Keras' own optimizer).
- ``shared_moment.moment_slots(optimizer)``: Adam's / AdamW's private ``_momentums``
  and ``_velocities`` (``keras/src/optimizers/adam.py``).
- ``cross_device_ops.py``: the public ``tf.distribute.CrossDeviceOps`` subclassed through
  its (undocumented) ``reduce_implementation``, ``batch_reduce_implementation`` and
  ``_gather_implementation``; ``tf.distribute.ReductionToOneDevice._gather``;
  ``tensorflow.python.distribute.cross_device_ops.get_devices_from``,
  ``tensorflow.python.distribute.distribute_utils.regroup``,
  ``tensorflow.python.distribute.values`` (``Mirrored``, ``DistributedValues``) and
  ``tensorflow.python.ops.resource_variable_ops.ResourceVariable``.
- ``cross_device_ops._DeviceStates`` (``CompressedAllReduce``'s per-tensor states in a
  checkpoint): ``tf.__internal__.tracking.Trackable`` subclassed through its
  ``_serialize_to_tensors`` and ``_restore_from_tensors`` (one stacked tensor per state,
  split on restore) and ``_lookup_dependency`` (checkpoints of the earlier per-device
  layout).
- ``replica_state`` (per-replica state across a save and load, both optimizer wrappers):
  ``checkpoint_child(obj, name)`` and ``add_checkpoint_child(obj, name, child)``,
  ``Trackable._lookup_dependency`` and ``Trackable._track_trackable`` on a variable
  (a ``tf.distribute`` variable or a Keras 3 variable, both Trackables), whose child
  holds each replica's copy; that child a ``tf.__internal__.tracking.Trackable`` through
  ``_serialize_to_tensors`` and ``_restore_from_tensors``; and
  ``keras_saveable_class()``, ``keras.src.saving.keras_saveable.KerasSaveable``, the
  base of what Keras 3's ``.keras`` saving visits (``save_own_variables``,
  ``load_own_variables``), which Keras does not export.
- ``compat.loss_scale``: replaces the public ``LossScaleOptimizer.check_finite`` on the
  class, relying on Keras' ``_tf_apply`` and ``_common_apply`` deciding through it.
- ``resist/trainer.py``: ``optimizer.ALL_REDUCE_HOOK`` (above), patched on the model's
  optimizer for local SGD and unpatched after ``fit`` (``ALL_REDUCE_LOCAL``).
- ``tf_keras.py`` (the tf_keras wrapper, a ``tf_keras.optimizers.Optimizer`` that does not
  run that class's ``__init__``): it sets ``_variables``, ``_mesh``,
  ``_run_with_dtensor``, ``_distribution_strategy`` and ``_built``, which the base
  class's methods read (``tf_keras/src/optimizers/optimizer.py``), and wraps its list in
  ``AutoTrackable._no_dependency``.

Public serialization (``keras.saving.register_keras_serializable``,
``serialize_keras_object``, ``deserialize_keras_object``) is used throughout; the
package imports no ``keras.src`` module but through ``keras_tensorflow_trainer``.
"""

import functools
import importlib
import sys
from typing import Callable, List

import tensorflow as tf

from tensorflow.python.eager import context

from tf_adacomp.compat import patches

__all__ = [
    "ALL_REDUCE_LOCAL",
    "ALL_REDUCE_METHOD",
    "ALL_REDUCE_SUMMED",
    "COLLECTIVE_KEY_BASE",
    "COLLECTIVE_KEY_BASES",
    "COLLECTIVE_KEY_BASE_V1",
    "KERAS_SAVEABLE",
    "KERAS_TENSORFLOW_TRAINER",
    "LOCAL_DEVICES",
    "add_checkpoint_child",
    "checkpoint_child",
    "configure_coordination_service",
    "cross_device_ops_of",
    "eager_context_initialized",
    "flatten_layers",
    "in_multi_worker_mode",
    "keras_saveable_class",
    "keras_tensorflow_trainer",
    "multi_worker_local_devices",
    "own_distribute_strategy",
    "own_collective_keys_per_strategy",
    "set_initial_epoch",
    "uses_weight_decay",
]

KERAS_TENSORFLOW_TRAINER = "keras.src.backend.tensorflow.trainer"
TF_KERAS_H5_MODULE = "tf_keras.src.saving.legacy.hdf5_format"
TF_KERAS_H5_WRITER = "save_optimizer_weights_to_hdf5_group"
KERAS_SAVEABLE = "keras.src.saving.keras_saveable"


def cross_device_ops_of(strategy):
  """The ``CrossDeviceOps`` of a ``MirroredStrategy``.

  Args:
    strategy: any object; strategies without cross-device ops give None.

  Returns:
    The ``tf.distribute.CrossDeviceOps`` the strategy reduces with, or None.
  """
  extended = getattr(strategy, "extended", None)
  return getattr(extended, "_cross_device_ops", None)


def configure_coordination_service(cluster_spec, heartbeat_timeout_ms: int) -> None:
  """Configures TensorFlow's coordination service for a ``MultiWorkerMirroredStrategy``
  that is about to be made, as the strategy itself would, but with the heartbeat
  timeout ``heartbeat_timeout_ms`` (TensorFlow's default is 10 s).

  Args:
    cluster_spec: the ``tf.train.ClusterSpec`` of ``TF_CONFIG``.
    heartbeat_timeout_ms: milliseconds > 0.
  """
  # pylint: disable=g-import-not-at-top
  from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
  from tensorflow.python.distribute import multi_worker_util
  # pylint: enable=g-import-not-at-top
  jobs = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
          for job in ("chief", "worker") if job in cluster_spec.jobs]
  context.context().configure_coordination_service(
      service_type="standalone",
      service_leader=multi_worker_util.coordination_leader(cluster_spec),
      coordinated_jobs=jobs, heartbeat_timeout_in_ms=int(heartbeat_timeout_ms))


LOCAL_DEVICES = "CollectiveAllReduceExtended._initialize_local_devices"


def _collective_all_reduce_extended():
  # pylint: disable=g-import-not-at-top
  from tensorflow.python.distribute import collective_all_reduce_strategy
  # pylint: enable=g-import-not-at-top
  return collective_all_reduce_strategy.CollectiveAllReduceExtended


def _wrap_local_devices(original, device_type: str, count: int):
  del original  # what every worker takes otherwise: every GPU, else one CPU

  def local_devices(self, cluster_resolver, worker_device):  # pylint: disable=unused-argument
    return (tuple(f"{worker_device}/device:{device_type}:{i}" for i in range(count)),
            device_type)

  return local_devices


patches.register(patches.Patch(
    name=LOCAL_DEVICES, owner=_collective_all_reduce_extended,
    attribute="_initialize_local_devices", wrap=_wrap_local_devices,
    missing=("TensorFlow's CollectiveAllReduceExtended has no _initialize_local_devices "
             "here: multi_worker_strategy(devices_per_worker=...) cannot choose a worker's "
             "devices.")))


def multi_worker_local_devices(device_type: str, count: int):
  """Within it, a ``MultiWorkerMirroredStrategy`` being made takes ``count`` devices of
  ``device_type`` ("CPU" or "GPU", indices ``0..count-1``) on each worker.

  The patch ``LOCAL_DEVICES`` for a while (``patches.patched``): it changes the class,
  for every strategy made meanwhile, so it lasts only while the strategy is made.

  Args:
    device_type: "CPU" or "GPU".
    count: the devices per worker, >= 1.

  Returns:
    A context manager.

  Raises:
    RuntimeError: (on entering) the installed TensorFlow lacks the method, or the patch
      is in place already (two of these do not nest).
  """
  return patches.patched(LOCAL_DEVICES, device_type, count)


class _CollectiveKeyBasePerInstance:
  """``MirroredStrategy._collective_key_base`` (v2 or v1) as a descriptor: a base per instance.

  Read on an instance (by ``MirroredExtended.__init__``), it gives the base that instance
  was given or allocates one; read on the class, TensorFlow's 0. Assigning on an instance
  sets that instance's base.
  """

  _SLOT = "_tf_adacomp_collective_key_base"

  def __init__(self, allocate: Callable[[], int]):
    self.allocate = allocate

  def __get__(self, strategy, owner=None):
    if strategy is None:
      return 0
    state = vars(strategy)
    if self._SLOT not in state:
      state[self._SLOT] = self.allocate()
    return state[self._SLOT]

  def __set__(self, strategy, base):
    vars(strategy)[self._SLOT] = base


def _mirrored_strategy_classes() -> tuple:
  """The classes whose instances ``own_collective_keys_per_strategy`` gives keys of their own.

  Returns:
    ``(tf.distribute.MirroredStrategy, tf.compat.v1.distribute.MirroredStrategy)``: two
    unrelated classes (the v1 one is no subclass), each with its own class attribute
    ``_collective_key_base``, which ``MirroredExtended.__init__`` reads from the instance.
  """
  return (tf.distribute.MirroredStrategy, tf.compat.v1.distribute.MirroredStrategy)


def _wrap_collective_key_base(original, allocate: Callable[[], int]):
  del original  # TensorFlow's 0, which the descriptor still gives on the class
  return _CollectiveKeyBasePerInstance(allocate)


_KEY_BASE_MISSING = ("TensorFlow's {} has no _collective_key_base here: two MirroredStrategy "
                     "objects of one process may share collective keys (\"Shape mismatch in "
                     "the collective instance 100\").")

COLLECTIVE_KEY_BASE = "MirroredStrategy._collective_key_base"
COLLECTIVE_KEY_BASE_V1 = "MirroredStrategyV1._collective_key_base"
COLLECTIVE_KEY_BASES = (COLLECTIVE_KEY_BASE, COLLECTIVE_KEY_BASE_V1)

for _name, _index in zip(COLLECTIVE_KEY_BASES, range(2)):
  patches.register(patches.Patch(
      name=_name, owner=lambda index=_index: _mirrored_strategy_classes()[index],
      attribute="_collective_key_base", wrap=_wrap_collective_key_base,
      missing=_KEY_BASE_MISSING.format(_name.split(".")[0])))
del _name, _index


def own_collective_keys_per_strategy(allocate: Callable[[], int]) -> None:
  """Gives every ``MirroredStrategy`` made from now on (``tf.distribute`` and
  ``tf.compat.v1.distribute``) its own collective keys.

  TensorFlow starts every ``MirroredStrategy``'s group keys at 1 and instance keys at 100,
  and the runtime keeps the shape and group size it first saw under a key for the whole
  process: a second strategy whose collectives differ (another model, another number of
  replicas) fails with "Shape mismatch in the collective instance 100" or "joining a
  group with size 2, but that group has size 4", and every later collective of the
  process is aborted. With this, each instance reads its own base (TensorFlow's own tests
  move the class's base by hand between strategies for the same reason). The v1 class
  keeps a class attribute of its own, so it gets a descriptor of its own, sharing
  ``allocate``: a v1 and a v2 strategy in one process get different ranges too.

  The patches ``COLLECTIVE_KEY_BASE`` and ``COLLECTIVE_KEY_BASE_V1``
  (``patches.install``): idempotent, installed once per class (a later call's
  ``allocate`` is not used); a class base set by hand afterwards (an int) replaces that
  class's descriptor, and a later call installs it again.

  Why they are installed when ``tf_adacomp`` is imported (``tf_adacomp.distribute`` calls
  this), not lazily: the strategy that needs keys of its own is often one tf_adacomp
  never sees being made, made before anything of tf_adacomp is called. A user's own
  ``tf.distribute.MirroredStrategy()`` is made first and the ``CompressedOptimizer`` or
  ``CompressedAllReduce`` inside or after it; a notebook trains a plain Keras model
  under one strategy, then a compressed one under another. The base is read once, in
  the strategy's constructor, so a patch installed by the optimizer would come too late
  for its own strategy, and any strategy made before it would keep TensorFlow's keys and
  collide with the next (``tests/test_strategies_in_one_process.py``).

  Args:
    allocate: called once per strategy, returns the strategy's base (its first group key
      minus one).
  """
  for name in COLLECTIVE_KEY_BASES:
    patches.install(name, allocate)


ALL_REDUCE_SUMMED = "Optimizer._all_reduce_sum_gradients (summed already)"
ALL_REDUCE_LOCAL = "Optimizer._all_reduce_sum_gradients (local steps)"
# The method of Keras' TensorFlow optimizers that all-reduces the gradients in `apply`
# (steps.arguments.ALL_REDUCE_HOOK, the same name: tests/compat/test_patches.py).
ALL_REDUCE_METHOD = "_all_reduce_sum_gradients"


def _wrap_all_reduce(original, replacement: Callable):
  """A function of its own (``MARK`` goes on it) that calls ``replacement``."""
  del original

  @functools.wraps(replacement)
  def all_reduce(*args, **kwargs):
    return replacement(*args, **kwargs)

  return all_reduce


for _name in (ALL_REDUCE_SUMMED, ALL_REDUCE_LOCAL):
  patches.register(patches.InstancePatch(name=_name, attribute=ALL_REDUCE_METHOD,
                                         wrap=_wrap_all_reduce))
del _name


def checkpoint_children_by_name(children: dict, save_type: str) -> dict:
  """A Keras 3 optimizer's ``Trackable._trackable_children`` (``children``) without its
  list ``_variables`` in a checkpoint: its variables are then matched by the names
  under which the optimizer holds them, not by their places in that list."""
  if save_type == "checkpoint":
    children = {name: child for name, child in children.items() if name != "_variables"}
  return children


def checkpoint_child(obj, name: str):
  """The checkpoint child ``name`` of the Trackable ``obj`` (None if it has none):
  ``Trackable._lookup_dependency``. Used by ``replica_state.attach``."""
  return obj._lookup_dependency(name)  # pylint: disable=protected-access


def add_checkpoint_child(obj, name: str, child) -> None:
  """Adds ``child`` as the checkpoint child ``name`` of the Trackable ``obj`` (a
  variable): ``Trackable._track_trackable``, which also restores it from a restore of
  ``obj``'s checkpoint still under way. Used by ``replica_state.attach``."""
  obj._track_trackable(child, name, overwrite=True)  # pylint: disable=protected-access


def keras_saveable_class():
  """``keras.src.saving.keras_saveable.KerasSaveable``: what Keras 3's ``.keras`` saving
  visits among an object's attributes. Used by ``replica_state.FileCopies``."""
  return importlib.import_module(KERAS_SAVEABLE).KerasSaveable


def flatten_layers(model, include_self: bool = False) -> List:
  """``model``'s layers and all their nested layers, in Keras' own order.

  Args:
    model: a Keras layer or model.
    include_self: whether ``model`` itself comes first.

  Returns:
    A list of layers.
  """
  return model._flatten_layers(include_self=include_self)  # pylint: disable=protected-access


def in_multi_worker_mode(strategy) -> bool:
  """Whether a ``MultiWorkerMirroredStrategy`` spans more than one worker.

  Args:
    strategy: a ``tf.distribute.MultiWorkerMirroredStrategy``.
  """
  return strategy.extended._in_multi_worker_mode()  # pylint: disable=protected-access


def own_distribute_strategy(model):
  """The strategy ``model`` was created under, or None (Keras' TensorFlow trainer).

  Unlike the public ``model.distribute_strategy``, which falls back to the current
  strategy, this says whether Keras will distribute the model's own steps.
  """
  return model._distribute_strategy  # pylint: disable=protected-access


def set_initial_epoch(model, epoch: int) -> None:
  """Makes the ``fit`` that is starting (called from ``on_train_begin``) begin at ``epoch``."""
  model._initial_epoch = epoch  # pylint: disable=protected-access


def eager_context_initialized() -> bool:
  """Whether TensorFlow's eager runtime has started (devices and flags are then fixed)."""
  return bool(context.context()._initialized)  # pylint: disable=protected-access


def uses_weight_decay(optimizer, variable) -> bool:
  """Whether ``optimizer`` decays ``variable`` (its ``exclude_from_weight_decay`` lists)."""
  return bool(optimizer._use_weight_decay(variable))  # pylint: disable=protected-access


def keras_tensorflow_trainer():
  """The module of Keras' TensorFlow trainer.

  Raises:
    ImportError: a Keras without it (Keras 2, another layout).
  """
  return importlib.import_module(KERAS_TENSORFLOW_TRAINER)


def called_by_tf_keras_h5_writer(frames: int = 4) -> bool:
  """Whether one of the ``frames`` callers above the caller of this function is tf_keras'
  legacy ``.h5`` writer of an optimizer's state (``TF_KERAS_H5_WRITER``)."""
  frame = sys._getframe(1)  # pylint: disable=protected-access
  for _ in range(frames):
    frame = frame.f_back
    if frame is None:
      return False
    if (frame.f_code.co_name == TF_KERAS_H5_WRITER
        and frame.f_globals.get("__name__") == TF_KERAS_H5_MODULE):
      return True
  return False
