"""One mechanism to install and revert tf_adacomp's patches of Keras and TensorFlow.

A patch replaces one attribute of a framework module or class (a function, a method)
by a wrapper around the original, to fix an upstream behaviour the package cannot work
with otherwise. Every patch is a ``Patch`` registered here, with its guard beside it,
and goes through the same three calls:

- ``install(name)``: replaces the attribute, once, when the guard says the installed
  framework still needs it;
- ``revert(name)``: puts the original back (tests do, around a test that needs Keras
  as installed);
- ``applied(name)``: whether the attribute now holds this patch's wrapper.

One lock serialises them (patches are installed from optimizers' constructors, which
Keras may call from several threads), one table keeps the originals, and one marker on
every wrapper (``MARK``, holding the patch's name) tells a wrapper of ours from a
function that something else put there since: that one is never overwritten by a revert.
"""

import dataclasses
import threading
from typing import Any, Callable, Dict, Optional, Set

from tf_adacomp import log
from tf_adacomp.compat import versions

__all__ = ["MARK", "Patch", "applied", "install", "names", "needed", "original", "register",
           "revert"]

# The attribute set on every wrapper: the name of the patch it belongs to.
MARK = "_tf_adacomp_patch"

_LOCK = threading.RLock()
_PATCHES: Dict[str, "Patch"] = {}
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
    wrap: ``wrap(original) -> replacement``, the wrapper around the original.
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
  wrap: Callable[[Callable], Callable]
  needed: Callable[[Callable], bool] = _always
  missing: Optional[str] = None


def register(patch: Patch) -> Patch:
  """Makes ``patch`` known to ``install``, ``revert`` and ``applied``.

  Args:
    patch: a ``Patch``; registering the same one again is a no-op.

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


def _get(name: str) -> Patch:
  if name not in _PATCHES:
    raise KeyError(f"No patch is registered as {name!r}; registered: {', '.join(_PATCHES)}")
  return _PATCHES[name]


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


def install(name: str) -> bool:
  """Installs patch ``name`` where it is needed and not installed yet.

  Safe to call any number of times, from any thread.

  Returns:
    Whether this call installed it (False: installed before, not needed, or not
    applicable here).

  Raises:
    KeyError: no patch of that name.
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
    replacement = patch.wrap(current)
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
