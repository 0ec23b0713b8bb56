"""One compressor contract, where a tensor is a bucket of one.

``compress(grads, states, plans)``, ``decompress(payload, plans)``, ``width(plans)`` and
``nbytes(payload, plans)`` over one bucket, with the hooks ``_compress``, ``_decompress``,
``_width`` and ``_nbytes`` of the same arguments. A subclass written for the per-tensor
contract before it (``compress_bucket``, ``payload_width``, ``_compress(grad, state,
plan)``, ...) would have its methods silently never called, or called with lists: it is
refused when the class is made.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp.compressors import base


def _new_style_methods():
  """The hooks of a compact compressor under the contract (a bucket of one)."""

  def _compress(self, grads, states, plans):
    (grad,), (state,) = grads, states
    return tf.bitcast(tf.reshape(grad, [-1]), tf.int32), [state]

  def _decompress(self, payload, plans):
    (plan,) = plans
    rows = payload if payload.shape.rank == 2 else payload[None]
    return [tf.reshape(tf.reduce_sum(tf.bitcast(rows, tf.float32), 0), plan.shape)]

  def _width(self, plans):
    (plan,) = plans
    return plan.num_elements

  def _nbytes(self, payload, plans):
    return tf.constant([4 * int(payload.shape[-1])], tf.int64)

  return dict(_compress=_compress, _decompress=_decompress, _width=_width, _nbytes=_nbytes)


def _old(self, *args):
  del self, args
  raise AssertionError("never called")


def _old_compress(self, grad, state, plan):
  del self, grad, state, plan
  raise AssertionError("never called")


def _old_decompress(self, payload, plan):
  del self, payload, plan
  raise AssertionError("never called")


@pytest.mark.parametrize("name,method", [
    ("compress_bucket", _old), ("decompress_bucket", _old), ("bucket_width", _old),
    ("bucket_nbytes", _old), ("payload_width", _old), ("payload_nbytes", _old),
    ("_payload_nbytes", _old), ("_compress", _old_compress),
    ("_decompress", _old_decompress), ("compress", _old_compress)])
def test_a_subclass_of_the_old_contract_is_refused_when_made(name, method):
  methods = {**_new_style_methods(), name: method}
  with pytest.raises(TypeError) as raised:
    type("OldStyle", (base.Compressor,), methods)
  message = str(raised.value)
  assert f"OldStyle.{name}" in message  # names the method
  # and states the contract in one sentence
  assert "_compress(grads, states, plans)" in message
  assert "_decompress(payload, plans)" in message and "_nbytes(payload, plans)" in message
  assert "a tensor is a bucket of one" in message


def test_a_subclass_of_the_old_contract_is_refused_below_a_builtin_compressor():
  with pytest.raises(TypeError, match=r"MyTopK\.payload_width .*old Compressor contract"):
    type("MyTopK", (tf_adacomp.TopK,), {"payload_width": _old})


def test_a_subclass_of_the_contract_runs_the_exchange():
  compressor = type("Words", (base.Compressor,), _new_style_methods())()
  plans = [compressor.plan([3, 4], tf.float32, "w"), compressor.plan([5], tf.float32, "b")]
  assert [compressor.buckets(plans)] == [[(0,), (1,)]]
  grads = [tf.random.normal(p.shape) for p in plans]
  states = [compressor.init(p) for p in plans]
  exchanged = tf_adacomp.replica_exchange(compressor, plans, grads, states)
  for total, grad in zip(exchanged.sums, grads):
    np.testing.assert_array_equal(total, grad)
  assert [int(n) for n in exchanged.nbytes] == [4 + 48, 4 + 20]


@pytest.mark.parametrize("name", ["adacomp", "topk", "sign", "fft", "none", "fp16"])
def test_a_tensor_is_a_bucket_of_one(name):
  compressor = tf_adacomp.get_compressor(name)
  plan = compressor.plan([40, 30], tf.float32, "dense/kernel")
  grad = tf.random.normal(plan.shape)
  payload, new_states = compressor.compress([grad], [compressor.init(plan)], [plan])
  assert isinstance(new_states, list) and len(new_states) == 1
  (total,) = compressor.decompress(payload, [plan])
  assert total.shape == plan.shape and total.dtype == plan.dtype
  nbytes = compressor.nbytes(payload, [plan])
  assert nbytes.dtype == tf.int64 and nbytes.shape == [1] and int(nbytes[0]) > 0
  if not plan.summable:
    assert payload.shape == [compressor.width([plan])]


def test_a_bare_plan_or_unequal_lists_are_refused():
  compressor = tf_adacomp.TopK()
  plan = compressor.plan([10], tf.float32)
  grad, state = tf.ones([10]), compressor.init(plan)
  with pytest.raises(ValueError, match=r"`plans` must be a non-empty list .*bucket of one"):
    compressor.compress(grad, state, plan)
  with pytest.raises(ValueError, match=r"`states` must hold one state .* per plan"):
    compressor.compress([grad], state, [plan])  # (residue,): one entry, but no state
  with pytest.raises(ValueError, match=r"`grads` must be a list of 1 entries"):
    compressor.compress([grad, grad], [state], [plan])
  with pytest.raises(ValueError, match="`plans` must be a non-empty list"):
    compressor.width([])


def test_a_summable_plan_is_alone_in_its_bucket():
  compressor = tf_adacomp.NoCompression()
  plans = [compressor.plan([4], tf.float32, "a"), compressor.plan([4], tf.float32, "b")]
  with pytest.raises(ValueError, match="summable plan is alone in its bucket"):
    compressor.compress([tf.ones([4])] * 2, [(), ()], plans)
  with pytest.raises(ValueError, match="no compact payload width"):
    compressor.width(plans[:1])


def test_adacomp_unfused_refuses_a_bucket_of_two():
  compressor = tf_adacomp.AdaComp(fuse=False)
  plans = [compressor.plan([100], tf.float32, "a"), compressor.plan([100], tf.float32, "b")]
  with pytest.raises(ValueError, match=r"fuse=False.*Received: 2 plans"):
    compressor.width(plans)
