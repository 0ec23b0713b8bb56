"""The compressor contract: static per-tensor plans and pure tensor functions.

In the style of optax: a compressor holds only hyper-parameters. Its maths are pure
functions of tensors, so they run eagerly, in graph mode, under XLA and in
``strategy.run`` alike, and whoever owns the state (an optimizer's variables, a
cross-device op's per-device variables) decides where it lives.

One contract, over a bucket (a list of plans whose payloads travel as one); a tensor is
a bucket of one:

- ``init(plan) -> state`` per tensor;
- ``compress(grads, states, plans) -> (payload, new_states)``;
- ``decompress(payload, plans) -> [total per plan]``;
- ``width(plans)``: words of one replica's compact payload;
- ``nbytes(payload, plans)``: int64 ``[len(plans)]``, each gradient's share of the bytes.

Subclasses implement the hooks ``_compress``, ``_decompress``, ``_nbytes`` and ``_width``
with the same arguments (dense plans never reach them); ``buckets(plans)`` groups the
compact plans (default: one bucket each). How payloads of several replicas combine is
explicit, per tensor, in ``plan.summable``:

- ``True``: payloads are dense tensors that may be added by an all-reduce
  (``decompress`` then receives the sum); such a plan is alone in its bucket;
- ``False``: payloads are compact int32 buffers that must be all-gathered
  (``decompress`` receives ``[replicas, words]`` and returns the sums of the
  contributions, decoded in replica order).
"""

import abc
import collections.abc
import dataclasses
import inspect
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from tf_adacomp import _keywords
from tf_adacomp import _version
from tf_adacomp.ops import checks

State = Tuple[tf.Tensor, ...]

KINDS = ("conv", "dense", "recurrent", "vector")


# Layer-name fragments of Keras' recurrent layers (LSTM, GRU, SimpleRNN, their cells).
_RECURRENT_LAYER_WORDS = ("lstm", "gru", "rnn")
# The EinsumDense projections of Keras' MultiHeadAttention (and KerasHub's attention
# layers): their rank-3 kernels ([model, heads, head] and back) are dense matrices.
_ATTENTION_PROJECTIONS = ("query", "key", "value", "attention_output")


def infer_kind(shape: tf.TensorShape, name: str = "") -> str:
  """Guesses what kind of weight a gradient belongs to from its shape and name.

  ``recurrent`` for variables named "recurrent..." (Keras LSTM/GRU
  ``recurrent_kernel``) and for the matrices of recurrent cells ("lstm", "gru", "rnn" in
  the name of the layer or cell holding the variable: the input kernel of an LSTM cell
  belongs to the recurrent layer, as in the paper's LSTM figures); ``dense`` for rank 2
  and for the rank-3 kernels of attention projections and other ``EinsumDense`` layers
  (a layer named "query", "key", "value", "attention_output" or "einsum_dense...");
  ``conv`` for other kernels of rank 3 or more; ``vector`` otherwise (biases, normalisation
  scales and offsets). Only the last two parts of a Keras path
  ("model/layer/cell/variable") are read, so a model's own name changes nothing.
  """
  rank = tf.TensorShape(shape).rank
  parts = name.lower().split("/")
  variable, owner = parts[-1], (parts[-2] if len(parts) > 1 else "")
  if "recurrent" in variable or (rank == 2 and any(
      word in owner for word in _RECURRENT_LAYER_WORDS)):
    return "recurrent"
  if rank is not None and rank >= 3:
    if owner in _ATTENTION_PROJECTIONS or owner.startswith("einsum_dense"):
      return "dense"
    return "conv"
  if rank == 2:
    return "dense"
  return "vector"


def residue_position(state, shape) -> Optional[int]:
  """Where in a compressor state (tensors or specs) the residue is: the first floating
  entry of the gradient's ``shape``; None if there is none (stateless, or a dense plan).

  A residue is in the gradient's units and is added to the next gradient before it is
  compressed (error feedback), so it may be handed to another owner by adding it to a
  gradient (the hierarchical exchange does).
  """
  for position, entry in enumerate(state):
    if entry.dtype.is_floating and entry.shape == shape:
      return position
  return None


def dense_nbytes(payload) -> tf.Tensor:
  """int64 ``[1]``: the bytes of a payload sent whole, every element in its dtype."""
  payload = tf.convert_to_tensor(payload)
  return tf.constant([payload.shape.num_elements() * payload.dtype.size], tf.int64)


def residue_dtype(grad_dtype: tf.DType) -> tf.DType:
  """Residues accumulate many small updates: float32 at least, float64 for float64."""
  return tf.float64 if grad_dtype == tf.float64 else tf.float32


@dataclasses.dataclass(frozen=True)
class TensorPlan:
  """Static description of how one gradient tensor is compressed.

  Attributes:
    name: the variable's name ("" if unknown).
    shape: static shape of the gradient.
    dtype: dtype of the gradient.
    kind: one of ``KINDS``.
    summable: whether payloads of several replicas may be summed (see module doc).
    dense: True when this tensor is sent uncompressed (e.g. below ``min_size``).
    bin_size: AdaComp bin length L_T for this tensor (None for other compressors).
  """
  name: str
  shape: tf.TensorShape
  dtype: tf.DType
  kind: str
  summable: bool
  dense: bool = False
  bin_size: Optional[int] = None

  @property
  def num_elements(self) -> int:
    return self.shape.num_elements()

  @property
  def dense_nbytes(self) -> int:
    """Bytes of the gradient sent as float32 (the baseline of compression ratios)."""
    return 4 * self.num_elements


class Compressor(abc.ABC):
  """Base class of gradient compressors.

  Subclasses set ``name`` (their registry key) and implement the bucket hooks
  ``_compress``, ``_decompress``, ``_nbytes`` (and ``_width`` for compact payloads) and,
  when they keep state, ``init`` (see the module doc). Tensors smaller than ``min_size``
  elements go uncompressed (dense, summable) and are counted as such. A subclass that
  defines a method of the old per-tensor contract (``compress_bucket``,
  ``payload_width``, ``_compress(grad, state, plan)``, ...) is refused with a TypeError
  when it is made.

  The built-in compressors' constructors refuse an unknown keyword argument with a
  TypeError that names it, its value and the closest valid name
  (``AdaComp(dense_bin_sise=100)``: "Did you mean 'dense_bin_size'?").

  Args:
    min_size: int >= 0; gradients with fewer elements are sent dense.
  """

  name: str = ""

  @_keywords.suggest_keywords
  def __init__(self, min_size: int = 0):
    self.min_size = checks.non_negative_int(min_size, "min_size")

  # --- Static planning -----------------------------------------------------------

  def plan(self, shape, dtype, name: str = "", kind: Optional[str] = None) -> TensorPlan:
    """Decides, once per variable, how its gradient is compressed.

    Args:
      shape: static shape of the gradient.
      dtype: float dtype of the gradient.
      name: the variable's name (used to infer its kind and for overrides).
      kind: one of ``KINDS``; inferred from shape and name when None.

    Returns:
      A ``TensorPlan``.

    Raises:
      TypeError: ``dtype`` is not a float type.
      ValueError: ``shape`` is not fully defined, or ``kind`` is unknown.
    """
    shape = checks.static_shape(shape, "shape")
    dtype = checks.float_dtype(dtype, "dtype")
    if kind is None:
      kind = infer_kind(shape, name)
    elif kind not in KINDS:
      raise ValueError(f"`kind` must be one of {KINDS}. Received: kind={kind!r}")
    if shape.num_elements() < self.min_size or self._always_dense(shape):
      return TensorPlan(name, shape, dtype, kind, summable=True, dense=True)
    return self._plan(name, shape, dtype, kind)

  def _always_dense(self, shape: tf.TensorShape) -> bool:
    del shape
    return False

  def _plan(self, name, shape, dtype, kind) -> TensorPlan:
    return TensorPlan(name, shape, dtype, kind, summable=False)

  # --- Pure tensor functions -----------------------------------------------------

  def init(self, plan: TensorPlan) -> State:
    """Initial state for one tensor (e.g. a zero residue). Stateless: ``()``."""
    del plan
    return ()

  def state_specs(self, plan: TensorPlan) -> Tuple[tf.TensorSpec, ...]:
    """Shapes and dtypes of the state, so that owners can create variables for it."""
    return tuple(tf.TensorSpec(s.shape, s.dtype) for s in self.init(plan))

  def compress(self, grads, states, plans):
    """Compresses one replica's gradients of one bucket into one payload.

    Args:
      grads: the bucket's gradients, each of its plan's shape.
      states: each gradient's state from ``init`` or the previous ``compress``.
      plans: each gradient's plan, from ``plan``; a summable plan is alone in its
        bucket.

    Returns:
      ``(payload, new_states)``: the bucket's payload (a summable plan's dense tensor,
      else a 1-D int32 tensor of ``width(plans)`` words) and a list of new states, one
      per gradient.

    Raises:
      ValueError: the lists are empty or of different lengths, a state is not a tuple
        (one tensor's state given bare), or a summable plan is not alone.
    """
    plans = _bucket_plans(plans, grads=grads, states=states)
    grads = [tf.convert_to_tensor(grad) for grad in grads]
    if plans[0].dense:
      return grads[0], [states[0]]
    return self._compress(grads, list(states), plans)

  def decompress(self, payload, plans) -> List[tf.Tensor]:
    """Dense totals of a bucket's gradients from the replicas' combined payloads.

    Args:
      payload: for a summable plan the sum of the replicas' payloads; otherwise the
        gathered ``[replicas, width]`` payloads (or one replica's payload).
      plans: the bucket's plans, as given to ``compress``.

    Returns:
      One tensor per plan, of its shape and dtype: the sum over replicas of their
      (approximate) gradients, contributions added in replica order.

    Raises:
      ValueError: ``plans`` is empty, or a summable plan is not alone.
    """
    plans = _bucket_plans(plans)
    if plans[0].dense:
      return [tf.cast(payload, plans[0].dtype)]
    return self._decompress(payload, plans)

  def width(self, plans) -> int:
    """Static length, in int32 words, of one replica's compact payload for a bucket.

    Args:
      plans: the bucket's plans (compact ones).

    Returns:
      The words of ``compress``'s payload; only the first ``sum(nbytes) // 4`` are used.

    Raises:
      ValueError: ``plans`` is empty or summable (a summable payload is a dense tensor,
        not words).
    """
    plans = _bucket_plans(plans)
    if plans[0].summable:
      raise ValueError(f"A summable plan has no compact payload width. Received: "
                       f"plans={[plan.name for plan in plans]}")
    return self._width(plans)

  def nbytes(self, payload, plans) -> tf.Tensor:
    """Each gradient's share of the bytes one replica's payload occupies on the wire.

    Args:
      payload: one replica's payload of the bucket, from ``compress``.
      plans: the bucket's plans.

    Returns:
      int64 ``[len(plans)]``; the shares add up to the payload's used bytes.

    Raises:
      ValueError: ``plans`` is empty, or a summable plan is not alone.
    """
    plans = _bucket_plans(plans)
    if plans[0].dense:
      return dense_nbytes(payload)
    return self._nbytes(payload, plans)

  def buckets(self, plans: Sequence[TensorPlan]) -> List[Tuple[int, ...]]:
    """The compact plans grouped into buckets, as indices into ``plans``.

    By default each compact plan is a bucket of its own; a compressor that can fuse
    tensors (AdaComp) groups them, and one payload carries the whole group.

    Args:
      plans: the plans of one exchange, in order.

    Returns:
      A list of index tuples: every index of a non-summable plan exactly once.
    """
    return [(i,) for i, plan in enumerate(plans) if not plan.summable]

  # --- Hooks of subclasses: the same contract, dense plans already handled ----------

  @abc.abstractmethod
  def _compress(self, grads, states, plans):
    """``(payload, [new state per gradient])`` of a bucket (see ``compress``)."""

  @abc.abstractmethod
  def _decompress(self, payload, plans):
    """One dense total per plan (see ``decompress``)."""

  @abc.abstractmethod
  def _nbytes(self, payload, plans):
    """int64 ``[len(plans)]`` shares of the used bytes (see ``nbytes``)."""

  def _width(self, plans) -> int:
    """Words of one replica's compact payload (see ``width``)."""
    raise NotImplementedError(f"{type(self).__name__} has no compact payload.")

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    _refuse_old_contract(cls)

  # --- Serialization -------------------------------------------------------------

  def get_config(self) -> Dict[str, Any]:
    """Constructor arguments, JSON-serializable."""
    return {"min_size": self.min_size}

  @classmethod
  def from_config(cls, config: Dict[str, Any]) -> "Compressor":
    """The compressor of ``get_config``'s dict (as Keras' deserialization calls it).

    Raises:
      ValueError: ``config`` not a dict, or with arguments this release's constructor
        does not take (a newer tf_adacomp's), naming the config and the installed
        version.
    """
    if not isinstance(config, dict):
      raise ValueError(f"A {cls.__name__} config must be a dict of constructor arguments. "
                       f"Received: config={config!r}")
    check_config_keys(cls, config, f"Received: config={config!r}")
    return cls(**config)

  def __repr__(self):
    args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
    return f"{type(self).__name__}({args})"

  def __eq__(self, other):
    return type(self) is type(other) and self.get_config() == other.get_config()

  def __hash__(self):
    return hash((type(self), repr(self)))


# The methods of the contract before "a tensor is a bucket of one", and what replaced them.
_OLD_METHODS = {
    "compress_bucket": "compress(grads, states, plans)",
    "decompress_bucket": "decompress(payload, plans)",
    "bucket_width": "width(plans) (hook: _width(plans))",
    "bucket_nbytes": "nbytes(payload, plans) (hook: _nbytes(payload, plans))",
    "payload_width": "_width(plans)",
    "payload_nbytes": "nbytes(payload, plans) (hook: _nbytes(payload, plans))",
    "_payload_nbytes": "_nbytes(payload, plans)",
}
# Per-tensor parameter names: a method that takes one of them was written for one tensor.
_PER_TENSOR_PARAMETERS = ("grad", "state", "plan")
_BUCKET_METHODS = {"compress": "compress(grads, states, plans)",
                   "decompress": "decompress(payload, plans)",
                   "_compress": "_compress(grads, states, plans)",
                   "_decompress": "_decompress(payload, plans)"}
_CONTRACT = ("a Compressor now implements _compress(grads, states, plans), "
             "_decompress(payload, plans), _nbytes(payload, plans) and, for compact "
             "payloads, _width(plans), each over one bucket of plans (a tensor is a bucket "
             "of one, unpacked as `(grad,), (state,), (plan,) = grads, states, plans`)")


def _refuse_old_contract(cls) -> None:
  """Refuses, when the class is made, a subclass written against the per-tensor API:
  its methods would never be called (or be called with lists), silently."""
  for name, replacement in _OLD_METHODS.items():
    if name in vars(cls):
      raise TypeError(f"{cls.__qualname__}.{name} belongs to the old Compressor contract; "
                      f"define {replacement} instead: {_CONTRACT}.")
  for name, replacement in _BUCKET_METHODS.items():
    method = vars(cls).get(name)
    if not callable(method):
      continue
    try:
      parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):  # no signature to read: nothing to judge
      continue
    old = [p for p in parameters if p in _PER_TENSOR_PARAMETERS]
    if old:
      raise TypeError(f"{cls.__qualname__}.{name}{inspect.signature(method)} takes one "
                      f"tensor's {', '.join(repr(p) for p in old)} (the old Compressor "
                      f"contract); define {replacement} instead: {_CONTRACT}.")


def _bucket_plans(plans, **lists) -> List[TensorPlan]:
  """``plans`` as a list, checked: one bucket (non-empty; a summable plan alone), and
  ``lists`` (grads, states) of the same length."""
  if isinstance(plans, TensorPlan) or not isinstance(plans, (list, tuple)) or not plans:
    raise ValueError(f"`plans` must be a non-empty list of TensorPlans, one bucket (a "
                     f"single tensor is a bucket of one: [plan]). Received: plans={plans!r}")
  for name, values in lists.items():
    is_list = isinstance(values, (list, tuple))
    if not is_list or len(values) != len(plans):
      raise ValueError(f"`{name}` must be a list of {len(plans)} entries, one per plan "
                       f"(a single tensor is a bucket of one: [{name[:-1]}]). Received: "
                       f"{name} of type {type(values).__name__}"
                       f"{f' and length {len(values)}' if is_list else ''}")
  # A state is itself a tuple: one gradient's state given bare would pass the length check.
  states = lists.get("states", ())
  if any(not isinstance(state, collections.abc.Sequence) for state in states):
    raise ValueError(f"`states` must hold one state (a tuple of tensors) per plan (a single "
                     f"tensor's: [state]). Received: states={states!r}")
  if len(plans) > 1 and any(plan.summable for plan in plans):
    raise ValueError(f"A summable plan is alone in its bucket. Received: plans="
                     f"{[(plan.name, plan.summable) for plan in plans]}")
  return list(plans)


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
    close = [(name, _keywords.closest(name, known)) for name in unknown]
    hint = ", ".join(f"{match!r} for {name!r}" for name, match in close if match)
    raise ValueError(
        f"The {cls.__name__} config has argument(s) {unknown} that the installed "
        f"tf_adacomp {_version.__version__} does not know (it takes "
        f"{', '.join(sorted(known))}): the config may come from a newer tf_adacomp"
        f"{f' or misspell an argument (did you mean {hint}?)' if hint else ''}. "
        f"{received}")


def match_override(overrides: Optional[Dict[str, Any]], name: str):
  """The value of the first ``overrides`` pattern (a regex) found in ``name``, or None."""
  for pattern, value in (overrides or {}).items():
    if re.search(pattern, name):
      return value
  return None
