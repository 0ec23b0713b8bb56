"""CompressedOptimizer receiving corrupt payloads: the step is skipped, nothing is lost.

The gathered AdaComp payloads are corrupted in transit (between the all-gather and the
decoders, as a faulty link or a hostile peer would), on 2 replicas of MirroredStrategy:
their words (the rank-1 int32 gather), or their lengths (the rank-2 int32 gather,
``[replicas, payloads]``). The decoders mark what they cannot trust as NaN
(tests/ops/test_hostile_payloads.py), ``exchange.Exchange.decode`` marks lengths that do
not add up (tests/test_exchange_lengths.py), and the optimizer then leaves weights and
residues as they were on every replica.
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


# Kinds that corrupt the gathered lengths rather than the words.
LENGTH_KINDS = ("negative_length_same_total", "length_above_width", "lengths_exceed_data")


def _corrupt_lengths(lengths, kind):
  """``lengths`` (the gathered int32 ``[replicas, payloads]`` lengths) corrupted."""
  first = lengths[0, 0]
  if kind == "negative_length_same_total":
    # The first length made negative and the last one grown by as much: the total still
    # matches the words, so every later row would silently start elsewhere.
    change = tf.tensor_scatter_nd_update(tf.zeros_like(lengths), [[0, 0]], [-3 - first])
    return lengths + change - tf.reverse(change, [0, 1])
  if kind == "length_above_width":  # far beyond any payload's width, and the words
    return tf.tensor_scatter_nd_update(lengths, [[0, 0]], [2**20])
  assert kind == "lengths_exceed_data"  # one word more than was sent
  return lengths + tf.reverse(
      tf.tensor_scatter_nd_update(tf.zeros_like(lengths), [[0, 0]], [1]), [0, 1])


def _states(optimizer):
  return [[c.numpy() for c in r.value.values] for state in optimizer.residues for r in state]


# Every kind, in the order of the corruption selector below (index -1: no corruption).
KINDS = ("count_above_capacity", "negative_count", "flipped_bits", "random_words",
         *LENGTH_KINDS)


@pytest.fixture(scope="module")
def trained_model():
  """``trained_model(exchange, start_step)``: ``(model, clean, corrupted, kind)`` for one
  configuration, shared by its tests: a model of 2 replicas trained 4 clean steps
  (residues and momentum non-zero) with ``clean``, its train function, then one more
  with ``corrupted``, the same step traced with every kind of corruption behind a selector
  (``kind``, an int variable: the index of the kind in ``KINDS``, -1 for none, as then).
  Each configuration traces and compiles its step twice, rather than three times per
  test.

  Each test measures against the state it finds (weights and residues on entry) and
  leaves the model trained one more clean step, so they may share it."""
  models = {}

  def get(exchange, start_step):
    if (exchange, start_step) in models:
      return models[exchange, start_step]
    strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES)
    (x, y), _ = digits_data.flat()
    with strategy.scope():
      model = digits_data.mlp(0, tf_adacomp.CompressedOptimizer(
          keras.optimizers.SGD(0.1, momentum=0.9), tf_adacomp.AdaComp(min_size=100),
          exchange=exchange, start_step=start_step))
    model.fit(x[:256], y[:256], batch_size=64, epochs=1, verbose=0, shuffle=False)
    clean = model.train_function
    kind = tf.Variable(-1, dtype=tf.int32, trainable=False)
    original = tf.distribute.ReplicaContext.all_gather

    def all_gather(self, value, axis, options=None):
      gathered = original(self, value, axis, options)
      # The compact payloads' words go as one 1-D int32 buffer, their lengths as rank 2.
      if not isinstance(gathered, tf.Tensor) or gathered.dtype != tf.int32:
        return gathered
      if gathered.shape.rank == 2:
        candidates = [_corrupt_lengths(gathered, k) if k in LENGTH_KINDS else gathered
                      for k in KINDS]
      elif gathered.shape.rank == 1:
        candidates = [gathered if k in LENGTH_KINDS else _corrupt(gathered, k) for k in KINDS]
      else:
        return gathered
      # Every kind computed (a few small tensors), the chosen one taken. Not
      # tf.switch_case: with its branch functions, a step traced once and called again
      # after another trace failed with "Function NoOp is not defined" under a mutation
      # of the guard, instead of at the assertion.
      index = tf.where(kind < 0, len(KINDS), kind)
      return tf.gather(tf.stack(candidates + [gathered]), index)

    tf.distribute.ReplicaContext.all_gather = all_gather
    try:
      # Traced again, with the corruption selector (on its first call: a step with none).
      model.make_train_function(force=True)
      model.fit(x[256:320], y[256:320], batch_size=64, epochs=1, verbose=0, shuffle=False)
      corrupted = model.train_function
    finally:
      tf.distribute.ReplicaContext.all_gather = original
    models[exchange, start_step] = model, clean, corrupted, kind
    return models[exchange, start_step]

  return get


# The kinds are spread over the two exchanges rather than crossed with them. All run
# with --full: the fast tier has what they put together, the decoders' and the lengths'
# checks (tests/ops/test_hostile_payloads.py, tests/test_exchange_lengths.py) and the
# skip of a non-finite step (tests/test_optimizer.py).
@pytest.mark.parametrize("exchange, kind, start_step", [
    pytest.param("gradients", "count_above_capacity", 0, marks=pytest.mark.slow),
    pytest.param("gradients", "random_words", 0, marks=pytest.mark.slow),
    pytest.param("updates", "negative_count", 0, marks=pytest.mark.slow),
    pytest.param("updates", "flipped_bits", 0, marks=pytest.mark.slow),
    # The lengths: one kind per exchange here, every kind against the decoder in
    # tests/test_exchange_lengths.py (its property test) at a fraction of the cost.
    pytest.param("gradients", "negative_length_same_total", 0, marks=pytest.mark.slow),
    pytest.param("updates", "length_above_width", 0, marks=pytest.mark.slow),
    # In warm-up the rows are float32 words, whose zeros (all that refused lengths read)
    # decode to a finite zero: only the exchange's own mark skips the step.
    pytest.param("updates", "lengths_exceed_data", 100, marks=pytest.mark.slow)])
def test_a_corrupt_payload_skips_the_step_and_keeps_weights_and_residues(
    trained_model, exchange, kind, start_step):
  model, clean, corrupted, selected = trained_model(exchange, start_step)
  (x, y), _ = digits_data.flat()
  weights, residues = model.get_weights(), _states(model.optimizer)
  if start_step == 0:  # AdaComp from the first step: the residues hold something to keep
    assert any(np.any(replica) for state in residues for replica in state), exchange

  selected.assign(KINDS.index(kind))
  model.train_function = corrupted  # the step traced with the corruption
  try:
    model.fit(x[256:320], y[256:320], batch_size=64, epochs=1, verbose=0, shuffle=False)
  finally:
    selected.assign(-1)
  for a, b in zip(weights, model.get_weights()):
    np.testing.assert_array_equal(a, b, err_msg=f"{kind}: the weights changed")
  for a, b in zip(residues, _states(model.optimizer)):
    for replica_a, replica_b in zip(a, b):
      np.testing.assert_array_equal(replica_a, replica_b,
                                    err_msg=f"{kind}: the residues changed")

  # The clean step again (traced before the corruption): the skipped step left a state
  # that still trains.
  model.train_function = clean
  model.fit(x[256:320], y[256:320], batch_size=64, epochs=1, verbose=0, shuffle=False)
  after = model.get_weights()
  assert all(np.isfinite(w).all() for w in after)
  assert any(not np.array_equal(a, b) for a, b in zip(weights, after))
