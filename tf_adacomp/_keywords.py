"""Unknown keyword arguments of the public constructors, refused with a suggestion.

Python's own error ("__init__() got an unexpected keyword argument 'local_step'") names
neither the value nor the argument that was meant, and a constructor that takes
``**kwargs`` gets no error from Python at all. Every public constructor of the package
answers an unknown keyword the same way instead, through this module::

    TypeError: CompressedOptimizer() got an unexpected keyword argument 'local_step'
    (Received: local_step=8). Did you mean 'local_steps'?
"""

import difflib
import functools
import inspect
from typing import Any, Callable, Dict, Iterable

# A received value is shown in full up to this many characters (an optimizer's repr
# would otherwise swamp the one name that matters).
_MAX_VALUE_CHARS = 200
_KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def closest(name: str, valid: Iterable[str]):
  """The valid name closest to ``name`` (case aside), or None when none is close."""
  by_lower = {v.lower(): v for v in sorted(valid)}
  found = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=0.6)
  return by_lower[found[0]] if found else None


def _shown(value) -> str:
  text = repr(value)
  return text if len(text) <= _MAX_VALUE_CHARS else text[:_MAX_VALUE_CHARS] + "..."


def unexpected_keywords(owner: str, unknown: Dict[str, Any], valid: Iterable[str]) -> TypeError:
  """The error for keyword arguments ``owner`` does not take (Python's type, TypeError).

  Args:
    owner: the constructor's name as the user wrote it ("CompressedOptimizer").
    unknown: the unknown arguments and their values, in the order received.
    valid: every keyword the constructor takes.

  Returns:
    A TypeError naming each unknown argument with its value and, for each, the closest
    valid name; where one has none close, the message lists the valid names.
  """
  valid = sorted(set(valid))
  names = list(unknown)
  quoted = ", ".join(repr(str(n)) for n in names)
  received = ", ".join(f"{n}={_shown(v)}" for n, v in unknown.items())
  what = (f"an unexpected keyword argument {quoted}" if len(names) == 1
          else f"unexpected keyword arguments {quoted}")
  message = f"{owner}() got {what} (Received: {received})."
  matches = {n: closest(n, valid) for n in names}
  found = [(n, m) for n, m in matches.items() if m is not None]
  if len(names) == 1 and found:
    message += f" Did you mean {found[0][1]!r}?"
  elif found:
    message += " Did you mean " + ", ".join(f"{m!r} for {str(n)!r}" for n, m in found) + "?"
  if len(found) < len(names):
    message += f" {owner}() takes: {', '.join(valid)}."
  return TypeError(message)


def keyword_names(function: Callable) -> tuple:
  """The names ``function`` takes as keywords (``self`` aside)."""
  return tuple(name for name, p in inspect.signature(function).parameters.items()
               if p.kind in _KEYWORD_KINDS and name != "self")


def suggest_keywords(init: Callable) -> Callable:
  """Decorates a class's ``__init__``: an unknown keyword argument raises
  ``unexpected_keywords``' TypeError, named after the class being made (a subclass that
  inherits this ``__init__``, as ``FP16`` does ``Compressor``'s, is named itself).

  The signature stays the decorated one (``inspect.signature`` follows ``__wrapped__``),
  which ``compressors.base.check_config_keys`` reads. Only the keywords are looked at:
  a positional or missing argument is left to Python's own error.
  """
  parameters = inspect.signature(init).parameters.values()
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
    raise TypeError(f"suggest_keywords cannot check {init.__qualname__}, which takes "
                    f"**kwargs: call refuse_unknown_keywords on them instead")
  valid = frozenset(keyword_names(init))

  @functools.wraps(init)
  def checked(self, *args, **kwargs):
    unknown = {k: v for k, v in kwargs.items() if k not in valid}
    if unknown:
      raise unexpected_keywords(type(self).__name__, unknown, valid)
    return init(self, *args, **kwargs)

  return checked


def refuse_unknown_keywords(owner: str, kwargs: Dict[str, Any], valid: Iterable[str]) -> None:
  """Raises ``unexpected_keywords``' TypeError if ``kwargs`` holds any argument: for a
  constructor that takes ``**kwargs`` and has popped every one it knows."""
  if kwargs:
    raise unexpected_keywords(owner, kwargs, valid)
