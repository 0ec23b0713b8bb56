"""One mechanism to install and revert tf_adacomp's patches of Keras and TensorFlow.

A patch replaces one attribute of a framework module, class or object (a function, a
method, a class attribute) by a replacement, usually a wrapper around the original, to
fix an upstream behaviour the package cannot work with otherwise or to switch one off.
Every patch the package makes is registered here by name (``register``, ``names()``),
beside the code it serves, and goes through one of three kinds of call:

- a ``Patch`` of a class or module, for the rest of the process: ``install(name,
  *arguments)`` replaces the attribute once, when the guard says the installed framework
  still needs it (``arguments`` go to the wrapper's maker: the allocator of
  ``_collective_key_base``); ``revert(name)`` puts the original back (tests do, around a
  test that needs Keras as installed); ``applied(name)`` says whether the attribute now
  holds this patch's replacement, ``applied_now()`` which patches are in place;
- the same ``Patch`` for a while only: ``with patched(name, *arguments):`` installs it and
  reverts it on the way out (``_initialize_local_devices`` while one strategy is made);
- an ``InstancePatch`` of one object (an optimizer), never its class:
  ``patch_instance(obj, name, *arguments)``, ``unpatch_instance(obj, name)``,
  ``instance_applied(obj, name)``. The replacement becomes the object's own attribute, so
  that the class and every other instance keep the original (and the replica threads of
  one optimizer share it).

One lock serialises them all (patches are installed from optimizers' constructors, which
Keras may call from several threads). One marker on every replacement (``MARK``, holding
the patch's name) tells a replacement of ours from one that something else put there
since: that one is never overwritten by a revert. The originals a ``Patch`` replaced are
kept in one table, by name; what an object held itself before an ``InstancePatch`` (if
anything) is kept on the replacement, and so goes with the object, which is never held
here.

Every patch of the package
--------------------------
One entry per registered name: its kind and the module that registers it, what it
replaces and when it is installed, and its canaries, tests of the installed framework
that fail naming the private attribute when it moves or changes what the package relies
on. ``tests/compat/test_patches.py`` checks that these entries and ``names()`` list the
same patches, and that each canary is a test of that file.

- ``TensorFlowTrainer._maybe_symbolic_build``: class patch, ``compat.keras_multi_worker``.
  Keras' symbolic build of a model fed a multi-worker distributed batch; installed by
  ``CompressedOptimizer`` under a ``MultiWorkerMirroredStrategy`` and by
  ``distribute.multi_worker_strategy()``.
  Canary: ``tests/compat/test_keras_multi_worker.py::test_the_symbolic_build_still_reduces_the_distributed_batch``
- ``reduce_per_replica``: module patch (``keras.src.backend.tensorflow.trainer``),
  ``compat.keras_multi_worker``. Keras' reduction of per-replica logs; installed as above.
  Canary: ``tests/compat/test_keras_multi_worker.py::test_reduce_per_replica_still_fails_on_scalar_logs_in_multi_worker_mode``
- ``LossScaleOptimizer.check_finite``: class patch, ``compat.loss_scale``. One finiteness
  decision for all replicas; installed by ``CompressedOptimizer.__init__``.
  Canary: ``tests/compat/test_loss_scale.py::test_keras_decides_each_step_through_check_finite``
  Canary: ``tests/compat/test_loss_scale.py::test_keras_check_finite_answers_for_the_gradients_it_is_given``
- ``MirroredStrategy._collective_key_base``: class patch (a descriptor replaces TensorFlow's
  int), ``compat.internals``. Collective keys of its own per strategy; installed by
  importing ``tf_adacomp`` (``tf_adacomp.distribute``), the one patch that must be (see
  ``internals.own_collective_keys_per_strategy``).
  Canary: ``tests/compat/test_internals.py::test_own_collective_keys_per_strategy_gives_each_strategy_its_own_group_keys``
- ``MirroredStrategyV1._collective_key_base``: the same for
  ``tf.compat.v1.distribute.MirroredStrategy``, installed with it.
  Canary: ``tests/compat/test_internals.py::test_own_collective_keys_per_strategy_covers_the_v1_mirrored_strategy``
- ``CollectiveAllReduceExtended._initialize_local_devices``: class patch for a while
  (``patched``), ``compat.internals``. A worker's devices; installed by
  ``distribute.multi_worker_strategy(devices_per_worker=...)`` while it makes the strategy.
  Canary: ``tests/compat/test_internals.py::test_multi_worker_local_devices_are_the_strategys_devices``
- ``Optimizer._all_reduce_sum_gradients (summed already)``: instance patch,
  ``compat.internals``. The all-reduce of a Keras optimizer's ``apply``, switched off on
  a wrapper's inner and outer optimizers (``steps.inner.build``): they receive sums.
  Canary: ``tests/compat/test_internals.py::test_all_reduce_sum_gradients_is_the_only_all_reduce_of_apply``
- ``Optimizer._all_reduce_sum_gradients (local steps)``: instance patch,
  ``compat.internals``. The same all-reduce, replaced by each replica's own mean gradient
  on a model's optimizer by ``resist.ResIST``, from ``on_train_begin`` to ``on_train_end``.
  Canary: ``tests/compat/test_internals.py::test_all_reduce_sum_gradients_is_the_only_all_reduce_of_apply``
- ``Optimizer._update_model_variables_moving_average``: instance patch, ``ema``. The
  inner optimizer's EMA update, held back inside ``ema.deferred()``; installed by
  ``ema.defer`` (``steps.inner.build`` of an inner optimizer with ``use_ema=True``).
  Canary: ``tests/compat/test_internals.py::test_ema_hooks_are_what_apply_calls_for_the_average``
- ``Optimizer._overwrite_model_variables_with_average_value``: instance patch, ``ema``.
  Its overwrite of the weights, held back alike.
  Canary: ``tests/compat/test_internals.py::test_ema_hooks_are_what_apply_calls_for_the_average``

Only the two ``_collective_key_base`` patches are installed by importing the package;
everything else waits for the call named above (``python -c "import tf_adacomp; from
tf_adacomp.compat import patches; print(patches.applied_now())"``;
``tests/compat/test_patches.py`` checks it in a fresh process).
"""

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Dict, Optional, Set, Union

from tf_adacomp import log
from tf_adacomp.compat import versions

__all__ = ["MARK", "InstancePatch", "Patch", "applied", "applied_now", "install",
           "instance_applied", "names", "needed", "original", "patch_instance", "patched",
           "register", "revert", "unpatch_instance"]

# The attribute set on every wrapper: the name of the patch it belongs to.
MARK = "_tf_adacomp_patch"

_LOCK = threading.RLock()
_PATCHES: Dict[str, Union["Patch", "InstancePatch"]] = {}
_ORIGINALS: Dict[str, Any] = {}  # patch name -> the attribute its wrapper replaced
_WARNED: Set[str] = set()


def _always(original) -> bool:
  del original
  return True


@dataclasses.dataclass(frozen=True)
class Patch:
  """A replacement of one attribute of a framework module or class.

  Attributes:
    name: the key of the patch, unique in the package.
    owner: returns the module or class that holds the attribute, or None where the
      patch does not apply (another Keras backend, a Keras without the module).
    attribute: the attribute replaced. It is read from the owner's own namespace: an
      attribute a class inherits is not replaced there (that would shadow its base).
    wrap: ``wrap(original, *arguments) -> replacement``, the wrapper around the original
      (``arguments``: those given to ``install`` or ``patched``). Any object with a
      ``__dict__`` (a function, a descriptor): ``MARK`` is set on it.
    needed: the guard, ``needed(original) -> bool``: whether the installed framework's
      original still has the behaviour the wrapper fixes. An original that no longer
      has it is left alone.
    missing: a warning logged once (with the installed versions) when the owner is
      there without the attribute: a framework version the patch was not written for,
      where its fix cannot apply. None: say nothing.
  """
  name: str
  owner: Callable[[], Any]
  attribute: str
  wrap: Callable[..., Any]
  needed: Callable[[Callable], bool] = _always
  missing: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class InstancePatch:
  """A replacement of one attribute (a method) of one framework object, on that object.

  Attributes:
    name: the key of the patch, unique in the package.
    attribute: the attribute replaced on the instance (its class keeps the original).
    wrap: ``wrap(original, *arguments) -> replacement``: ``original`` is what the object
      gives for ``attribute`` now (a bound method, or None where it has none and
      ``missing`` is None), ``arguments`` those given to ``patch_instance``. It must
      return a new function per call (``MARK`` is set on it).
    missing: where the object has no such attribute: a message, formatted with
      ``type`` (the object's class name), ``attribute`` and ``versions``, of the
      RuntimeError ``patch_instance`` raises. None: the replacement is set anyway, with
      ``original`` None (the all-reduce patches: an optimizer without Keras' all-reduce
      method has none to switch off, and the instance attribute is never called).
  """
  name: str
  attribute: str
  wrap: Callable[..., Callable]
  missing: Optional[str] = None


def register(patch: Union[Patch, InstancePatch]) -> Union[Patch, InstancePatch]:
  """Makes ``patch`` known to ``names()`` and to the calls of its kind.

  Args:
    patch: a ``Patch`` or an ``InstancePatch``; registering the same one again is a no-op.

  Returns:
    ``patch``.

  Raises:
    ValueError: another patch is registered under the same name.
  """
  with _LOCK:
    if _PATCHES.get(patch.name, patch) is not patch:
      raise ValueError(f"A patch is already registered as {patch.name!r}: "
                       f"{_PATCHES[patch.name]!r}")
    _PATCHES[patch.name] = patch
  return patch


def names():
  """The names of the registered patches, in registration order."""
  with _LOCK:
    return tuple(_PATCHES)


def applied_now():
  """The names of the ``Patch`` es applied now, in registration order (an
  ``InstancePatch`` is applied to objects, not to the process: ``instance_applied``)."""
  with _LOCK:
    return tuple(name for name, patch in _PATCHES.items()
                 if isinstance(patch, Patch) and applied(name))


def _get(name: str, kind: type = Patch):
  if name not in _PATCHES:
    raise KeyError(f"No patch is registered as {name!r}; registered: {', '.join(_PATCHES)}")
  patch = _PATCHES[name]
  if not isinstance(patch, kind):
    raise TypeError(f"The patch {name!r} is a {type(patch).__name__}, not a {kind.__name__}: "
                    f"{'install it with patch_instance' if kind is Patch else 'use install'}")
  return patch


def _owner_and_current(patch: Patch):
  owner = patch.owner()
  if owner is None:
    return None, None
  return owner, vars(owner).get(patch.attribute)


def _is_ours(function, name: str) -> bool:
  return getattr(function, MARK, None) == name


def original(name: str):
  """The framework's own attribute that patch ``name`` replaces (installed or not).

  Returns:
    The original function, or None where the patch does not apply or the attribute
    is missing.

  Raises:
    KeyError: no patch of that name.
  """
  with _LOCK:
    patch = _get(name)
    _, current = _owner_and_current(patch)
    if _is_ours(current, name):
      return _ORIGINALS[name]
    return current


def needed(name: str) -> bool:
  """Whether the installed framework needs patch ``name`` (applied or not): the patch
  applies here and its guard says the original still has the behaviour it fixes."""
  with _LOCK:
    function = original(name)
    return function is not None and bool(_get(name).needed(function))


def applied(name: str) -> bool:
  """Whether the attribute of patch ``name`` holds its wrapper now."""
  with _LOCK:
    _, current = _owner_and_current(_get(name))
    return _is_ours(current, name)


def install(name: str, *arguments) -> bool:
  """Installs patch ``name`` where it is needed and not installed yet.

  Safe to call any number of times, from any thread.

  Args:
    name: a registered ``Patch``.
    *arguments: handed to its ``wrap`` after the original (only by the call that
      installs it).

  Returns:
    Whether this call installed it (False: installed before, not needed, or not
    applicable here).

  Raises:
    KeyError: no patch of that name.
    TypeError: it is an ``InstancePatch``.
  """
  with _LOCK:
    patch = _get(name)
    owner, current = _owner_and_current(patch)
    if owner is None or _is_ours(current, name):
      return False
    if current is None:
      if patch.missing and name not in _WARNED:
        _WARNED.add(name)
        log.warning("%s (%s)", patch.missing, versions.installed())
      return False
    if not patch.needed(current):
      return False
    replacement = patch.wrap(current, *arguments)
    setattr(replacement, MARK, name)
    _ORIGINALS[name] = current
    setattr(owner, patch.attribute, replacement)
    return True


def revert(name: str) -> bool:
  """Puts back the original that patch ``name`` replaced.

  An attribute that something else has replaced since is left as it is.

  Returns:
    Whether this call restored the original.

  Raises:
    KeyError: no patch of that name.
  """
  with _LOCK:
    patch = _get(name)
    replaced = _ORIGINALS.pop(name, None)
    owner, current = _owner_and_current(patch)
    if replaced is None or owner is None or not _is_ours(current, name):
      return False
    setattr(owner, patch.attribute, replaced)
    return True


@contextlib.contextmanager
def patched(name: str, *arguments):
  """Within it, patch ``name`` is installed (``install(name, *arguments)``); reverted on
  the way out. For a patch that must not outlive one call (it changes the framework for
  the whole process while it lasts).

  Args:
    name: a registered ``Patch``, not installed now.
    *arguments: handed to its ``wrap``.

  Raises:
    RuntimeError: it could not be installed: applied already (the two would not nest),
      not applicable here, or its attribute is missing (logged as ``install`` does).
  """
  if not install(name, *arguments):
    state = "is applied already" if applied(name) else "does not apply here"
    raise RuntimeError(f"The patch {name!r} {state}: it cannot be installed for a while "
                       f"({versions.installed()}).")
  try:
    yield
  finally:
    revert(name)


# What an instance patch's replacement records of the object's own attribute before it.
_REPLACED = "_tf_adacomp_replaced"
_ABSENT = object()  # the object had no attribute of its own


def patch_instance(obj, name: str, *arguments) -> bool:
  """Installs the ``InstancePatch`` ``name`` on ``obj`` (its own attribute), once.

  Args:
    obj: the object (a framework optimizer).
    name: a registered ``InstancePatch``.
    *arguments: handed to its ``wrap`` after the original.

  Returns:
    Whether this call installed it (False: ``obj`` has it already).

  Raises:
    KeyError: no patch of that name.
    TypeError: it is a ``Patch``.
    RuntimeError: ``obj`` lacks the attribute and the patch has a ``missing`` message.
  """
  with _LOCK:
    patch = _get(name, InstancePatch)
    own = vars(obj).get(patch.attribute, _ABSENT)
    if _is_ours(own, name):
      return False
    current = getattr(obj, patch.attribute, None)
    if current is None and patch.missing:
      raise RuntimeError(patch.missing.format(type=type(obj).__name__,
                                              attribute=patch.attribute,
                                              versions=versions.installed()))
    replacement = patch.wrap(current, *arguments)
    setattr(replacement, MARK, name)
    setattr(replacement, _REPLACED, own)
    setattr(obj, patch.attribute, replacement)
    return True


def instance_applied(obj, name: str) -> bool:
  """Whether ``obj``'s own attribute of the ``InstancePatch`` ``name`` is its replacement."""
  with _LOCK:
    patch = _get(name, InstancePatch)
    return _is_ours(vars(obj).get(patch.attribute), name)


def unpatch_instance(obj, name: str) -> bool:
  """Takes the ``InstancePatch`` ``name`` off ``obj``: what ``obj`` held itself before is
  put back, or, where it held nothing, its class's attribute shows through again. An
  attribute that something else has replaced since is left as it is.

  Returns:
    Whether this call took it off.

  Raises:
    KeyError: no patch of that name.
    TypeError: it is a ``Patch``.
  """
  with _LOCK:
    patch = _get(name, InstancePatch)
    current = vars(obj).get(patch.attribute)
    if not _is_ours(current, name):
      return False
    replaced = getattr(current, _REPLACED)
    if replaced is _ABSENT:
      delattr(obj, patch.attribute)
    else:
      setattr(obj, patch.attribute, replaced)
    return True
