"""AdaComp: adaptive residual gradient compression (Chen et al., AAAI 2018)."""

import re

import keras
import tensorflow as tf

from tf_adacomp import _keywords
from tf_adacomp.compressors import base
from tf_adacomp.compressors import registry
from tf_adacomp.ops import adacomp as adacomp_ops
from tf_adacomp.ops import adacomp_bucket
from tf_adacomp.ops import checks

# Buckets send positions as Elias-Fano codes: the same values as "bin" (the default
# before) in no more bytes. A config saved without `positions` (when "bin" was the
# default) loads with this one: the values sent are the same, only their bytes differ.
DEFAULT_POSITIONS = "elias_fano"


@registry.register("adacomp")
@keras.saving.register_keras_serializable(package="tf_adacomp")
class AdaComp(base.Compressor):
  """AdaComp with one residue per tensor, bins of L_T chosen per variable kind.

  Args:
    conv_bin_size: L_T for convolution kernels (rank >= 3). Default 50, as in the paper.
    dense_bin_size: L_T for dense kernels and vectors. Default 500.
    recurrent_bin_size: L_T for recurrent kernels. Default 500.
    bin_sizes: optional ``{regex: L_T}``; the first pattern found in a variable's name
      overrides its kind's bin size.
    max_density: fraction in (0, 1] of a tensor's elements that one payload can carry
      (the payload's static capacity). Selected elements beyond it stay in the residue
      and go in a later step. Lower is faster to encode; 1.0 never holds any back.
    min_size: tensors with fewer elements are sent dense (uncompressed).
    scale: "tensor" (default, the published reference implementation's): one scale per
      tensor, the mean of its bin maxima; "bin": each bin's own maximum |G| as its
      scale, sent as bfloat16 (2 bytes per bin and 4 bytes of header more per tensor,
      counted in ``nbytes``; docs/wire_format.md). Finer scales leave less
      rounding error in the residue where parts of a tensor differ in magnitude (LSTM
      gates, embedding rows); docs/convergence.md measures what that buys.
    fuse: bool, default True. Compress all the tensors of one exchange that share a bin
      size and a dtype in one XLA call, sent as one payload (a bucket, as Horovod's
      tensor fusion does for all-reduces): one compiled program per bucket instead of
      one per shape, and no fixed cost per tensor. Bit-identical, tensor by tensor, to
      compressing each on its own (``ops.adacomp_bucket``); the payload's header holds
      each tensor's scale and count (docs/wire_format.md#buckets). False sends one
      payload per tensor.
    positions: how a code's position is sent; the same values either way, in different
      bytes. "elias_fano" (the default with ``fuse=True``): the sent positions of a
      bucket as one increasing sequence, each split into low bits sent in its code and
      a high part sent in unary, the split chosen per payload to take the fewest words
      (docs/wire_format.md#positions-elias-fano): never more bytes than "bin", and fewer
      the more codes a bin sends. "bin": its offset in its bin (``index_bits(L_T)``
      bits: 6 for L_T = 50, 9 for 500), each bin's count of codes in unary (a bit per
      code and one per bin), the default before. "tensor": its index in its tensor
      (``index_bits(n)`` bits, 20 for a million elements), and the only one of
      ``fuse=False``. None: "elias_fano", or "tensor" with ``fuse=False``.

  Raises:
    ValueError: a bin size < 1, a ``bin_sizes`` pattern that is not a string or not a
      valid regular expression, ``max_density`` outside (0, 1], ``min_size`` < 0,
      ``scale`` not "tensor" or "bin", ``fuse`` not a bool, ``positions`` not
      "elias_fano", "bin" or "tensor", or a bucket format ("elias_fano", "bin") with
      ``fuse=False``.
  """

  @_keywords.suggest_keywords
  def __init__(self, conv_bin_size: int = 50, dense_bin_size: int = 500,
               recurrent_bin_size: int = 500, bin_sizes=None, max_density: float = 0.25,
               min_size: int = 0, scale: str = "tensor", fuse: bool = True,
               positions=None):
    super().__init__(min_size=min_size)
    self.conv_bin_size = checks.positive_int(conv_bin_size, "conv_bin_size")
    self.dense_bin_size = checks.positive_int(dense_bin_size, "dense_bin_size")
    self.recurrent_bin_size = checks.positive_int(recurrent_bin_size, "recurrent_bin_size")
    if bin_sizes is not None and not isinstance(bin_sizes, dict):
      raise ValueError(f"`bin_sizes` must be a dict of regex -> bin size. "
                       f"Received: bin_sizes={bin_sizes!r}")
    self.bin_sizes = {}
    for pattern, size in (bin_sizes or {}).items():
      # Here, not at the first plan(): that error would name neither the argument nor
      # the entry, and come only once training starts.
      if not isinstance(pattern, str):
        raise ValueError(f"`bin_sizes` patterns must be strings (regular expressions). "
                         f"Received: bin_sizes={bin_sizes!r}")
      try:
        re.compile(pattern)
      except re.error as error:
        raise ValueError(f"`bin_sizes` pattern {pattern!r} is not a valid regular "
                         f"expression ({error}). Received: bin_sizes={bin_sizes!r}") from None
      # An int, not e.g. a NumPy integer: the config must stay JSON-serializable.
      self.bin_sizes[pattern] = checks.positive_int(size, f"bin_sizes[{pattern!r}]")
    self.max_density = checks.fraction(max_density, "max_density")
    self.scale = adacomp_ops.check_scale(scale, bin_size=1)
    self.fuse = checks.boolean(fuse, "fuse")
    default_positions = DEFAULT_POSITIONS if self.fuse else "tensor"
    self.positions = adacomp_ops.check_positions(
        default_positions if positions is None else positions)
    if self.positions != "tensor" and not self.fuse:
      raise ValueError(f"positions={self.positions!r} is a bucket format (fuse=True); "
                       "AdaComp(fuse=False) sends positions in their tensors: pass "
                       f"positions='tensor'. Received: positions={positions!r}, fuse={fuse!r}")

  def bin_size_for(self, name: str, kind: str) -> int:
    """L_T for a variable: a ``bin_sizes`` override, else its kind's default."""
    override = base.match_override(self.bin_sizes, name)
    if override is not None:
      return override
    return {"conv": self.conv_bin_size, "recurrent": self.recurrent_bin_size}.get(
        kind, self.dense_bin_size)

  def _plan(self, name, shape, dtype, kind):
    return base.TensorPlan(name, shape, dtype, kind, summable=False,
                           bin_size=self.bin_size_for(name, kind))

  def init(self, plan):
    if plan.dense:
      return ()
    return (tf.zeros(plan.shape, base.residue_dtype(plan.dtype)),)

  def buckets(self, plans):
    if not self.fuse:
      return super().buckets(plans)
    groups = {}  # (bin size, dtype) -> indices, in the order the plans come
    for i, plan in enumerate(plans):
      if not plan.summable:
        groups.setdefault((plan.bin_size, plan.dtype), []).append(i)
    return [tuple(indices) for indices in groups.values()]

  # fuse=True: every bucket (one tensor's too) is ``ops.adacomp_bucket``'s payload;
  # fuse=False: buckets of one, each ``ops.adacomp``'s per-tensor payload.

  def _compress(self, grads, states, plans):
    if self.fuse:
      payload, residues = adacomp_bucket.compress(
          grads, [state[0] for state in states], **self._bucket_args(plans))
      return payload, [(residue,) for residue in residues]
    (grad,), ((residue,),), (plan,) = grads, states, _one(plans)
    payload, residue = adacomp_ops.adacomp_compress(grad, residue, plan.bin_size,
                                                    self.max_density, scale=self.scale)
    return payload, [(residue,)]

  def _decompress(self, payload, plans):
    if self.fuse:
      return adacomp_bucket.decompress(payload, [plan.shape for plan in plans],
                                       plans[0].dtype, **self._bucket_args(plans))
    (plan,) = _one(plans)
    return [adacomp_ops.adacomp_decompress(payload, plan.shape, plan.dtype, scale=self.scale,
                                           bin_size=plan.bin_size)]

  def _width(self, plans):
    if self.fuse:
      return adacomp_bucket.layout([plan.num_elements for plan in plans],
                                   **self._bucket_args(plans)).width
    (plan,) = _one(plans)
    return adacomp_ops.payload_words(plan.num_elements, self.max_density, scale=self.scale,
                                     bin_size=plan.bin_size)

  def _nbytes(self, payload, plans):
    if self.fuse:
      return adacomp_bucket.tensor_nbytes(payload, [plan.num_elements for plan in plans],
                                          **self._bucket_args(plans))
    _one(plans)
    return tf.reshape(adacomp_ops.payload_nbytes(payload), [1])

  def _bucket_args(self, plans):
    if len({plan.bin_size for plan in plans}) != 1:
      raise ValueError(f"A bucket's tensors must share one bin size. Received: "
                       f"{[(plan.name, plan.bin_size) for plan in plans]}")
    return dict(bin_size=plans[0].bin_size, max_density=self.max_density, scale=self.scale,
                positions=self.positions)

  def get_config(self):
    return {**super().get_config(), "conv_bin_size": self.conv_bin_size,
            "dense_bin_size": self.dense_bin_size,
            "recurrent_bin_size": self.recurrent_bin_size, "bin_sizes": self.bin_sizes,
            "max_density": self.max_density, **self._optional_config()}

  def _optional_config(self):
    # Only when not the default: configs saved before the options existed stay equal.
    config = {} if self.scale == "tensor" else {"scale": self.scale}
    if not self.fuse:
      config["fuse"] = False
    if self.positions != (DEFAULT_POSITIONS if self.fuse else "tensor"):
      config["positions"] = self.positions
    return config


def _one(plans):
  """``plans``, refused unless one: ``fuse=False`` sends one payload per tensor."""
  if len(plans) != 1:
    raise ValueError(f"AdaComp(fuse=False) compresses buckets of one tensor (its "
                     f"``buckets``). Received: {len(plans)} plans "
                     f"{[plan.name for plan in plans]}")
  return plans
