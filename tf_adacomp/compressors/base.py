"""The compressor contract: static per-tensor plans and pure tensor functions.

In the style of optax: a compressor holds only hyper-parameters. Its maths are pure
functions of tensors, ``init(plan) -> state`` and
``compress(grad, state, plan) -> (payload, new_state)``, so they run eagerly, in graph
mode, under XLA and in ``strategy.run`` alike, and whoever owns the state (an optimizer's
variables, a cross-device op's per-device variables) decides where it lives.

How payloads of several replicas combine is explicit, per tensor, in ``plan.summable``:

- ``True``: payloads are dense tensors that may be added by an all-reduce
  (``decompress`` then receives the sum);
- ``False``: payloads are compact int32 buffers that must be all-gathered
  (``decompress`` receives ``[replicas, words]`` and returns the sum of the
  contributions, decoded in replica order).
"""

import abc
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

  Subclasses set ``name`` (their registry key) and implement ``compress``,
  ``decompress`` and, when they keep state, ``init``. Tensors smaller than ``min_size``
  elements go uncompressed (dense, summable) and are counted as such.

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

  def compress(self, grad, state: State, plan: TensorPlan):
    """Compresses one replica's gradient.

    Args:
      grad: the gradient, of ``plan.shape``.
      state: this tensor's state from ``init`` or the previous ``compress``.
      plan: from ``plan``.

    Returns:
      ``(payload, new_state)``.
    """
    if plan.dense:
      return tf.convert_to_tensor(grad), state
    return self._compress(tf.convert_to_tensor(grad), state, plan)

  def decompress(self, payload, plan: TensorPlan) -> tf.Tensor:
    """Dense gradient of ``plan.shape`` and ``plan.dtype`` from a combined payload.

    Args:
      payload: for summable plans the sum of the replicas' payloads; otherwise the
        gathered ``[replicas, ...]`` payloads (or one replica's payload).
      plan: from ``plan``.

    Returns:
      The sum over replicas of their (approximate) gradients.
    """
    if plan.dense:
      return tf.cast(payload, plan.dtype)
    return self._decompress(payload, plan)

  def payload_nbytes(self, payload, plan: TensorPlan) -> tf.Tensor:
    """Bytes one replica's payload occupies on the wire (int64 scalar tensor)."""
    if plan.dense:
      payload = tf.convert_to_tensor(payload)
      return tf.constant(payload.shape.num_elements() * payload.dtype.size, tf.int64)
    return self._payload_nbytes(payload, plan)

  def payload_width(self, plan: TensorPlan) -> int:
    """Static length of one replica's (flat) payload for a non-summable plan."""
    raise NotImplementedError(f"{type(self).__name__} has no compact payload.")

  # --- Buckets: several compact payloads sent as one -------------------------------
  #
  # The exchange sends every compact plan inside a bucket. By default each is a bucket of
  # its own; a compressor that can fuse tensors (AdaComp) groups them, and one payload
  # carries the whole group.

  def buckets(self, plans: Sequence[TensorPlan]) -> List[Tuple[int, ...]]:
    """The compact plans grouped into buckets, as indices into ``plans``.

    Args:
      plans: the plans of one exchange, in order.

    Returns:
      A list of index tuples: every index of a non-summable plan exactly once.
    """
    return [(i,) for i, plan in enumerate(plans) if not plan.summable]

  def compress_bucket(self, grads, states, plans):
    """Compresses one bucket: ``(payload, [new state per gradient])``."""
    payload, state = self.compress(grads[0], states[0], plans[0])
    return payload, [state]

  def decompress_bucket(self, rows, plans) -> List[tf.Tensor]:
    """One dense total per gradient of a bucket from its ``[replicas, width]`` rows."""
    return [self.decompress(rows, plans[0])]

  def bucket_width(self, plans) -> int:
    """Static length of one replica's payload for a bucket."""
    return self.payload_width(plans[0])

  def bucket_nbytes(self, payload, plans) -> tf.Tensor:
    """int64 ``[len(plans)]``: each gradient's share of the bytes one replica's bucket
    payload occupies on the wire (they add up to its used bytes)."""
    return tf.reshape(self.payload_nbytes(payload, plans[0]), [1])

  @abc.abstractmethod
  def _compress(self, grad, state, plan):
    ...

  @abc.abstractmethod
  def _decompress(self, payload, plan):
    ...

  @abc.abstractmethod
  def _payload_nbytes(self, payload, plan):
    ...

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
