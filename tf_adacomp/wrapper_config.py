"""The optimizer wrappers' saved configs read back: the inner (and outer) optimizer
deserialized with a message that names which, and configs saved by older releases
carried forward."""

import keras

from tf_adacomp import hierarchy as hierarchy_lib
from tf_adacomp.steps import shared_adam


def shown(value):
  """``repr(value)``, cut at 400 characters (configs hold whole optimizers)."""
  text = repr(value)
  return text if len(text) <= 400 else text[:400] + "..."


def checked(config, wrapper="CompressedOptimizer"):
  """A copy of ``config``, or TypeError / ValueError where it cannot be one."""
  if not isinstance(config, dict):
    raise TypeError(f"`config` must be a dict, as {wrapper}.get_config() returns. "
                    f"Received: config={shown(config)}")
  if "inner_optimizer" not in config:
    raise ValueError(
        f"{wrapper}.from_config needs the key 'inner_optimizer' (the serialized inner "
        f"optimizer, as get_config() writes it). Received: config={shown(config)}")
  config = dict(config)
  # The saved machine's layout: where it does not fit, build() falls back (hierarchy.py).
  config["devices_per_worker"] = hierarchy_lib.saved_devices_per_worker(
      config.get("devices_per_worker"))
  return config


def keras_optimizer(key, value, custom_objects):
  """``value`` deserialized as a Keras 3 optimizer (an optimizer is kept as it is)."""
  if isinstance(value, keras.optimizers.Optimizer):
    return value  # already an optimizer: nothing to deserialize
  try:
    return keras.saving.deserialize_keras_object(value, custom_objects=custom_objects)
  except (TypeError, ValueError) as error:
    # Keras' message does not say which of the config's optimizers it was.
    raise ValueError(
        f"`{key}` in the config of CompressedOptimizer cannot be deserialized "
        f"({error}). Received: {key}={shown(value)}") from error


def keras3_arguments(config, custom_objects):
  """``tf_adacomp.CompressedOptimizer``'s arguments from its ``get_config()`` dict, of
  this release or an older one: ``(inner_optimizer, other keyword arguments)``."""
  config = checked(config)
  inner = keras_optimizer("inner_optimizer", config.pop("inner_optimizer"), custom_objects)
  if isinstance(config.get("outer_optimizer"), dict):
    config["outer_optimizer"] = keras_optimizer("outer_optimizer", config["outer_optimizer"],
                                                custom_objects)
  if "exchange" not in config and config.get("reduction", "sum") == "sum":
    # Saved before `exchange` existed: adasum_mode did nothing with reduction="sum"
    # (the gradient exchange ran), so keep that rather than refuse "delta" now.
    config["adasum_mode"] = None
    config["exchange"] = "gradients"
  # Saved before `second_moment` existed: each replica kept its own.
  config.setdefault("second_moment", "local")
  if (config["second_moment"] in ("shared", "global")
      and config.get("second_moment_interval") is None
      and config.get("local_steps", 1) in (None, 1)):
    # Saved when a shared moment's None meant averages at steps 1, 2, 4, ... (written
    # out as "doubling" now that None means 0 for "global"): the same training, and the
    # same variables to load (the shared moment's).
    config["second_moment_interval"] = shared_adam.DOUBLING
  return inner, config
