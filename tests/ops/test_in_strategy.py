"""The kernels inside ``strategy.run``: 4 logical CPU replicas, a real all-gather."""

import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp import ops


@pytest.mark.slow  # the fast tier runs the same path through the optimizer's tests
def test_compress_gather_decode_under_mirrored_strategy():
  strategy = tf_adacomp.distribute.mirrored_strategy(
      devices=[d.name for d in tf.config.list_logical_devices("CPU")])
  replicas = strategy.num_replicas_in_sync
  assert replicas == 4  # from conftest
  rng = np.random.default_rng(0)
  grads = rng.standard_normal([replicas, 30, 20]).astype(np.float32)
  residues = rng.standard_normal([replicas, 30, 20]).astype(np.float32)

  def value(arrays):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(arrays[ctx.replica_id_in_sync_group]))

  @tf.function
  def step(grad, residue):
    def replica_fn(g, r):
      payload, new_residue = ops.adacomp_compress(g, r, bin_size=50)
      # Every payload has the same static length here, so a plain all-gather works.
      gathered = tf.distribute.get_replica_context().all_gather(payload[None], axis=0)
      return ops.adacomp_decompress(gathered, g.shape), payload, new_residue
    return strategy.run(replica_fn, args=(grad, residue))

  summed, payloads, new_residues = step(value(grads), value(residues))
  summed = strategy.experimental_local_results(summed)
  payloads = strategy.experimental_local_results(payloads)
  new_residues = strategy.experimental_local_results(new_residues)

  # Same kernels eagerly, replica by replica: the distributed sum must match bit for bit.
  eager = [ops.adacomp_compress(grads[i], residues[i], 50) for i in range(replicas)]
  for i in range(replicas):
    np.testing.assert_array_equal(payloads[i], eager[i][0])
    np.testing.assert_array_equal(new_residues[i], eager[i][1])
  expected = ops.adacomp_decompress(tf.stack([p for p, _ in eager]), [30, 20]).numpy()
  for i in range(replicas):
    np.testing.assert_array_equal(summed[i], expected)  # identical on every replica
  # And nothing is lost: sent + kept == everything, summed over replicas.
  np.testing.assert_allclose(expected + np.sum([r for _, r in eager], 0),
                             np.sum(grads + residues, 0), atol=1e-5)
