"""The package's log lines: information at INFO, problems at WARNING, one short prefix.

Everything the package says goes through the ``tf_adacomp`` logger of Python's
``logging``. Left alone, Python prints nothing below WARNING and an absl program (the
examples, anything run by ``absl.app.run``) prefixes each line with its own
``W1126 13:52:16.780130 140232947128000 file.py:73]``, which makes information read as
a warning. So, as TensorFlow does for its own logger, the first line logged installs one
handler on ``tf_adacomp`` that writes to stderr as

    tf_adacomp: the first compressed step compiled 7 XLA programs in 5.0 s.
    tf_adacomp WARNING: ...

and stops the record there (``propagate = False``), unless the user configured the
logger before (a handler or a level of their own): then theirs is used as it is.
``logging.getLogger("tf_adacomp").setLevel(logging.WARNING)`` hides the information.
"""

import logging
import sys

LOGGER = logging.getLogger("tf_adacomp")
_HANDLER = None  # the handler this module installed, if any


class _Formatter(logging.Formatter):
  """``tf_adacomp: message`` for information, ``tf_adacomp LEVEL: message`` above it."""

  def format(self, record):
    message = super().format(record)
    if record.levelno <= logging.INFO:
      return f"tf_adacomp: {message}"
    return f"tf_adacomp {record.levelname}: {message}"


def _configured() -> logging.Logger:
  """The package's logger, with this module's handler unless the user set it up."""
  global _HANDLER
  if _HANDLER is None and not LOGGER.handlers and LOGGER.level == logging.NOTSET:
    _HANDLER = logging.StreamHandler(sys.stderr)
    _HANDLER.setFormatter(_Formatter())
    LOGGER.addHandler(_HANDLER)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False  # absl's root handler would print it again, prefixed
  return LOGGER


def info(message: str, *args) -> None:
  """Logs information the user should see once (``message % args``)."""
  _configured().info(message, *args)


def warning(message: str, *args) -> None:
  """Logs a problem the user should act on (``message % args``)."""
  _configured().warning(message, *args)
