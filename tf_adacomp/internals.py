"""Every private Keras and TensorFlow name tf_adacomp relies on, in one place.

Tested with TensorFlow 2.21.0 and Keras 3.15.1 (TensorFlow backend).
``tests/test_internals.py`` holds one test per name below: when an upgrade removes or
renames one, that test fails naming it and the installed versions.

Where a public route exists the package uses it (``optimizer.learning_rate`` in
``resist/sync.py``, ``keras.tree`` in ``keras_fixes.py``). Where none does, the access
goes through a small accessor of this module, so that a change upstream is fixed here
once; the names used in modules with other owners are listed with their place.

Accessors of this module
------------------------
- ``cross_device_ops_of(strategy)``: ``strategy.extended._cross_device_ops`` (the
  ``CrossDeviceOps`` a ``MirroredStrategy`` reduces with; TF has no public getter).
  Used by ``callbacks.CompressionStats`` (finding a ``CompressedAllReduce``) and
  ``CompressedAllReduce.of`` (the one to add to a checkpoint).
- ``set_collective_key_base(strategy, base)``: ``MirroredStrategy._collective_key_base``,
  read by ``MirroredExtended.__init__``, set on one instance before ``__init__``. Used by
  ``distribute.mirrored_strategy`` (collective keys of its own per strategy).
- ``flatten_layers(model)``: ``keras.Layer._flatten_layers(include_self, recursive)``,
  every nested layer, not only ``model.layers``. Used by ``resist.model.partitionable_blocks``.
- ``in_multi_worker_mode(strategy)``: ``strategy.extended._in_multi_worker_mode()`` of
  ``CollectiveAllReduceExtended``. Used by ``keras_fixes`` when Keras lacks its own
  ``_collective_all_reduce_multi_worker``.
- ``own_distribute_strategy(model)``: ``TensorFlowTrainer._distribute_strategy`` (None
  when the model was not made under a strategy scope; the public
  ``distribute_strategy`` falls back to the current strategy instead). Used by
  ``keras_fixes`` (the wrapped ``_maybe_symbolic_build``).
- ``eager_context_initialized()``: ``tensorflow.python.eager.context.context()._initialized``
  (whether TensorFlow's runtime has started, after which it no longer reads
  ``TF_XLA_FLAGS``). Used by ``xla_cache.enable``.
- ``set_initial_epoch(model, epoch)``: ``keras.Model._initial_epoch``, the epoch a
  ``fit`` that is starting begins at (Keras' own ``BackupAndRestore`` sets it the same
  way; there is no public route). Used by ``backup.BackupAndRestore``.
- ``keras_tensorflow_trainer()``: the module ``keras.src.backend.tensorflow.trainer``,
  with ``TensorFlowTrainer._maybe_symbolic_build``, ``reduce_per_replica`` and
  ``_collective_all_reduce_multi_worker``: the functions ``keras_fixes`` wraps
  (keras-team/keras#20585).

Names used in place (modules owned elsewhere)
---------------------------------------------
- ``optimizer.py``:
  - ``ALL_REDUCE_HOOK = "_all_reduce_sum_gradients"``: the method of Keras' TensorFlow
    optimizers (``keras/src/backend/tensorflow/optimizer.py``) that all-reduces the
    gradients in ``apply``; replaced on the inner optimizer by ``CompressedOptimizer``
    and, through the same constant, by ``resist.trainer.ResIST``.
  - ``_first_moment_slots(optimizer)``: SGD's ``momentums`` (undocumented) and Adam's /
    AdamW's private ``_momentums`` (``keras/src/optimizers/sgd.py``, ``adam.py``).
  - ``Optimizer._get_variable_index`` (on the inner optimizer and on itself),
    ``_distribution_strategy``, ``_track_variable``, ``_variables`` and
    ``_trainable_variables`` of ``keras.optimizers.Optimizer``
    (``keras/src/optimizers/base_optimizer.py``, ``keras/src/backend/tensorflow/optimizer.py``).
  - ``tf.__internal__.distribute.strategy_supports_no_merge_call`` and
    ``tf.__internal__.distribute.interim.maybe_merge_call`` (as Keras' own optimizer).
- ``cross_device_ops.py``: the public ``tf.distribute.CrossDeviceOps`` subclassed through
  its (undocumented) ``reduce_implementation``, ``batch_reduce_implementation`` and
  ``_gather_implementation``; ``tf.distribute.ReductionToOneDevice._gather``;
  ``tensorflow.python.distribute.cross_device_ops.get_devices_from``,
  ``tensorflow.python.distribute.distribute_utils.regroup``,
  ``tensorflow.python.distribute.values`` (``Mirrored``, ``DistributedValues``) and
  ``tensorflow.python.ops.resource_variable_ops.ResourceVariable``.
- ``loss_scale.py``: replaces the public ``LossScaleOptimizer.check_finite`` on the
  class, relying on Keras' ``_tf_apply`` and ``_common_apply`` deciding through it
  (guarded by ``tests/test_optimizer_mixed_precision.py``).
- ``resist/trainer.py``: ``optimizer.ALL_REDUCE_HOOK`` (above), set and deleted on the
  model's optimizer for local SGD.

Public serialization (``keras.saving.register_keras_serializable``,
``serialize_keras_object``, ``deserialize_keras_object``) is used throughout; the
package does not import ``keras.src.saving.serialization_lib``.
"""

import importlib
from typing import List

__all__ = [
    "cross_device_ops_of",
    "eager_context_initialized",
    "flatten_layers",
    "in_multi_worker_mode",
    "keras_tensorflow_trainer",
    "own_distribute_strategy",
    "set_collective_key_base",
    "set_initial_epoch",
    "versions",
]

# The versions this module's list was checked against (see ``versions()`` for the installed).
TESTED_TENSORFLOW = "2.21.0"
TESTED_KERAS = "3.15.1"

KERAS_TENSORFLOW_TRAINER = "keras.src.backend.tensorflow.trainer"


def versions() -> str:
  """The installed versions, for error messages: "TensorFlow 2.21.0, Keras 3.15.1"."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return f"TensorFlow {tf.__version__}, Keras {keras.__version__}"


def cross_device_ops_of(strategy):
  """The ``CrossDeviceOps`` of a ``MirroredStrategy`` (None for strategies without one)."""
  extended = getattr(strategy, "extended", None)
  return getattr(extended, "_cross_device_ops", None)


def set_collective_key_base(strategy, base: int) -> None:
  """Sets where ``strategy`` (a ``MirroredStrategy`` not yet initialised) numbers its
  collective keys from; on this instance only, the class keeps its own."""
  strategy._collective_key_base = base  # pylint: disable=protected-access


def flatten_layers(model, include_self: bool = False) -> List:
  """``model``'s layers and all their nested layers, in Keras' own order."""
  return model._flatten_layers(include_self=include_self)  # pylint: disable=protected-access


def in_multi_worker_mode(strategy) -> bool:
  """Whether a ``MultiWorkerMirroredStrategy`` spans more than one worker."""
  return strategy.extended._in_multi_worker_mode()  # pylint: disable=protected-access


def own_distribute_strategy(model):
  """The strategy ``model`` was created under, or None (Keras' TensorFlow trainer)."""
  return model._distribute_strategy  # pylint: disable=protected-access


def set_initial_epoch(model, epoch: int) -> None:
  """Makes the ``fit`` that is starting (from ``on_train_begin``) begin at ``epoch``."""
  model._initial_epoch = epoch  # pylint: disable=protected-access


def eager_context_initialized() -> bool:
  """Whether TensorFlow's eager runtime has started (devices and flags are then fixed)."""
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  return bool(context.context()._initialized)  # pylint: disable=protected-access


def keras_tensorflow_trainer():
  """The module of Keras' TensorFlow trainer (raises ImportError where there is none)."""
  return importlib.import_module(KERAS_TENSORFLOW_TRAINER)
