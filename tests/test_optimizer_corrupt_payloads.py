"""CompressedOptimizer receiving corrupt payloads: the step is skipped, nothing is lost.

The gathered AdaComp payloads are corrupted in transit (between the all-gather and the
decoders, as a faulty link or a hostile peer would), on 2 replicas of MirroredStrategy.
The decoders mark what they cannot trust as NaN (tests/ops/test_hostile_payloads.py),
and the optimizer then leaves weights and residues as they were on every replica.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import digits_data
import tf_adacomp

DEVICES = ["/cpu:0", "/cpu:1"]


def _corrupt(words, kind):
  """``words`` (the gathered int32 payload words of all replicas) corrupted."""
  if kind == "count_above_capacity":  # the first payload's count word
    return tf.concat([tf.constant([2**30], tf.int32), words[1:]], 0)
  if kind == "negative_count":
    return tf.concat([tf.constant([-5], tf.int32), words[1:]], 0)
  if kind == "flipped_bits":  # every word
    return tf.bitwise.bitwise_xor(words, tf.constant(0x5A5A5A5A, tf.int32))
  assert kind == "random_words"
  return tf.random.stateless_uniform(tf.shape(words), [7, 11], minval=None, maxval=None,
                                     dtype=tf.int32)


def _states(optimizer):
  return [[c.numpy() for c in r.value.values] for state in optimizer.residues for r in state]


# The kinds are spread over the two exchanges rather than crossed with them; the fast
# tier takes one kind per exchange (a count the decoder must refuse, every word
# corrupted), the other two run with --full.
@pytest.mark.parametrize("exchange, kind", [
    ("gradients", "count_above_capacity"),
    pytest.param("gradients", "random_words", marks=pytest.mark.slow),
    pytest.param("updates", "negative_count", marks=pytest.mark.slow),
    ("updates", "flipped_bits")])
def test_a_corrupt_payload_skips_the_step_and_keeps_weights_and_residues(
    monkeypatch, exchange, kind):
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES)
  (x, y), _ = digits_data.flat()
  with strategy.scope():
    model = digits_data.mlp(0, tf_adacomp.CompressedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), tf_adacomp.AdaComp(min_size=100),
        exchange=exchange))
  model.fit(x[:256], y[:256], batch_size=64, epochs=1, verbose=0, shuffle=False)
  weights, residues = model.get_weights(), _states(model.optimizer)

  original = tf.distribute.ReplicaContext.all_gather

  def all_gather(self, value, axis, options=None):
    gathered = original(self, value, axis, options)
    # The compact payloads' words go as one 1-D int32 buffer (their lengths, rank 2).
    if isinstance(gathered, tf.Tensor) and gathered.dtype == tf.int32 and gathered.shape.rank == 1:
      return _corrupt(gathered, kind)
    return gathered

  monkeypatch.setattr(tf.distribute.ReplicaContext, "all_gather", all_gather)
  model.make_train_function(force=True)  # traced again, with the corruption
  model.fit(x[256:320], y[256:320], batch_size=64, epochs=1, verbose=0, shuffle=False)
  for a, b in zip(weights, model.get_weights()):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(residues, _states(model.optimizer)):
    for replica_a, replica_b in zip(a, b):
      np.testing.assert_array_equal(replica_a, replica_b)

  monkeypatch.setattr(tf.distribute.ReplicaContext, "all_gather", original)
  model.make_train_function(force=True)  # traced again, without the corruption
  model.fit(x[256:320], y[256:320], batch_size=64, epochs=1, verbose=0, shuffle=False)
  after = model.get_weights()
  assert all(np.isfinite(w).all() for w in after)
  assert any(not np.array_equal(a, b) for a, b in zip(weights, after))
