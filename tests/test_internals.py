"""Canaries for the private Keras and TensorFlow names tf_adacomp relies on.

One test per name of ``tf_adacomp/internals.py``'s list: when an upgrade removes or
renames one, its test fails with a message naming it and the installed versions.
"""

import importlib
import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_adacomp import internals


def _require(present, name, where):
  """Fails, naming the private ``name`` and the versions, unless it is ``present``."""
  if not present:
    pytest.fail(f"The private {name} ({where}) that tf_adacomp relies on is gone in "
                f"{internals.versions()} (tested with TensorFlow {internals.TESTED_TENSORFLOW}, "
                f"Keras {internals.TESTED_KERAS}): update tf_adacomp/internals.py and the "
                f"code it lists.")


def _require_attribute(obj, attribute, where):
  _require(hasattr(obj, attribute), f"`{attribute}`", where)


def _module(name):
  try:
    return importlib.import_module(name)
  except ImportError:
    _require(False, f"module `{name}`", "an import")
    raise  # not reached


def _variable():
  return keras.Variable(np.zeros([3], np.float32))


def _built(optimizer):
  variable = _variable()
  optimizer.build([variable])
  return optimizer, variable


def _cpus(count=2):
  return [d.name for d in tf.config.list_logical_devices("CPU")][:count]


# --- The list itself ------------------------------------------------------------------

PRIVATE_NAMES = (
    "_all_reduce_sum_gradients", "_first_moment_slots", "momentums", "_momentums",
    "_get_variable_index", "_distribution_strategy", "_track_variable", "_variables",
    "_trainable_variables", "tf.__internal__.distribute.strategy_supports_no_merge_call",
    "tf.__internal__.distribute.interim.maybe_merge_call", "_cross_device_ops",
    "_collective_key_base", "_flatten_layers", "_in_multi_worker_mode",
    "_distribute_strategy", "keras.src.backend.tensorflow.trainer", "_maybe_symbolic_build",
    "reduce_per_replica", "_collective_all_reduce_multi_worker",
    "tensorflow.python.distribute.cross_device_ops", "_gather_implementation", "_gather",
    "get_devices_from", "tensorflow.python.distribute.distribute_utils.regroup",
    "tensorflow.python.distribute.values", "tensorflow.python.ops.resource_variable_ops",
    "keras.src.saving.serialization_lib", "_initialized", "_initial_epoch",
)


@pytest.mark.parametrize("name", PRIVATE_NAMES)
def test_the_module_docstring_lists_the_name(name):
  assert name in internals.__doc__


def test_versions_names_the_installed_tensorflow_and_keras():
  assert internals.versions() == f"TensorFlow {tf.__version__}, Keras {keras.__version__}"


# --- optimizer.py -----------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", [keras.optimizers.SGD, keras.optimizers.Adam,
                                       keras.optimizers.AdamW, keras.optimizers.RMSprop])
def test_keras_optimizers_all_reduce_in_all_reduce_sum_gradients(optimizer):
  _require_attribute(optimizer(), "_all_reduce_sum_gradients",
                     f"keras.optimizers.{optimizer.__name__}, optimizer.ALL_REDUCE_HOOK")


def test_sgd_keeps_its_momentum_in_momentums():
  optimizer, _ = _built(keras.optimizers.SGD(0.1, momentum=0.9))
  _require(len(getattr(optimizer, "momentums", ())) == 1, "`momentums`",
           "keras.optimizers.SGD, optimizer._first_moment_slots")


@pytest.mark.parametrize("optimizer", [keras.optimizers.Adam, keras.optimizers.AdamW])
def test_adam_keeps_its_first_moment_in_momentums(optimizer):
  built, _ = _built(optimizer())
  _require(len(getattr(built, "_momentums", ())) == 1, "`_momentums`",
           f"keras.optimizers.{optimizer.__name__}, optimizer._first_moment_slots")


def test_optimizer_get_variable_index():
  optimizer, variable = _built(keras.optimizers.SGD(0.1))
  _require_attribute(optimizer, "_get_variable_index", "keras.optimizers.Optimizer")
  assert optimizer._get_variable_index(variable) == 0  # pylint: disable=protected-access


@pytest.mark.parametrize("attribute", ["_distribution_strategy", "_track_variable",
                                       "_variables", "_trainable_variables"])
def test_optimizer_base_class_attributes(attribute):
  optimizer, _ = _built(keras.optimizers.SGD(0.1))
  _require_attribute(optimizer, attribute,
                     "keras.optimizers.Optimizer, used by CompressedOptimizer")


@pytest.mark.parametrize("path", ["strategy_supports_no_merge_call", "interim.maybe_merge_call"])
def test_tf_internal_distribute(path):
  obj = tf.__internal__.distribute
  for part in path.split("."):
    _require(hasattr(obj, part), f"`tf.__internal__.distribute.{path}`", "optimizer.py")
    obj = getattr(obj, part)
  assert callable(obj)


# --- Accessors of internals.py ----------------------------------------------------------

def test_mirrored_strategy_extended_cross_device_ops():
  ops = tf.distribute.ReductionToOneDevice()
  strategy = tf.distribute.MirroredStrategy(_cpus(), cross_device_ops=ops)
  _require_attribute(strategy.extended, "_cross_device_ops",
                     "MirroredStrategy.extended, internals.cross_device_ops_of")
  assert internals.cross_device_ops_of(strategy) is ops
  assert internals.cross_device_ops_of(object()) is None


def test_mirrored_strategy_collective_key_base():
  _require_attribute(tf.distribute.MirroredStrategy, "_collective_key_base",
                     "internals.set_collective_key_base")
  extended = _module("tensorflow.python.distribute.mirrored_strategy").MirroredExtended
  _require("_collective_key_base" in inspect.getsource(extended.__init__),
           "`_collective_key_base` read by MirroredExtended.__init__",
           "internals.set_collective_key_base")
  cls = tf.distribute.MirroredStrategy
  strategy = cls.__new__(cls)
  internals.set_collective_key_base(strategy, 12_300_000)
  strategy.__init__(_cpus())
  assert strategy._collective_key_base == 12_300_000  # pylint: disable=protected-access
  assert cls._collective_key_base == 0  # pylint: disable=protected-access


def test_layer_flatten_layers():
  inner = keras.Sequential([keras.layers.Dense(2, name="nested_dense")], name="inner")
  inputs = keras.Input([3])
  model = keras.Model(inputs, inner(keras.layers.Dense(3, name="top_dense")(inputs)))
  _require_attribute(model, "_flatten_layers", "keras.Layer, internals.flatten_layers")
  names = [layer.name for layer in internals.flatten_layers(model)]
  assert "nested_dense" in names and "top_dense" in names and model.name not in names
  assert internals.flatten_layers(model, include_self=True)[0] is model


def test_collective_all_reduce_extended_in_multi_worker_mode():
  module = _module("tensorflow.python.distribute.collective_all_reduce_strategy")
  _require_attribute(module.CollectiveAllReduceExtended, "_in_multi_worker_mode",
                     "MultiWorkerMirroredStrategy.extended, internals.in_multi_worker_mode")


def test_keras_model_distribute_strategy():
  model = keras.Sequential([keras.layers.Dense(1)])
  _require_attribute(model, "_distribute_strategy",
                     "Keras' TensorFlowTrainer, internals.own_distribute_strategy")
  assert internals.own_distribute_strategy(model) is None
  strategy = tf.distribute.MirroredStrategy(_cpus())
  with strategy.scope():
    model = keras.Sequential([keras.layers.Dense(1)])
  assert internals.own_distribute_strategy(model) is strategy


def test_keras_model_initial_epoch_is_where_fit_starts():
  # Keras' TensorFlowTrainer.fit reads `_initial_epoch` after on_train_begin (where
  # backup.BackupAndRestore sets it): a fit of 3 epochs set to start at 2 runs one.
  model = keras.Sequential([keras.Input([2]), keras.layers.Dense(1)])
  model.compile(optimizer="sgd", loss="mse")
  _require_attribute(model, "_initial_epoch", "keras.Model, internals.set_initial_epoch")
  epochs = []

  class StartAtTwo(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
      internals.set_initial_epoch(self.model, 2)

    def on_epoch_begin(self, epoch, logs=None):
      epochs.append(epoch)

  model.fit(np.zeros([4, 2]), np.zeros([4, 1]), epochs=3, verbose=0,
            callbacks=[StartAtTwo()])
  _require(epochs == [2], "`_initial_epoch` as fit's starting epoch",
           f"keras.Model.fit ran epochs {epochs}")


def test_eager_context_initialized():
  # conftest has started TensorFlow: the flag is there and says so.
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  _require_attribute(context.context(), "_initialized", "tensorflow.python.eager.context.Context")
  tf.constant(1.0)
  assert internals.eager_context_initialized() is True


@pytest.mark.parametrize("path", ["TensorFlowTrainer._maybe_symbolic_build",
                                  "reduce_per_replica", "_collective_all_reduce_multi_worker"])
def test_keras_tensorflow_trainer(path):
  try:
    obj = internals.keras_tensorflow_trainer()
  except ImportError:
    _require(False, f"module `{internals.KERAS_TENSORFLOW_TRAINER}`", "keras_fixes")
  for part in path.split("."):
    _require(hasattr(obj, part), f"`{internals.KERAS_TENSORFLOW_TRAINER}.{path}`",
             "keras_fixes")
    obj = getattr(obj, part)


# --- cross_device_ops.py ----------------------------------------------------------------

@pytest.mark.parametrize("module, names", [
    ("tensorflow.python.distribute.cross_device_ops",
     ["CrossDeviceOps.reduce_implementation", "CrossDeviceOps.batch_reduce_implementation",
      "CrossDeviceOps._gather_implementation", "ReductionToOneDevice._gather",
      "get_devices_from"]),
    ("tensorflow.python.distribute.distribute_utils", ["regroup"]),
    ("tensorflow.python.distribute.values", ["Mirrored", "DistributedValues"]),
    ("tensorflow.python.ops.resource_variable_ops", ["ResourceVariable"]),
])
def test_tensorflow_python_distribute(module, names):
  for name in names:
    obj = _module(module)
    for part in name.split("."):
      _require(hasattr(obj, part), f"`{module}.{name}`", "cross_device_ops.py")
      obj = getattr(obj, part)


def test_the_public_tensorflow_names_are_the_private_classes():
  """``tf.distribute`` exposes the classes cross_device_ops.py subclasses and checks."""
  cross_device_ops = _module("tensorflow.python.distribute.cross_device_ops")
  values = _module("tensorflow.python.distribute.values")
  assert tf.distribute.CrossDeviceOps is cross_device_ops.CrossDeviceOps
  assert issubclass(values.Mirrored, tf.distribute.DistributedValues)


# --- Public routes the package took instead -----------------------------------------------

def test_optimizer_learning_rate_is_the_variable():
  """resist.reset_optimizer keeps ``optimizer.learning_rate`` (the public route to the
  private ``_learning_rate``): for a constant rate it is the variable itself."""
  optimizer, _ = _built(keras.optimizers.SGD(0.1, momentum=0.9))
  rate = optimizer.learning_rate
  assert isinstance(rate, keras.Variable)
  assert any(v is rate for v in optimizer.variables)


def test_keras_tree_is_public():
  assert keras.tree.map_structure(lambda v: v + 1, (1, [2])) == (2, [3])
