"""The Keras 3 wrapper's arguments, checked and resolved in one place
(``tf_adacomp.CompressedOptimizer``'s docstring says what each means); each mode's own
checks live in its module and are called from here, in the order below (the first
argument that cannot apply is the one named).
"""

from typing import NamedTuple, Optional, Union

import keras

from tf_adacomp import _keywords
from tf_adacomp import exchange as exchange_lib
from tf_adacomp import hierarchy as hierarchy_lib
from tf_adacomp import local_steps as local_steps_lib
from tf_adacomp.compressors import base
from tf_adacomp.compressors import cast
from tf_adacomp.compressors import registry
from tf_adacomp.ops import checks
from tf_adacomp.steps import momentum_masking as masking_lib
from tf_adacomp.steps import shared_adam

# Keras' base optimizer arguments and their defaults (tests/test_optimizer.py checks them
# against Keras' signature). Keras passes the defaults back when deserializing; any other
# value belongs to the inner optimizer.
BASE_DEFAULTS = {"weight_decay": None, "clipnorm": None, "global_clipnorm": None,
                 "clipvalue": None, "use_ema": False, "ema_momentum": 0.99,
                 "ema_overwrite_frequency": None, "loss_scale_factor": None,
                 "gradient_accumulation_steps": None}
# The private method of Keras' TensorFlow optimizers that all-reduces gradients in
# `apply` (keras/src/backend/tensorflow/optimizer.py; Keras 3.15): replaced on the inner
# optimizer, whose gradients are summed already (and by ResIST's trainer). Guarded by
# tests/test_optimizer.py.
ALL_REDUCE_HOOK = "_all_reduce_sum_gradients"
ADASUM_MODES = ("gradient", "delta")
EXCHANGES = ("gradients", "updates")
# What ``exchange=None`` means, per reduction (docs/convergence.md has the measurements
# behind "updates"; Adasum keeps its documented default, the Adasum of gradients).
DEFAULT_EXCHANGE = {"sum": "updates", "adasum": "gradients"}
_EXCHANGE_OF_ADASUM_MODE = {"gradient": "gradients", "delta": "updates"}


class Settings(NamedTuple):
  """The resolved arguments of ``CompressedOptimizer`` (its attributes of these names)."""
  compressor: base.Compressor
  start_step: int
  reduction: str
  exchange: str
  momentum_masking: bool
  local_clipnorm: Optional[float]
  second_moment: str
  second_moment_interval: Union[None, int, str]
  precondition: str
  local_steps: int
  outer_optimizer: Union[str, keras.optimizers.Optimizer]
  hierarchical: Optional[bool]
  devices_per_worker: Optional[int]
  dense_when_faster: object  # True, False or "float32"


def resolve(wrapper_init, inner_optimizer, compressor, start_step, reduction, adasum_mode,
            exchange, momentum_masking, local_clipnorm, second_moment,
            second_moment_interval, precondition, local_steps, outer_optimizer,
            hierarchical, devices_per_worker, dense_when_faster, kwargs) -> Settings:
  """Checks ``CompressedOptimizer``'s arguments (``wrapper_init``: its ``__init__``, for
  the valid keyword names) and resolves the defaults.

  Raises:
    TypeError, ValueError, RuntimeError: as ``CompressedOptimizer`` documents.
  """
  for argument, default in BASE_DEFAULTS.items():
    value = kwargs.pop(argument, default)
    if (value is None) != (default is None) or value != default:
      raise ValueError(f"CompressedOptimizer does not take `{argument}`: set it on the "
                       f"inner optimizer. Received: {argument}={value!r}")
  # Keras' own base arguments are valid names too (at their defaults, above): a
  # misspelt one is answered with the closest of either.
  _keywords.refuse_unknown_keywords(
      "CompressedOptimizer", kwargs,
      _keywords.keyword_names(wrapper_init) + tuple(BASE_DEFAULTS))
  check_inner(inner_optimizer)
  start_step = checks.non_negative_int(start_step, "start_step")
  reduction = exchange_lib.check_reduction(reduction)
  exchange = resolve_exchange(reduction, adasum_mode, exchange)
  local_clipnorm = checks.positive_number(local_clipnorm, "local_clipnorm", optional=True)
  named, compressor = compressor, registry.get_compressor(compressor)
  masking_lib.check(momentum_masking, exchange, inner_optimizer, compressor)
  local_steps = local_steps_lib.check_local_steps(local_steps)
  outer_optimizer = local_steps_lib.resolve_outer_optimizer(outer_optimizer)
  check_rounds(local_steps, local_steps_lib.AVERAGE if outer_optimizer is None
               else outer_optimizer, exchange, reduction, momentum_masking)
  if local_steps > 1 and getattr(inner_optimizer, "use_ema", False):
    # Within a round each replica's weights are its own: there is no one average of
    # them to keep, as Keras' EMA would.
    raise ValueError("`local_steps` > 1 does not take an inner optimizer with "
                     "use_ema=True (the replicas' weights differ within a round). "
                     f"Received: local_steps={local_steps!r}, use_ema=True")
  second_moment = shared_adam.resolve_second_moment(
      second_moment, exchange, reduction, inner_optimizer, momentum_masking, local_steps)
  dense_when_faster = check_dense_when_faster(dense_when_faster, reduction, start_step,
                                              momentum_masking, compressor)
  compressor = compressor_of_rounds(named, compressor, local_steps, second_moment)
  if outer_optimizer is None:
    outer_optimizer = local_steps_lib.default_outer(
        local_steps, second_moment, not isinstance(compressor, cast.NoCompression))
  return Settings(
      compressor=compressor, start_step=start_step, reduction=reduction, exchange=exchange,
      momentum_masking=momentum_masking, local_clipnorm=local_clipnorm,
      second_moment=second_moment,
      second_moment_interval=shared_adam.resolve_interval(
          second_moment_interval, second_moment, precondition, local_steps),
      precondition=shared_adam.check_no_after_without_average(
          shared_adam.check_precondition(precondition, second_moment, local_steps),
          second_moment_interval),
      local_steps=local_steps, outer_optimizer=outer_optimizer,
      hierarchical=hierarchy_lib.check_hierarchical(hierarchical),
      devices_per_worker=hierarchy_lib.check_devices_per_worker(devices_per_worker),
      dense_when_faster=dense_when_faster)


def compressor_of_rounds(named, compressor, local_steps, second_moment):
  """``compressor``, or where it was named "adacomp" (``named``, the argument) and an Adam
  or AdamW inside rounds of local steps divides by its estimate of the global batch's
  second moment (``second_moment="global"``), AdaComp with bins of
  ``local_steps.ADAM_ROUND_BIN_SIZE`` on dense and recurrent kernels (the reason is
  there). A compressor given as an instance or a config is the user's, as it is."""
  if (local_steps > 1 and second_moment == "global" and isinstance(named, str)
      and named.lower() == "adacomp"):
    size = local_steps_lib.ADAM_ROUND_BIN_SIZE
    return registry.get_compressor(named, dense_bin_size=size, recurrent_bin_size=size)
  return compressor


def check_dense_when_faster(dense_when_faster, reduction, start_step, momentum_masking,
                            compressor):
  """``dense_when_faster`` as True, False or "float32", or ValueError where it cannot
  apply: its dense exchange is a sum (not Adasum), and a warm-up or momentum masking
  would change what its probes measure or mask.

  None (the default) is True wherever True applies and the compressor compresses: the
  wrapper is never much slower than Keras' dense step, where that is the faster one
  (docs/performance.md). With ``compressor="none"`` there is nothing to choose between.
  """
  if dense_when_faster is None:
    return (reduction == "sum" and not start_step and not momentum_masking
            and not isinstance(compressor, cast.NoCompression))
  if not (isinstance(dense_when_faster, str) and dense_when_faster == "float32"):
    if not isinstance(dense_when_faster, bool):
      raise ValueError("`dense_when_faster` must be None, True, False or 'float32'. "
                       f"Received: dense_when_faster={dense_when_faster!r}")
    if not dense_when_faster:
      return False
  received = f"Received: dense_when_faster={dense_when_faster!r}, "
  if reduction != "sum":
    raise ValueError("`dense_when_faster` chooses between the compressed exchange and "
                     "the dense sum, and needs reduction='sum'. "
                     f"{received}reduction={reduction!r}")
  if start_step:
    raise ValueError("`dense_when_faster` measures its own dense steps and does not "
                     "take a dense warm-up (`start_step` > 0). "
                     f"{received}start_step={start_step!r}")
  if momentum_masking:
    raise ValueError("`dense_when_faster` does not take `momentum_masking=True` (a "
                     f"dense step would mask nothing). {received}momentum_masking=True")
  return dense_when_faster


def check_inner(inner_optimizer):
  """Raises unless ``inner_optimizer`` is a Keras optimizer the wrapper can drive."""
  if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
    raise TypeError(f"`inner_optimizer` must be a keras.optimizers.Optimizer. "
                    f"Received: inner_optimizer={inner_optimizer!r}")
  if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
    # The wrapper skips a non-finite step before the inner optimizer sees it, so a
    # LossScaleOptimizer inside would never lower its scale (and skip every later
    # overflowing step); around the wrapper it sees every gradient.
    raise ValueError(
        "CompressedOptimizer cannot wrap a LossScaleOptimizer (its loss scale would never "
        "go down): wrap the other way round, LossScaleOptimizer(CompressedOptimizer("
        "inner)), as Keras' mixed precision does for `model.compile`. Received: "
        f"inner_optimizer={inner_optimizer!r}")
  if not hasattr(inner_optimizer, ALL_REDUCE_HOOK):
    # Without it the inner optimizer would all-reduce the already-summed gradient
    # again: replicas x the gradient, and dense traffic besides.
    raise RuntimeError(
        f"CompressedOptimizer switches off the inner optimizer's own all-reduce "
        f"(`{ALL_REDUCE_HOOK}` of Keras' TensorFlow optimizers), which this "
        f"optimizer does not have (Keras {keras.__version__}, backend "
        f"{keras.backend.backend()}). Received: inner_optimizer={inner_optimizer!r}")


def resolve_exchange(reduction, adasum_mode, exchange):
  """The exchange that ``exchange`` and the older ``adasum_mode`` ask for, or ValueError."""
  if adasum_mode is not None and adasum_mode not in ADASUM_MODES:
    raise ValueError(f"`adasum_mode` must be one of {ADASUM_MODES} or None. "
                     f"Received: adasum_mode={adasum_mode!r}")
  if exchange is not None and exchange not in EXCHANGES:
    raise ValueError(f"`exchange` must be one of {EXCHANGES} or None. "
                     f"Received: exchange={exchange!r}")
  if adasum_mode == "delta" and reduction != "adasum":
    raise ValueError("`adasum_mode='delta'` is Adasum of the replicas' updates and needs "
                     "reduction='adasum' (for the mean of the updates, pass "
                     "exchange='updates'). Received: adasum_mode='delta', "
                     f"reduction={reduction!r}")
  implied = _EXCHANGE_OF_ADASUM_MODE.get(adasum_mode)
  if implied is not None and exchange is not None and exchange != implied:
    raise ValueError(f"`adasum_mode={adasum_mode!r}` means exchange={implied!r}, which "
                     f"contradicts `exchange`. Received: adasum_mode={adasum_mode!r}, "
                     f"exchange={exchange!r}")
  return exchange or implied or DEFAULT_EXCHANGE[reduction]


def check_rounds(local_steps, outer_optimizer, exchange, reduction, momentum_masking):
  """Raises ValueError where ``local_steps`` or ``outer_optimizer`` cannot apply."""
  if local_steps == 1 and isinstance(outer_optimizer, str):
    return  # the update exchange as it is (or the gradient exchange)
  received = f"local_steps={local_steps!r}, outer_optimizer={outer_optimizer!r}"
  if exchange != "updates" or reduction != "sum":
    raise ValueError("`local_steps` > 1 and `outer_optimizer` exchange the replicas' "
                     "pseudo-updates and need exchange='updates' and reduction='sum'. "
                     f"Received: {received}, exchange={exchange!r}, reduction={reduction!r}")
  if momentum_masking and local_steps > 1:
    raise ValueError("`momentum_masking=True` masks every step's momentum and does not "
                     f"take local_steps > 1. Received: {received}, momentum_masking=True")
