"""Compressors by name: ``get_compressor("adacomp", conv_bin_size=50)``."""

from typing import Any, Callable, Dict

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
      insensitive), a dict ``{"name": ..., "config": {...}}`` as written by
      ``serialize``, a ``Compressor`` (returned as is), or None (no compression).
    **kwargs: constructor arguments, with a name only.

  Returns:
    A ``Compressor``.

  Raises:
    ValueError: unknown name or malformed config; kwargs given with an instance.
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
    if set(identifier) != {"name", "config"}:
      raise ValueError(f"A compressor config is a dict with keys 'name' and 'config'. "
                       f"Received: identifier={identifier!r}")
    return get_compressor(identifier["name"], **{**identifier["config"], **kwargs})
  if not isinstance(identifier, str) or identifier.lower() not in _REGISTRY:
    raise ValueError(f"Unknown compressor. Received: identifier={identifier!r}; "
                     f"known names: {', '.join(available())}")
  return _REGISTRY[identifier.lower()](**kwargs)


def serialize(compressor) -> Dict[str, Any]:
  """``{"name": ..., "config": ...}``, the inverse of ``get_compressor``."""
  return {"name": compressor.name, "config": compressor.get_config()}
