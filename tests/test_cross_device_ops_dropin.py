"""CompressedAllReduce as a drop-in CrossDeviceOps (issue 19): checkpoints of the residues
that a model's checkpoint does not hold."""

import logging
import re

import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp

DEVICES = ["/cpu:0", "/cpu:1"]


def _reduce(strategy, values):
  # batch_reduce_to: MirroredStrategy's reduce_to sends CPU destinations to
  # ReductionToOneDevice, past the strategy's cross-device ops.
  return strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(values, values)])[0]


def _per_replica(strategy, fn):
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: fn(ctx.replica_id_in_sync_group))


# --- Item 9: residues and model checkpoints -----------------------------------------------

def test_the_first_residues_warn_once_how_to_checkpoint_them(caplog):
  ops = tf_adacomp.CompressedAllReduce(tf_adacomp.TopK(0.25))
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES, cross_device_ops=ops)
  values = _per_replica(strategy, lambda r: tf.range(64, dtype=tf.float32) * float(r + 1))
  with caplog.at_level(logging.INFO, logger="tf_adacomp"):
    _reduce(strategy, values)
    _reduce(strategy, values)
  warnings = [r.getMessage() for r in caplog.records if "residues" in r.getMessage()]
  assert len(warnings) == 1
  assert "tf.train.Checkpoint(" in warnings[0]
  assert "CompressedAllReduce.of(strategy)" in warnings[0]


def test_of_finds_the_strategys_compressed_all_reduce_and_refuses_other_strategies():
  ops = tf_adacomp.CompressedAllReduce("topk")
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES, cross_device_ops=ops)
  assert tf_adacomp.CompressedAllReduce.of(strategy) is ops
  plain = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES)
  with pytest.raises(ValueError, match="strategy="):
    tf_adacomp.CompressedAllReduce.of(plain)


def test_the_documented_one_line_addition_checkpoints_the_residues(tmp_path):
  """The tutorial's checkpoint plus ``residues=CompressedAllReduce.of(strategy)``."""
  ops = tf_adacomp.CompressedAllReduce(tf_adacomp.TopK(0.25))
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES, cross_device_ops=ops)
  with strategy.scope():
    weights = tf.Variable(tf.zeros([64]))
  values = _per_replica(strategy, lambda r: tf.range(64, dtype=tf.float32) * float(r + 1))
  _reduce(strategy, values)
  checkpoint = tf.train.Checkpoint(weights=weights,
                                   residues=tf_adacomp.CompressedAllReduce.of(strategy))
  path = checkpoint.save(str(tmp_path / "ckpt"))
  saved = {k: [vs[0].numpy() for vs in v] for k, v in ops.residues.items()}
  assert any(np.abs(r).sum() > 0 for per_device in saved.values() for r in per_device)
  for per_device in ops.residues.values():
    for state in per_device:
      state[0].assign(tf.zeros_like(state[0]))
  checkpoint.restore(path)
  for key, per_device in saved.items():
    for residue, state in zip(per_device, ops.residues[key]):
      np.testing.assert_array_equal(residue, state[0].numpy())


# --- Item 10: the first reduction's XLA compilation is announced and timed -------------------

def test_the_first_compressed_reduction_logs_its_xla_compilation(caplog):
  ops = tf_adacomp.CompressedAllReduce(tf_adacomp.TopK(0.43))
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES, cross_device_ops=ops)
  # A shape and density no other test uses: their kernels are new to the process.
  values = _per_replica(strategy, lambda r: tf.ones([5, 17]) * float(r + 1))
  reduce = tf.function(lambda: _reduce(strategy, values))
  with caplog.at_level(logging.INFO, logger="tf_adacomp"):
    reduce()
    reduce()
    ops._compile_log.thread.join(timeout=10)  # pylint: disable=protected-access
  lines = [r.getMessage() for r in caplog.records if "XLA programs" in r.getMessage()]
  assert len(lines) == 2, lines
  assert "CompressedAllReduce" in lines[0] and "compiles" in lines[0]
  assert re.search(r"ran its first compressed step in \d+\.\d s", lines[1])


# --- Item 2: TF1 graph mode (tf.compat.v1 Graph and Session) is refused ----------------------

def test_tf1_graph_mode_is_refused_at_construction_naming_it():
  with tf.Graph().as_default():
    with pytest.raises(RuntimeError, match="TF1 graph mode"):
      tf_adacomp.CompressedAllReduce(tf_adacomp.TopK(0.25))


def test_tf1_graph_mode_is_refused_at_the_first_reduction_naming_it():
  """Made eagerly, reducing in a Graph: it used to return NaN from every compressed
  reduction, with residues outside the graph (never initialised)."""
  ops = tf_adacomp.CompressedAllReduce(tf_adacomp.TopK(0.25))
  with tf.Graph().as_default():
    strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES, cross_device_ops=ops)
    values = _per_replica(strategy, lambda r: tf.range(64, dtype=tf.float32) * float(r + 1))
    with pytest.raises(RuntimeError, match="TF1 graph mode"):
      _reduce(strategy, values)
