"""What the bucket kernels' tests share (tests/ops/test_adacomp_bucket.py and
test_adacomp_elias_fano.py): buckets bit-identical to the per-tensor kernels, and
checked against the independent NumPy reference (numpy_reference.py)."""

import numpy as np
import tensorflow as tf

import numpy_reference as ref
from tf_adacomp.ops import adacomp
from tf_adacomp.ops import adacomp_bucket

MLP_LIKE = ([(300, 40), (40,), (40, 10), (10,), (1,)], 500)
CONV_LIKE = ([(3, 3, 8, 16), (16,), (3, 3, 16, 16), (7,)], 50)
# Bins of one element select (nearly) every element: ~5,000 codes, so the decoder's loop
# adds three chunks of DECODE_CHUNK (2,048) codes and the first tensor ends inside the
# second.
EVERY_ELEMENT = ([(3000,), (40, 50)], 1)


def random_arrays(shapes, rng, dtype=np.float32, scale=1.0):
  """Normal arrays of ``shapes`` times ``scale``, about 5% of their elements zero."""
  return [(rng.standard_normal(s) * scale * (rng.random(s) > 0.05)).astype(dtype)
          for s in shapes]


def per_tensor(grads, residues, bin_size, max_density, scale, rows=1):
  """What the per-tensor kernels give for each tensor: (new residue, decoded)."""
  out = []
  for g, r in zip(grads, residues):
    payload, new = adacomp.adacomp_compress(g, r, bin_size, max_density, scale=scale)
    decoded = adacomp.adacomp_decompress(
        tf.stack([payload] * rows), g.shape, tf.float32 if g.dtype != np.float64 else tf.float64,
        scale=scale, bin_size=bin_size if scale == "bin" else None)
    out.append((new.numpy(), decoded.numpy()))
  return out


def check_reference(payload, new, grads, residues, bin_size, max_density, scale,
                     positions="tensor"):
  """The bucket payload and new residues against the NumPy reference, tensor by tensor
  (independent of the kernel that the bucket and per-tensor paths share)."""
  sizes = [g.size for g in grads]
  got = ref.unpack_bucket(payload.numpy(), sizes, bin_size, per_bin=(scale == "bin"),
                          max_density=max_density)
  assert got.flags & ref.BUCKET_FLAG
  assert bool(got.flags & ref.BIN_SCALE_FLAG) == (scale == "bin")
  assert bool(got.flags & ref.BIN_POSITIONS_FLAG) == (positions == "bin")
  assert bool(got.flags & ref.ELIAS_FANO_FLAG) == (positions == "elias_fano")
  assert got.count == sum(max(c, 0) for c in got.counts)
  bin_start = 0
  for t, (g, r) in enumerate(zip(grads, residues)):
    if scale == "bin":
      want = ref.reference_compress_per_bin(g, r, bin_size, max_density)
      bins = ref.bins_for(g.size, bin_size)
      if want.finite:
        np.testing.assert_array_equal(got.scales[bin_start:bin_start + bins], want.scales)
      bin_start += bins
    else:
      want = ref.reference_compress(g, r, bin_size, max_density)
      if want.finite:
        # The mean of the bin maxima may differ from the exact one by an ulp.
        assert ref.ulp_diff_f32(got.scales[t], want.scale) <= 1
        want = ref.reference_compress(g, r, bin_size, max_density, scale=got.scales[t])
      else:
        assert np.isnan(got.scales[t])
    assert got.counts[t] == (want.count if want.finite else -1)
    assert got.pairs[t] == want.pairs()
    np.testing.assert_array_equal(new[t].numpy(), want.new_residue, err_msg=f"residue {t}")


def check_bit_identical(shapes, bin_size, max_density, scale, seed, dtype=np.float32,
                         nan_at=None, rows=2, positions="tensor"):
  rng = np.random.default_rng(seed)
  grads = random_arrays(shapes, rng, dtype, scale=rng.choice([1e-6, 1.0, 1e3]))
  residues = random_arrays(shapes, rng, np.float64 if dtype == np.float64 else np.float32, 0.3)
  if nan_at is not None:
    grads[nan_at].flat[0] = np.nan
  payload, new = adacomp_bucket.compress(grads, residues, bin_size, max_density, scale,
                                         positions)
  lay = adacomp_bucket.layout([g.size for g in grads], bin_size, max_density, scale,
                              positions)
  assert payload.shape == [lay.width] and payload.dtype == tf.int32
  out_dtype = tf.float64 if dtype == np.float64 else tf.float32
  # Each row only as long as its used words, the rest zeros (as the exchange pads them).
  used = int(tf.reduce_sum(adacomp_bucket.tensor_nbytes(
      payload, lay.sizes, bin_size, max_density, scale, positions))) // 4
  assert not payload.numpy()[used:].any()
  decoded = adacomp_bucket.decompress(tf.stack([payload] * rows), shapes, out_dtype,
                                      bin_size, max_density, scale, positions)
  expected = per_tensor(grads, residues, bin_size, max_density, scale, rows)
  for t, ((want_residue, want_decoded), got_residue, got_decoded) in enumerate(
      zip(expected, new, decoded)):
    np.testing.assert_array_equal(got_residue.numpy(), want_residue, err_msg=f"residue {t}")
    np.testing.assert_array_equal(got_decoded.numpy(), want_decoded, err_msg=f"decoded {t}")
  # Both paths run the same kernel (ops.adacomp_core): what they agree on is checked
  # against the reference too.
  check_reference(payload, new, grads, residues, bin_size, max_density, scale, positions)
  return grads, residues, payload
