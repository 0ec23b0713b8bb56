"""A compiled kernel (tf_adacomp/ops/compiled.py) is traced once per input signature in a
graph, and that trace runs on every replica's device."""

import numpy as np
import tensorflow as tf

from tf_adacomp.ops import compiled

REPLICAS = 3
DEVICES = [f"/cpu:{i}" for i in range(REPLICAS)]  # tests/conftest.py made them


def _counting_kernel(tag):
  """A kernel that counts how often its Python body is traced (``tag``: a static
  argument no other test uses, so that the kernel is new)."""
  traces = []

  def scaled(x, tag):
    traces.append(tag)
    return x * 2.0 + 1.0

  return (lambda x: compiled.kernel(scaled, tag=tag)(x)), traces


def _call_ops(graph):
  return [op for op in graph.get_operations()
          if op.type in ("PartitionedCall", "StatefulPartitionedCall")]


def test_a_kernel_is_traced_once_for_every_replica_and_runs_on_each_ones_device():
  kernel, traces = _counting_kernel("once-for-every-replica")
  strategy = tf.distribute.MirroredStrategy(DEVICES)

  @tf.function
  def step():
    def replica_fn():
      r = tf.distribute.get_replica_context().replica_id_in_sync_group
      return kernel(tf.fill([4], tf.cast(r, tf.float32)))
    return strategy.run(replica_fn)

  out = strategy.experimental_local_results(step())
  assert traces == ["once-for-every-replica"]
  for r, value in enumerate(out):
    np.testing.assert_array_equal(value.numpy(), np.full(4, 2.0 * r + 1.0))
  # Each replica's call of the one trace is placed on its own device.
  placed = sorted(op.device for op in _call_ops(step.get_concrete_function().graph))
  assert placed == [f"/job:localhost/replica:0/task:0/device:CPU:{r}"
                    for r in range(REPLICAS)], placed
  step()  # the function traced, the kernel's trace kept: no new trace
  assert len(traces) == 1


def test_a_new_input_signature_gets_a_trace_of_its_own():
  kernel, traces = _counting_kernel("per-signature")

  @tf.function
  def both():
    return kernel(tf.zeros([2])), kernel(tf.zeros([3])), kernel(tf.ones([2]))

  small, large, again = both()
  assert len(traces) == 2
  np.testing.assert_array_equal(small.numpy(), [1.0, 1.0])
  np.testing.assert_array_equal(large.numpy(), [1.0, 1.0, 1.0])
  np.testing.assert_array_equal(again.numpy(), [3.0, 3.0])


def test_eagerly_a_kernel_runs_as_its_tf_function():
  kernel, traces = _counting_kernel("eager")
  np.testing.assert_array_equal(kernel(tf.ones([2])).numpy(), [3.0, 3.0])
  np.testing.assert_array_equal(kernel(tf.zeros([2])).numpy(), [1.0, 1.0])
  assert len(traces) == 1
