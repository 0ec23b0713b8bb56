"""Top-k sparsification with error feedback, compiled with XLA.

G = R + grad; the k elements of largest |G| are sent exactly (position and float32
value), R <- G with those elements zeroed. Wire format (int32 words):
``[count, index_bits, packed positions..., float32 values...]``, positions bit-packed
with ``index_bits`` bits each (see ``bitpack``). k is static, so every replica sends the
same number of bytes and no padding is needed.
"""

import math

import tensorflow as tf

from tf_adacomp.ops import bitpack
from tf_adacomp.ops import checks
from tf_adacomp.ops import compiled
from tf_adacomp.ops.adacomp import index_bits

HEADER_WORDS = 2


def topk_count(num_elements: int, density: float) -> int:
  """k for a tensor: ``ceil(density * n)``, at least 1 (0 for an empty tensor)."""
  return 0 if num_elements == 0 else max(1, min(num_elements, math.ceil(density * num_elements)))


def topk_payload_words(num_elements: int, density: float) -> int:
  k = topk_count(num_elements, density)
  return HEADER_WORDS + bitpack.packed_words(k, index_bits(num_elements)) + k


def _compress(grad, residue, k: int):
  n = grad.shape.num_elements()
  bits = index_bits(n)
  cd = tf.float64 if tf.float64 in (grad.dtype, residue.dtype) else tf.float32
  r = tf.cast(tf.reshape(residue, [-1]), cd)
  g = r + tf.cast(tf.reshape(grad, [-1]), cd)
  finite = tf.reduce_all(tf.math.is_finite(g))
  _, positions = tf.math.top_k(tf.abs(g), k=k, sorted=False)
  values = tf.gather(g, positions)
  new_residue = tf.tensor_scatter_nd_update(g, positions[:, None], tf.zeros([k], cd))
  new_residue = tf.where(finite, new_residue, r)
  nan = tf.constant(float("nan"), tf.float32)
  values = tf.where(finite, tf.cast(values, tf.float32), nan)
  packed = tf.bitcast(bitpack.pack(tf.cast(positions, tf.uint32), bits), tf.int32) if bits else (
      tf.zeros([0], tf.int32))
  payload = tf.concat([tf.constant([k, bits], tf.int32), tf.reshape(packed, [-1]),
                       tf.bitcast(values, tf.int32)], 0)
  return payload, tf.reshape(tf.cast(new_residue, residue.dtype), residue.shape)


def _decompress(payload, shape, dtype, k: int):
  n = shape.num_elements()
  bits = index_bits(n)
  rows = payload if payload.shape.rank == 2 else payload[None]
  idx_words = bitpack.packed_words(k, bits)
  cd = tf.float64 if dtype == tf.float64 else tf.float32
  total = tf.zeros([n], cd)
  for row in range(int(rows.shape[0])):  # fixed replica order: bit-identical sums
    words = tf.bitcast(rows[row, HEADER_WORDS:HEADER_WORDS + idx_words], tf.uint32)
    positions = tf.cast(bitpack.unpack(words, k, bits), tf.int32) if bits else tf.zeros(
        [k], tf.int32)
    values = tf.cast(tf.bitcast(rows[row, HEADER_WORDS + idx_words:], tf.float32), cd)
    ok = (rows[row, 0] == k) & (rows[row, 1] == bits)
    dense = tf.scatter_nd(positions[:, None], values, [n])
    total += tf.where(ok, dense, tf.constant(float("nan"), cd))
  return tf.reshape(tf.cast(total, dtype), shape)


def topk_compress(grad, residue, density: float):
  """Sends the ``ceil(density * n)`` largest-magnitude elements of ``grad + residue``.

  Args:
    grad: float tensor with a static shape.
    residue: float tensor of the same shape.
    density: fraction in (0, 1] of the elements to send.

  Returns:
    ``(payload, new_residue)``; if ``grad + residue`` is not finite, the residue is
    returned unchanged and the payload's values are NaN.

  Raises:
    TypeError: non-float ``grad`` or ``residue``.
    ValueError: shapes differ or are not static; ``density`` outside (0, 1].
  """
  grad = checks.float_tensor(grad, "grad")
  residue = checks.float_tensor(residue, "residue")
  checks.same_shape(grad, residue, "grad", "residue")
  density = checks.fraction(density, "density")
  k = topk_count(grad.shape.num_elements(), density)
  if k == 0:
    return tf.constant([0, 0], tf.int32), residue
  return compiled.kernel(_compress, k=k)(grad, residue)


def topk_decompress(payload, shape, density: float, dtype=tf.float32):
  """Dense sum of one ``[words]`` or gathered ``[replicas, words]`` top-k payload.

  Raises:
    TypeError: non-int32 payload or non-float dtype.
    ValueError: payload length does not match ``shape`` and ``density``.
  """
  payload = checks.payload_tensor(payload)
  shape = checks.static_shape(shape, "shape")
  dtype = checks.float_dtype(dtype, "dtype")
  density = checks.fraction(density, "density")
  n = shape.num_elements()
  expected = topk_payload_words(n, density) if n else HEADER_WORDS
  if payload.shape[-1] != expected:
    raise ValueError(f"`payload` for shape {shape} and density {density} must have "
                     f"{expected} words. Received: payload with shape {payload.shape}")
  if n == 0:
    return tf.zeros(shape, dtype)
  return compiled.kernel(_decompress, shape=shape, dtype=dtype,
                 k=topk_count(n, density))(payload)
