"""Compressors by name: ``get_compressor("adacomp", conv_bin_size=50)``.

A compressor's config, as ``serialize`` writes it (and ``CompressedOptimizer.get_config``
saves it), is ``{"name": ..., "config": {...}, "version": FORMAT_VERSION}``. A release that
changes the meaning of a config raises ``FORMAT_VERSION``; this one reads its own and
older versions (a config without "version", written before it existed, is version 1)
and refuses newer ones, and constructor arguments it does not know, with an error
naming the config and the installed tf_adacomp, rather than train with a compressor
other than the one saved.
"""

from typing import Any, Callable, Dict

from tf_adacomp import _version
from tf_adacomp.compressors import base

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


def _check_config(identifier: Dict[str, Any]) -> None:
  """Checks a ``serialize`` dict: its keys, format version, name and config keys.

  Raises:
    ValueError: see ``get_compressor``; every message names the config received.
  """
  received = f"Received: identifier={identifier!r}"
  if not {"name", "config"} <= set(identifier) or not set(identifier) <= set(_CONFIG_KEYS):
    unknown = sorted(set(identifier) - set(_CONFIG_KEYS), key=str)
    newer = (f" Keys {unknown} may come from a newer tf_adacomp (installed: "
             f"{_version.__version__})." if unknown else "")
    raise ValueError(f"A compressor config is a dict with keys 'name', 'config' and "
                     f"optionally 'version'.{newer} {received}")
  version = identifier.get("version", 1)
  if not isinstance(version, int) or isinstance(version, bool) or version < 1:
    raise ValueError(f"A compressor config's 'version' must be an int >= 1. {received}")
  if version > FORMAT_VERSION:
    raise ValueError(
        f"This compressor config has format version {version}, written by a newer "
        f"tf_adacomp; the installed tf_adacomp {_version.__version__} reads versions up "
        f"to {FORMAT_VERSION}. Upgrade tf_adacomp to load it. {received}")
  name, config = identifier["name"], identifier["config"]
  if not isinstance(config, dict):
    raise ValueError(f"A compressor config's 'config' must be a dict of constructor "
                     f"arguments. {received}")
  if not isinstance(name, str) or name.lower() not in _REGISTRY:
    raise ValueError(f"Unknown compressor. {received}; known names: {', '.join(available())}")
  base.check_config_keys(_REGISTRY[name.lower()], config, received)
