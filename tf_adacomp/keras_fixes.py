"""A fix for Keras 3 ``model.fit`` under ``MultiWorkerMirroredStrategy`` (keras-team/keras#20585).

The upstream bug
----------------
Keras 3 (TensorFlow backend, checked against 3.15.1) cannot train with ``model.fit``
(nor ``evaluate``) under ``tf.distribute.MultiWorkerMirroredStrategy`` (MWMS) with more
than one worker. Two code paths in ``keras/src/backend/tensorflow/trainer.py`` fail, one
after the other:

1. ``TensorFlowTrainer._maybe_symbolic_build`` takes the first batch of the distributed
   dataset, a structure ``(x, y)`` of ``PerReplica`` values, and reduces it eagerly with
   ``strategy.reduce("MEAN", batch, axis=None)`` only to learn its shapes and dtypes.
   ``MirroredStrategy`` maps its reduction over nested structures; MWMS's
   ``CollectiveAllReduceExtended._reduce_to`` does not, and hands the whole tuple to
   ``convert_to_tensor``::

     ValueError: Attempt to convert a value (PerReplica:{ 0: <tf.Tensor: ...> }) with an
     unsupported type (<class 'tensorflow.python.distribute.values.PerReplica'>) to a Tensor.

   (Even with a single tensor it would start a cross-worker collective just to read a
   shape.)

2. Past that, ``reduce_per_replica(..., reduction="auto")`` reduces the step's logs (the
   loss and metric results, rank-0 tensors) with ``strategy.reduce("MEAN", v, axis=0)``
   in multi-worker mode. ``axis=0`` asks for a mean over the first dimension of each
   value as well, which scalars do not have, so tracing the train function fails::

     ValueError: Invalid reduction dimension 0 for input with 0 dimensions. for
     '{{node Sum_2}} = Sum[T=DT_FLOAT, ...](div_no_nan, Sum_2/reduction_indices)' ...

The fix
-------
``apply_keras_multi_worker_fix()`` wraps the two functions; each wrapper handles only
the failing case and calls the original Keras function for everything else:

1. ``_maybe_symbolic_build`` under MWMS: each ``DistributedValues`` leaf of the first
   batch is replaced by its first local component
   (``strategy.experimental_local_results(v)[0]``). The symbolic build reads only
   shapes and dtypes, and a local component has the same per-replica shape and dtype as
   the mean the original asked for, without any communication. The original method
   then runs with this batch (``data_batch=...``, ``iterator=None``), so scoping and
   building are still done by Keras' own code.
2. ``reduce_per_replica`` with ``reduction`` ``"auto"`` or ``"mean"`` in multi-worker
   mode (Keras' own test, ``_collective_all_reduce_multi_worker``): every value is
   reduced with ``strategy.reduce("MEAN", v, axis=None)``, the element-wise mean over
   all replicas of all workers. That is what the single-worker branch of the same
   function computes over local replicas (``tf.reduce_mean(local_results, axis=0)``
   stacks the replicas' values on a new axis 0 and averages over it). Metric variables
   in Keras 3 are ``on_read`` (replica-local), so each replica's logs are its own
   running means, and their mean over replicas is the logged value, now the same on
   every worker. ``"sum"`` and ``"concat"`` (``predict``) are left to Keras.

With any strategy but MWMS (``MirroredStrategy``, ``OneDeviceStrategy``, the default
strategy, ...) both wrappers call the originals with the same arguments: the behaviour
is exactly the original's. MWMS in single-worker mode keeps the original
``reduce_per_replica``; its symbolic build takes the local component too (with one
local device the batch holds no ``DistributedValues`` and is passed on unchanged; with
several, MWMS's reduce would fail on the nested structure as in 1.).

Version guard
-------------
The fix is considered for Keras ``>= 3.0`` with the TensorFlow backend (Keras 2 /
``tf_keras`` has another trainer and is never touched). No Keras release is known to
fix the bug, so there is no upper version bound; instead each wrapper is installed only
when the source of the installed function still contains the failing call (an eager
``distribute_strategy.reduce(`` of the data batch; a ``reduce("MEAN", v, axis=0)``). A
Keras that has fixed either path is therefore left alone for that path. When the
source cannot be read (e.g. a zipped install), the fix is installed: both wrappers are
correct whether or not the bug is present.
"""

import functools
import inspect
import logging
import re
import threading
from typing import Callable, Dict, Tuple

from tf_adacomp import internals

__all__ = [
    "apply_keras_multi_worker_fix",
    "apply_keras_multi_worker_fix_for",
    "keras_multi_worker_fix_applied",
    "keras_multi_worker_fix_needed",
    "revert_keras_multi_worker_fix",
]

# Names of the two patches, in the order they are applied.
SYMBOLIC_BUILD = "TensorFlowTrainer._maybe_symbolic_build"
REDUCE_PER_REPLICA = "reduce_per_replica"
PATCHES = (SYMBOLIC_BUILD, REDUCE_PER_REPLICA)

MIN_KERAS_VERSION = (3, 0)

# Source patterns of the failing calls (see the module docstring).
_BUGGY_SOURCE = {
    SYMBOLIC_BUILD: re.compile(r"distribute_strategy\.reduce\("),
    REDUCE_PER_REPLICA: re.compile(r"""\.reduce\(\s*["']MEAN["']\s*,\s*\w+\s*,\s*axis\s*=\s*0\b"""),
}

_LOCK = threading.Lock()
_ORIGINALS: Dict[str, Callable] = {}  # patch name -> the Keras function it replaced
_MARK = "_tf_adacomp_keras_fix"       # attribute set on our wrappers


def _keras_version() -> Tuple[int, ...]:
  import keras  # pylint: disable=g-import-not-at-top
  parts = []
  for part in str(keras.__version__).split("."):
    digits = re.match(r"\d+", part)
    if not digits:
      break
    parts.append(int(digits.group()))
    if digits.group() != part:  # "0rc1", "0dev": stop after the number
      break
  return tuple(parts)


def _trainer_module():
  """Keras' TensorFlow trainer module, or None when the fix cannot apply."""
  if _keras_version() < MIN_KERAS_VERSION:
    return None
  import keras  # pylint: disable=g-import-not-at-top
  if keras.backend.backend() != "tensorflow":
    return None
  try:
    trainer = internals.keras_tensorflow_trainer()
  except ImportError:
    return None
  if not (hasattr(trainer, "TensorFlowTrainer") and hasattr(trainer, "reduce_per_replica")
          and hasattr(trainer.TensorFlowTrainer, "_maybe_symbolic_build")):
    return None
  return trainer


def _current(trainer, name):
  if name == SYMBOLIC_BUILD:
    return trainer.TensorFlowTrainer.__dict__.get("_maybe_symbolic_build")
  return trainer.reduce_per_replica


def _install(trainer, name, function):
  if name == SYMBOLIC_BUILD:
    trainer.TensorFlowTrainer._maybe_symbolic_build = function  # pylint: disable=protected-access
  else:
    trainer.reduce_per_replica = function


def _is_buggy(function, name) -> bool:
  try:
    source = inspect.getsource(function)
  except (OSError, TypeError):
    return True  # cannot tell: the wrappers are correct either way
  return bool(_BUGGY_SOURCE[name].search(source))


def _is_multi_worker_mirrored(strategy) -> bool:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def _make_symbolic_build(trainer, original):
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  @functools.wraps(original)
  def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    strategy = internals.own_distribute_strategy(self)
    if iterator is None or not _is_multi_worker_mirrored(strategy):
      return original(self, iterator=iterator, data_batch=data_batch)

    def local_component(value):
      if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
      return value

    for _, _, batches in iterator:  # the first batch only, as the original
      data_batch = keras.tree.map_structure(local_component, next(batches))
      break
    return original(self, iterator=None, data_batch=data_batch)

  setattr(_maybe_symbolic_build, _MARK, SYMBOLIC_BUILD)
  return _maybe_symbolic_build


def _make_reduce_per_replica(trainer, original):
  import keras  # pylint: disable=g-import-not-at-top

  in_multi_worker_mode = getattr(trainer, "_collective_all_reduce_multi_worker", None)
  if in_multi_worker_mode is None:  # a Keras without the helper: the same test
    def in_multi_worker_mode(strategy):
      return _is_multi_worker_mirrored(strategy) and internals.in_multi_worker_mode(strategy)

  @functools.wraps(original)
  def reduce_per_replica(values, strategy, reduction):
    if reduction in ("auto", "mean") and in_multi_worker_mode(strategy):
      # "auto" is "mean" for every strategy but TPUStrategy, which is not multi-worker MWMS.
      return keras.tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
    return original(values, strategy, reduction)

  setattr(reduce_per_replica, _MARK, REDUCE_PER_REPLICA)
  return reduce_per_replica


_FACTORIES = {SYMBOLIC_BUILD: _make_symbolic_build, REDUCE_PER_REPLICA: _make_reduce_per_replica}


def keras_multi_worker_fix_needed() -> Tuple[str, ...]:
  """The patches the installed Keras needs, whether or not they are applied.

  Returns:
    A tuple of patch names (``"TensorFlowTrainer._maybe_symbolic_build"``,
    ``"reduce_per_replica"``); empty for Keras < 3.0, a backend other than TensorFlow,
    or a Keras whose code no longer contains the failing calls.
  """
  with _LOCK:
    trainer = _trainer_module()
    if trainer is None:
      return ()
    return tuple(name for name in PATCHES
                 if _is_buggy(_ORIGINALS.get(name) or _current(trainer, name), name))


def _apply(names) -> Tuple[str, ...]:
  """Installs the named patches (those not installed yet); returns all installed ones."""
  with _LOCK:
    trainer = _trainer_module()
    if trainer is None:
      return ()
    for name in names:
      current = _current(trainer, name)
      if name in _ORIGINALS and getattr(current, _MARK, None) == name:
        continue  # already ours: idempotent
      if not _is_buggy(current, name):
        continue
      _ORIGINALS[name] = current
      _install(trainer, name, _FACTORIES[name](trainer, current))
    return tuple(name for name in PATCHES if name in _ORIGINALS)


def apply_keras_multi_worker_fix() -> Tuple[str, ...]:
  """Makes ``model.fit``/``evaluate`` work under multi-worker ``MultiWorkerMirroredStrategy``.

  Patches Keras' TensorFlow trainer in place (see the module docstring). Safe to call
  any number of times, from any thread: each patch is installed once. Has no effect on
  training under any other strategy, nor for Keras < 3.0, another Keras backend, or a
  Keras whose code no longer contains the failing calls.

  Returns:
    The names of the patches now installed (empty when none is needed).
  """
  return _apply(PATCHES)


def apply_keras_multi_worker_fix_for(strategy) -> Tuple[str, ...]:
  """Applies the fix when ``strategy`` is a ``MultiWorkerMirroredStrategy``; else nothing.

  ``CompressedOptimizer`` calls this when it is created and when it is built, so that
  the standard ``tf.distribute.MultiWorkerMirroredStrategy()`` trains with ``model.fit``
  with no call from the user. The first call that installs a patch logs one line
  (logger ``tf_adacomp``) naming what was patched; later calls are silent no-ops.

  Args:
    strategy: any ``tf.distribute.Strategy`` (or None).

  Returns:
    The names of the patches newly installed by this call (usually empty).
  """
  if not _is_multi_worker_mirrored(strategy):
    return ()
  with _LOCK:
    before = set(_ORIGINALS)
  installed = _apply(PATCHES)
  new = tuple(name for name in installed if name not in before)
  if new:
    logging.getLogger("tf_adacomp").warning(
        "tf_adacomp: patched Keras %s for model.fit under MultiWorkerMirroredStrategy "
        "(keras-team/keras#20585): %s.", _keras_version_string(), ", ".join(new))
  return new


def _keras_version_string() -> str:
  import keras  # pylint: disable=g-import-not-at-top
  return str(keras.__version__)


def keras_multi_worker_fix_applied() -> bool:
  """Whether ``apply_keras_multi_worker_fix`` has installed at least one patch."""
  with _LOCK:
    return bool(_ORIGINALS)


def revert_keras_multi_worker_fix() -> Tuple[str, ...]:
  """Restores the original Keras functions (for tests).

  A patch that something else has replaced since is left as it is.

  Returns:
    The names of the patches removed.
  """
  with _LOCK:
    trainer = _trainer_module()
    removed = []
    for name in PATCHES:
      original = _ORIGINALS.pop(name, None)
      if original is None or trainer is None:
        continue
      if getattr(_current(trainer, name), _MARK, None) == name:
        _install(trainer, name, original)
        removed.append(name)
    return tuple(removed)
