"""Compressors by name: ``get_compressor("adacomp", conv_bin_size=50)``.

A compressor's config, as ``serialize`` writes it (and ``CompressedOptimizer.get_config``
saves it), is ``{"name": ..., "config": {...}, "version": FORMAT_VERSION}``. A release that
changes the meaning of a config raises ``FORMAT_VERSION``; this one reads its own and
older versions (a config without "version", written before it existed, is version 1)
and refuses newer ones, and constructor arguments it does not know, with an error
naming the config and the installed tf_adacomp, rather than train with a compressor
other than the one saved.
"""

import inspect
from typing import Any, Callable, Dict

# The version of the config format ``serialize`` writes and the newest one read here.
FORMAT_VERSION = 1
_CONFIG_KEYS = ("name", "config", "version")

_REGISTRY: Dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
  """Class decorator: makes a compressor class available to ``get_compressor(name)``."""

  def decorate(cls):
    if name in _REGISTRY and _REGISTRY[name] is not cls:
      raise ValueError(f"A compressor is already registered as {name!r}: {_REGISTRY[name]}")
    _REGISTRY[name] = cls
    cls.name = name
    return cls

  return decorate


def available() -> list:
  """Registered compressor names, sorted."""
  return sorted(_REGISTRY)


def get_compressor(identifier: Any = "none", **kwargs):
  """Returns a compressor from a name, a config dict or an instance.

  Args:
    identifier: a registered name ("none", "fp16", "bf16", "topk", "adacomp"; case
      insensitive), a dict ``{"name": ..., "config": {...}, "version": 1}`` as written
      by ``serialize`` ("version" may be missing: configs saved before it existed), a
      ``Compressor`` (returned as is), or None (no compression).
    **kwargs: constructor arguments, with a name only.

  Returns:
    A ``Compressor``.

  Raises:
    ValueError: unknown name or malformed config; a config of a newer format version
      or with constructor arguments this release does not know (a newer release's);
      kwargs given with an instance.
  """
  from tf_adacomp.compressors import base  # avoid an import cycle at module load

  if identifier is None:
    identifier = "none"
  if isinstance(identifier, base.Compressor):
    if kwargs:
      raise ValueError(f"Keyword arguments apply to a compressor name, not an instance. "
                       f"Received: identifier={identifier!r}, kwargs={kwargs!r}")
    return identifier
  if isinstance(identifier, dict):
    _check_config(identifier)
    return get_compressor(identifier["name"], **{**identifier["config"], **kwargs})
  if not isinstance(identifier, str) or identifier.lower() not in _REGISTRY:
    raise ValueError(f"Unknown compressor. Received: identifier={identifier!r}; "
                     f"known names: {', '.join(available())}")
  return _REGISTRY[identifier.lower()](**kwargs)


def serialize(compressor) -> Dict[str, Any]:
  """``{"name": ..., "config": ..., "version": FORMAT_VERSION}``, the inverse of
  ``get_compressor``."""
  return {"name": compressor.name, "config": compressor.get_config(),
          "version": FORMAT_VERSION}


def installed_version() -> str:
  """The installed tf_adacomp's version, for errors about configs of other releases."""
  import tf_adacomp  # pylint: disable=g-import-not-at-top  (loaded by now; avoids a cycle)
  return getattr(tf_adacomp, "__version__", "unknown")


def _check_config(identifier: Dict[str, Any]) -> None:
  """Checks a ``serialize`` dict: its keys, format version, name and config keys.

  Raises:
    ValueError: see ``get_compressor``; every message names the config received.
  """
  received = f"Received: identifier={identifier!r}"
  if not {"name", "config"} <= set(identifier) or not set(identifier) <= set(_CONFIG_KEYS):
    unknown = sorted(set(identifier) - set(_CONFIG_KEYS), key=str)
    newer = (f" Keys {unknown} may come from a newer tf_adacomp (installed: "
             f"{installed_version()})." if unknown else "")
    raise ValueError(f"A compressor config is a dict with keys 'name', 'config' and "
                     f"optionally 'version'.{newer} {received}")
  version = identifier.get("version", 1)
  if not isinstance(version, int) or isinstance(version, bool) or version < 1:
    raise ValueError(f"A compressor config's 'version' must be an int >= 1. {received}")
  if version > FORMAT_VERSION:
    raise ValueError(
        f"This compressor config has format version {version}, written by a newer "
        f"tf_adacomp; the installed tf_adacomp {installed_version()} reads versions up "
        f"to {FORMAT_VERSION}. Upgrade tf_adacomp to load it. {received}")
  name, config = identifier["name"], identifier["config"]
  if not isinstance(config, dict):
    raise ValueError(f"A compressor config's 'config' must be a dict of constructor "
                     f"arguments. {received}")
  if not isinstance(name, str) or name.lower() not in _REGISTRY:
    raise ValueError(f"Unknown compressor. {received}; known names: {', '.join(available())}")
  check_config_keys(_REGISTRY[name.lower()], config, received)


def check_config_keys(cls: type, config: Dict[str, Any], received: str) -> None:
  """Refuses ``config`` keys that ``cls``'s constructor does not take.

  A key no constructor of this release knows comes from a newer release (or a
  misspelling): building without it would silently change the compressor.

  Args:
    cls: a ``Compressor`` subclass.
    config: its constructor arguments, from a saved config.
    received: the "Received: ..." part of the error.

  Raises:
    ValueError: keys the constructor does not take, naming them and the installed
      tf_adacomp.
  """
  parameters = inspect.signature(cls.__init__).parameters.values()
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
    return  # takes any keyword: the constructor checks for itself
  known = {p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                    inspect.Parameter.KEYWORD_ONLY)}
  known.discard("self")
  unknown = sorted(set(config) - known, key=str)
  if unknown:
    raise ValueError(
        f"The {cls.__name__} config has argument(s) {unknown} that the installed "
        f"tf_adacomp {installed_version()} does not know (it takes "
        f"{', '.join(sorted(known))}): the config may come from a newer tf_adacomp. "
        f"{received}")
