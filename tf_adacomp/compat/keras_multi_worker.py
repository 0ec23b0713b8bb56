"""A fix for Keras 3 ``model.fit`` under multi-worker ``MultiWorkerMirroredStrategy``.

The upstream bug
----------------
Keras 3 (TensorFlow backend) cannot train with ``model.fit`` (nor ``evaluate``) under
``tf.distribute.MultiWorkerMirroredStrategy`` (MWMS) with more than one worker
(``UPSTREAM_ISSUE``; docs/distributed.md). Two code paths in
``keras/src/backend/tensorflow/trainer.py`` fail, one after the other:

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

     ValueError: Invalid reduction dimension 0 for input with 0 dimensions. ...

The fix
-------
Two patches (``compat.patches``); each wrapper handles only the failing case and calls
the original Keras function for everything else:

1. ``SYMBOLIC_BUILD``, under MWMS: each ``DistributedValues`` leaf of the first batch is
   replaced by its first local component (``strategy.experimental_local_results(v)[0]``).
   The symbolic build reads only shapes and dtypes, and a local component has the same
   per-replica shape and dtype as the mean the original asked for, without any
   communication. The original method then runs with this batch (``data_batch=...``,
   ``iterator=None``), so scoping and building are still done by Keras' own code.
2. ``REDUCE_PER_REPLICA``, with ``reduction`` ``"auto"`` or ``"mean"`` in multi-worker
   mode (Keras' own test, ``_collective_all_reduce_multi_worker``): every value is
   reduced to its element-wise mean over all replicas of all workers
   (``strategy.reduce("MEAN", v, axis=None)``), the values of one dtype packed into one
   all-reduce (``mean_over_replicas``: one collective per step, not one per logged
   value). That is what the single-worker branch of the same
   function computes over local replicas (``tf.reduce_mean(local_results, axis=0)``
   stacks the replicas' values on a new axis 0 and averages over it). Metric variables
   in Keras 3 are ``on_read`` (replica-local), so each replica's logs are its own
   running means, and their mean over replicas is the logged value, now the same on
   every worker. ``"sum"`` and ``"concat"`` (``predict``) are left to Keras. In a
   function whose step has rounds of local steps the mean is taken at rounds' ends
   only, and held between (``tf_adacomp.step_logs``).

With any strategy but MWMS (``MirroredStrategy``, ``OneDeviceStrategy``, the default
strategy, ...) both wrappers call the originals with the same arguments: the behaviour
is exactly the original's. MWMS in single-worker mode keeps the original
``reduce_per_replica``; its symbolic build takes the local component too (with one
local device the batch holds no ``DistributedValues`` and is passed on unchanged; with
several, MWMS's reduce would fail on the nested structure as in 1.).

Guards
------
The patches apply to Keras 3 with the TensorFlow backend only (Keras 2 / ``tf_keras``
has another trainer and is never touched). No Keras release is known to fix the bug,
so there is no upper version bound; instead each patch is installed only while the
installed function's source still contains the failing call (an eager
``distribute_strategy.reduce(`` of the data batch; a ``reduce("MEAN", v, axis=0)``), so
a Keras that has fixed either path is left alone for that path. When the source cannot
be read (a zipped install), the patch is installed: both wrappers are correct whether
or not the bug is there. ``tests/compat/test_keras_multi_worker.py`` checks on the
installed Keras that each guard agrees with the behaviour it stands for.
"""

import functools
import inspect
import re
from typing import Tuple

import keras
import tensorflow as tf

from tf_adacomp import log
from tf_adacomp import replica_steps
from tf_adacomp import step_logs
from tf_adacomp.compat import internals
from tf_adacomp.compat import patches
from tf_adacomp.compat import versions

__all__ = [
    "apply_keras_multi_worker_fix",
    "apply_keras_multi_worker_fix_for",
    "keras_multi_worker_fix_applied",
    "keras_multi_worker_fix_needed",
    "revert_keras_multi_worker_fix",
]

# The upstream report, named in the log line of the first installation.
UPSTREAM_ISSUE = "keras-team/keras#20585"

# Names of the two patches, in the order they are applied.
SYMBOLIC_BUILD = "TensorFlowTrainer._maybe_symbolic_build"
REDUCE_PER_REPLICA = "reduce_per_replica"
PATCHES = (SYMBOLIC_BUILD, REDUCE_PER_REPLICA)

MIN_KERAS_VERSION = (3, 0)

# Source patterns of the failing calls (see the module docstring).
BUGGY_SOURCE = {
    SYMBOLIC_BUILD: re.compile(r"distribute_strategy\.reduce\("),
    REDUCE_PER_REPLICA: re.compile(r"""\.reduce\(\s*["']MEAN["']\s*,\s*\w+\s*,\s*axis\s*=\s*0\b"""),
}


def trainer_module():
  """Keras' TensorFlow trainer module, or None where the fix does not apply."""
  if versions.keras_version() < MIN_KERAS_VERSION:
    return None
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


def _trainer_class():
  trainer = trainer_module()
  return None if trainer is None else trainer.TensorFlowTrainer


def _has_failing_call(name):
  def needed(function) -> bool:
    try:
      source = inspect.getsource(function)
    except (OSError, TypeError):
      return True  # cannot tell: the wrappers are correct either way
    return bool(BUGGY_SOURCE[name].search(source))
  return needed


def _is_multi_worker_mirrored(strategy) -> bool:
  return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def _wrap_symbolic_build(original):
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

  return _maybe_symbolic_build


def in_multi_worker_mode(strategy) -> bool:
  """Keras' own test of multi-worker mode, or the same test where Keras lacks it."""
  keras_test = getattr(internals.keras_tensorflow_trainer(),
                       "_collective_all_reduce_multi_worker", None)
  if keras_test is not None:
    return bool(keras_test(strategy))
  return _is_multi_worker_mirrored(strategy) and internals.in_multi_worker_mode(strategy)


def mean_over_replicas(values, strategy):
  """Every value of the structure ``values`` averaged element-wise over all replicas of
  all workers, in one all-reduce per dtype.

  Reducing each value on its own (``strategy.reduce`` per leaf) costs one cross-worker
  collective per logged value per step (the loss and each metric), a fixed cost that
  every step pays, including steps whose exchange sends nothing. Here each replica
  packs its values of one dtype into one vector (``strategy.run``), the vector is
  reduced once, and split back: the same element-wise sums, so the same results. A
  value whose shape is not fully known is reduced on its own.
  """
  leaves = keras.tree.flatten(values)
  reduced = list(leaves)
  groups = {}
  for i, leaf in enumerate(leaves):
    local = replica_steps.first_local(leaf, strategy)
    if tf.TensorShape(getattr(local, "shape", None)).is_fully_defined():
      groups.setdefault(local.dtype, []).append(i)
    else:
      reduced[i] = strategy.reduce("MEAN", leaf, axis=None)
  for members in groups.values():
    if len(members) == 1:
      reduced[members[0]] = strategy.reduce("MEAN", leaves[members[0]], axis=None)
      continue
    shapes = [replica_steps.first_local(leaves[i], strategy).shape for i in members]
    packed = strategy.run(
        lambda *vs: tf.concat([tf.reshape(v, [-1]) for v in vs], 0),
        args=tuple(leaves[i] for i in members))
    means = strategy.reduce("MEAN", packed, axis=None)
    parts = tf.split(means, [s.num_elements() for s in shapes])
    for i, part, shape in zip(members, parts, shapes):
      reduced[i] = tf.reshape(part, shape)
  return keras.tree.pack_sequence_as(values, reduced)


def _wrap_reduce_per_replica(original):
  @functools.wraps(original)
  def reduce_per_replica(values, strategy, reduction):
    if reduction in ("auto", "mean") and in_multi_worker_mode(strategy):
      # "auto" is "mean" for every strategy but TPUStrategy, which is not multi-worker MWMS.
      # A step with local steps averages only at its rounds' ends (``step_logs``).
      return step_logs.mean_or_held(values, strategy, mean_over_replicas)
    return original(values, strategy, reduction)

  return reduce_per_replica


patches.register(patches.Patch(
    name=SYMBOLIC_BUILD, owner=_trainer_class, attribute="_maybe_symbolic_build",
    wrap=_wrap_symbolic_build, needed=_has_failing_call(SYMBOLIC_BUILD)))
patches.register(patches.Patch(
    name=REDUCE_PER_REPLICA, owner=trainer_module, attribute="reduce_per_replica",
    wrap=_wrap_reduce_per_replica, needed=_has_failing_call(REDUCE_PER_REPLICA)))


def keras_multi_worker_fix_needed() -> Tuple[str, ...]:
  """The patches the installed Keras needs, whether or not they are applied.

  Returns:
    A tuple of patch names (``SYMBOLIC_BUILD``, ``REDUCE_PER_REPLICA``); empty for
    Keras < 3.0, a backend other than TensorFlow, or a Keras whose code no longer
    contains the failing calls.
  """
  return tuple(name for name in PATCHES if patches.needed(name))


def apply_keras_multi_worker_fix() -> Tuple[str, ...]:
  """Makes ``model.fit``/``evaluate`` work under multi-worker ``MultiWorkerMirroredStrategy``.

  Patches Keras' TensorFlow trainer in place (see the module docstring). Safe to call
  any number of times, from any thread: each patch is installed once. Has no effect on
  training under any other strategy, nor for Keras < 3.0, another Keras backend, or a
  Keras whose code no longer contains the failing calls.

  Returns:
    The names of the patches now installed (empty when none is needed).
  """
  for name in PATCHES:
    patches.install(name)
  return tuple(name for name in PATCHES if patches.applied(name))


def apply_keras_multi_worker_fix_for(strategy) -> Tuple[str, ...]:
  """Applies the fix when ``strategy`` is a ``MultiWorkerMirroredStrategy``; else nothing.

  ``CompressedOptimizer`` calls this when it is created and when it is built, so that
  the standard ``tf.distribute.MultiWorkerMirroredStrategy()`` trains with ``model.fit``
  with no call from the user. The call that installs a patch logs one line (logger
  ``tf_adacomp``) naming what was patched; later calls are silent no-ops.

  Args:
    strategy: any ``tf.distribute.Strategy`` (or None).

  Returns:
    The names of the patches newly installed by this call (usually empty).
  """
  if not _is_multi_worker_mirrored(strategy):
    return ()
  new = tuple(name for name in PATCHES if patches.install(name))
  if new:
    log.info(
        "patched Keras %s for model.fit under MultiWorkerMirroredStrategy "
        "(%s): %s.", keras.__version__, UPSTREAM_ISSUE, ", ".join(new))
  return new


def keras_multi_worker_fix_applied() -> bool:
  """Whether at least one patch of the fix is installed."""
  return any(patches.applied(name) for name in PATCHES)


def revert_keras_multi_worker_fix() -> Tuple[str, ...]:
  """Restores the original Keras functions (for tests).

  A patch that something else has replaced since is left as it is.

  Returns:
    The names of the patches removed.
  """
  return tuple(name for name in PATCHES if patches.revert(name))
