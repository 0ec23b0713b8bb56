"""Which reductions of a MirroredStrategy reach CompressedAllReduce (TensorFlow decides).

TensorFlow's ``MirroredStrategy`` (2.21: ``MirroredExtended._reduce_to``) sends a
``reduce_to`` whose destinations include a CPU device, or are not the value's own
devices, to ``ReductionToOneDevice``, never to the strategy's cross-device ops; and
``strategy.reduce`` reduces to the current device or the host CPU. ``batch_reduce_to``
(``ReplicaContext.all_reduce``, Keras' gradient aggregation) always reaches them. The
docs (README.md, docs/distributed.md, tf_adacomp/cross_device_ops.py) say so: these tests
fail if TensorFlow changes it. (That the compressed path then compresses, and that
``model.fit`` goes through it, is tests/test_cross_device_ops.py's.)
"""

import ast
import pathlib

import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp

DEVICES = ["/cpu:0", "/cpu:1"]
SUM = tf.distribute.ReduceOp.SUM


class _Counting(tf_adacomp.CompressedAllReduce):
  """A CompressedAllReduce that counts the reductions TensorFlow hands it."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.calls = 0

  def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
    self.calls += 1
    return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)


@pytest.fixture(scope="module")
def strategy_and_ops():
  # "none": no XLA program to compile; what is counted is whether TF calls the ops.
  ops = _Counting("none")
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES, cross_device_ops=ops)
  return strategy, ops


def _per_replica(strategy):
  """Replica r holds [r + 1] * 4 (a float vector, which the ops would compress)."""
  return strategy.run(lambda: tf.fill([4], tf.cast(
      tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32)))


def _reductions_that_bypass(strategy, value):
  return {
      "strategy.reduce": lambda: strategy.reduce(SUM, value, axis=None),
      "reduce_to(its own CPU devices)": lambda: strategy.extended.reduce_to(
          SUM, value, destinations=value),
      "reduce_to('/cpu:0')": lambda: strategy.extended.reduce_to(
          SUM, value, destinations="/cpu:0"),
  }


def test_strategy_reduce_and_reduce_to_a_cpu_do_not_reach_compressed_all_reduce(
    strategy_and_ops):
  strategy, ops = strategy_and_ops
  value = _per_replica(strategy)
  for name, reduce in _reductions_that_bypass(strategy, value).items():
    ops.calls = 0
    result = reduce()
    for local in strategy.experimental_local_results(result):
      np.testing.assert_array_equal(local.numpy(), np.full([4], 3.0), err_msg=name)
    assert ops.calls == 0, f"{name} now reaches CompressedAllReduce: update the docs"


def test_batch_reduce_to_and_replica_all_reduce_reach_compressed_all_reduce(
    strategy_and_ops):
  strategy, ops = strategy_and_ops
  value = _per_replica(strategy)
  reductions = {
      "batch_reduce_to(its own devices)": lambda: strategy.extended.batch_reduce_to(
          SUM, [(value, value)])[0],
      "batch_reduce_to('/cpu:0')": lambda: strategy.extended.batch_reduce_to(
          SUM, [(value, "/cpu:0")])[0],
      "ReplicaContext.all_reduce": lambda: strategy.run(
          lambda: tf.distribute.get_replica_context().all_reduce(SUM, tf.fill(
              [4], tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group + 1,
                           tf.float32)))),
  }
  for name, reduce in reductions.items():
    ops.calls = 0
    result = reduce()
    for local in strategy.experimental_local_results(result):
      np.testing.assert_array_equal(local.numpy(), np.full([4], 3.0), err_msg=name)
    assert ops.calls == 1, f"{name} no longer reaches CompressedAllReduce: update the docs"


def _sentences_naming(text, name):
  """The sentences of ``text`` (prose, any line breaks) that name ``name``."""
  flat = " ".join(text.split())
  return [s for s in flat.replace(": ", ". ").split(". ") if name in s]


@pytest.mark.parametrize("source", ["README.md", "docs/distributed.md",
                                    "tf_adacomp/cross_device_ops.py"])
def test_the_docs_say_strategy_reduce_is_not_compressed(source):
  # A sentence that lists strategy.reduce among the compressed paths is wrong for
  # TensorFlow 2.21 (the test above); each sentence naming it must say it is not.
  path = pathlib.Path(__file__).parent.parent / source
  text = path.read_text() if source.endswith(".md") else ast.get_docstring(
      ast.parse(path.read_text()))
  sentences = _sentences_naming(text, "strategy.reduce`")
  assert sentences, f"{source} no longer says what strategy.reduce does"
  for sentence in sentences:
    assert " not " in f" {sentence} " or "never" in sentence, (source, sentence)
