"""The kernels' two forms (tf_adacomp.ops.variant): the GPU form has none of the CPU
form's control flow, and gives bit-identical payloads, residues and decoded sums; the
form follows the device a kernel is traced on."""

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp.ops import adacomp_core
from tf_adacomp.ops import compiled
from tf_adacomp.ops import variant


def _run(form, compressor, grads, residues, rows):
  """One compress and one decode of ``rows`` gathered payloads, in ``form``."""
  plans = [compressor.plan(g.shape, tf.as_dtype(g.dtype), kind="dense") for g in grads]
  outputs = []
  for bucket in compressor.buckets(plans):
    bucket_plans = [plans[i] for i in bucket]
    with variant.forced(form):
      payload, states = compressor.compress(
          [tf.constant(grads[i]) for i in bucket], [(tf.constant(residues[i]),) for i in bucket],
          bucket_plans)
      # Rows that differ (the payload, then one of a second step), as an exchange sees.
      second, _ = compressor.compress(
          [tf.constant(grads[i] * -0.5) for i in bucket], [s for s in states], bucket_plans)
      gathered = tf.stack(([payload, second] * rows)[:rows])
      decoded = compressor.decompress(gathered, bucket_plans)
    outputs.append((payload.numpy(), [s[0].numpy() for s in states],
                    [d.numpy() for d in decoded]))
  return outputs


def _assert_bit_identical(a, b):
  for (payload_a, states_a, sums_a), (payload_b, states_b, sums_b) in zip(a, b, strict=True):
    np.testing.assert_array_equal(payload_a, payload_b)
    for x, y in zip(states_a + sums_a, states_b + sums_b, strict=True):
      assert x.dtype == y.dtype
      np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def _inputs(sizes, density, dtype, seed):
  rng = np.random.default_rng(seed)
  grads = [(rng.standard_normal(n) * (rng.random(n) < density)).astype(dtype) for n in sizes]
  residues = [rng.standard_normal(n).astype(np.float32) for n in sizes]
  return grads, residues


# The fast tier: the bucket of two and the smallest tier in bfloat16. The per-tensor format
# with --full: both formats run the one kernel (ops.adacomp_core) whose two forms the
# bucket cases compare, and the bucket of two selects 30% of 70,407 elements: past the
# encoder's smaller tiers (1/128, 1/16) too, as the per-tensor case does.
@pytest.mark.parametrize("fuse,sizes,density,dtype,rows", [
    (True, (70000, 407), 0.3, np.float32, 3),   # a bucket of two, several chunks to decode
    pytest.param(False, (300000,), 1.0, np.float32, 2,  # per-tensor, past the encoder's tiers
                 marks=pytest.mark.slow),
    (True, (5000,), 0.01, tf.bfloat16.as_numpy_dtype, 1),  # the smallest tier, bfloat16
])
def test_the_gpu_form_is_bit_identical_to_the_cpu_form(fuse, sizes, density, dtype, rows):
  compressor = tf_adacomp.AdaComp(fuse=fuse)
  grads, residues = _inputs(sizes, density, dtype, seed=0)
  cpu = _run("cpu", compressor, grads, residues, rows)
  gpu = _run("gpu", compressor, grads, residues, rows)
  assert cpu[0][0][0] > 0  # something was sent
  _assert_bit_identical(cpu, gpu)


@pytest.mark.slow  # many compilations (tests/conftest.py)
@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(
    sizes=st.lists(st.integers(1, 40000), min_size=1, max_size=3),
    density=st.sampled_from([0.0, 0.002, 0.05, 0.5, 1.0]),
    bin_size=st.sampled_from([1, 7, 50, 500]),
    scale=st.sampled_from(["tensor", "bin"]),
    rows=st.integers(1, 4),
    seed=st.integers(0, 2**16))
def test_the_forms_agree_on_any_bucket(sizes, density, bin_size, scale, rows, seed):
  compressor = tf_adacomp.AdaComp(dense_bin_size=bin_size, scale=scale)
  grads, residues = _inputs(sizes, density, np.float32, seed)
  _assert_bit_identical(_run("cpu", compressor, grads, residues, rows),
                        _run("gpu", compressor, grads, residues, rows))


def _hlo(form, fn, *args):
  with variant.forced(form):
    return tf.function(fn, jit_compile=True).experimental_get_compiler_ir(*args)(stage="hlo")


def test_only_the_cpu_form_has_control_flow():
  """Without this, the identity test above could compare the CPU form with itself."""
  compressor = tf_adacomp.AdaComp()
  plans = [compressor.plan([70000], tf.float32, kind="dense")]
  grad = tf.constant(np.random.default_rng(0).standard_normal(70000).astype(np.float32))
  payload, _ = compressor.compress([grad], [(tf.zeros([70000]),)], plans)
  for form, expected in (("cpu", True), ("gpu", False)):
    encode = _hlo(form, lambda g: compressor.compress([g], [(tf.zeros_like(g),)], plans), grad)
    decode = _hlo(form, lambda p: compressor.decompress(p[None], plans), payload)
    assert (" conditional(" in encode) is expected, form
    assert (" while(" in decode) is expected, form


def test_the_gpu_form_encodes_large_capacities_in_tiers(monkeypatch):
  """Past GPU_FULL_ENCODE_MAX_SLOTS the GPU form's encode takes the tiers' conditionals
  (cheaper there than encoding every slot); its decode still has no loop, and both
  forms still give the same bits."""
  monkeypatch.setattr(adacomp_core, "GPU_FULL_ENCODE_MAX_SLOTS", 1000)
  # A size no other test compiles: compiled kernels are cached with the traced constant.
  n = 69999
  compressor = tf_adacomp.AdaComp()
  plans = [compressor.plan([n], tf.float32, kind="dense")]  # 17,500 slots
  grad = tf.constant(np.random.default_rng(0).standard_normal(n).astype(np.float32))
  payload, _ = compressor.compress([grad], [(tf.zeros([n]),)], plans)
  encode = _hlo("gpu", lambda g: compressor.compress([g], [(tf.zeros_like(g),)], plans), grad)
  decode = _hlo("gpu", lambda p: compressor.decompress(p[None], plans), payload)
  assert " conditional(" in encode and " while(" not in decode
  grads, residues = _inputs((n,), 0.3, np.float32, seed=1)
  _assert_bit_identical(_run("cpu", compressor, grads, residues, 2),
                        _run("gpu", compressor, grads, residues, 2))


def test_the_form_follows_the_device_a_kernel_is_traced_on():
  seen = {}

  def probe(device):
    @tf.function
    def trace():
      with tf.device(device):
        seen[device] = variant.gpu_form(tf.zeros([1]))
      return tf.constant(0)
    trace.get_concrete_function()

  for device in ("/device:GPU:0", "/device:CPU:0"):
    probe(device)
  assert seen == {"/device:GPU:0": True, "/device:CPU:0": False}
  # No device named: TensorFlow places it on a GPU if it has one (none here).
  assert variant.gpu_form(tf.zeros([1])) is bool(tf.config.list_logical_devices("GPU"))
  with variant.forced("gpu"):
    assert variant.gpu_form(tf.zeros([1])) and variant.forced_form() == "gpu"
    with variant.forced("cpu"):
      assert not variant.gpu_form(tf.zeros([1]))
  assert variant.forced_form() is None


def test_a_forced_form_gets_compiled_kernels_of_its_own():
  def fn(x, scale):
    return x * scale
  with variant.forced("gpu"):
    gpu = compiled.kernel(fn, scale=2)
  assert compiled.kernel(fn, scale=2) is not gpu
  with variant.forced("gpu"):
    assert compiled.kernel(fn, scale=2) is gpu


def test_an_unknown_form_is_named():
  with pytest.raises(ValueError, match="form='tpu'"):
    with variant.forced("tpu"):
      pass
  assert variant.forced_form() is None
