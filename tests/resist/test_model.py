"""The pre-activation ResNet: its size, exact identities when off, gates per replica."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp import resist

DEVICES = [f"/cpu:{i}" for i in range(2)]


def _small(seed=0):
  keras.utils.set_random_seed(seed)
  return resist.resnet(14, input_shape=(8, 8, 3), width=4)


def test_resnet_has_the_cifar_size_and_shares_every_first_block():
  model = resist.resnet(20)
  convs = [w for w in model.trainable_weights if len(w.shape) == 4 and w.shape[0] == 3]
  assert len(convs) + 1 == 20  # 3x3 convolutions and the dense head
  assert model.count_params() == pytest.approx(0.27e6, rel=0.05)  # He et al., table 6
  assert resist.blocks_per_stage(model) == [2, 2, 2]
  assert [b.name for b in resist.partitionable_blocks(model)] == [
      f"stage{s}_block{b}" for s in (1, 2, 3) for b in (2, 3)]
  gates = [w for w in model.non_trainable_weights if w.path.endswith("/gate")]
  assert len(gates) == 6 and all(float(g.numpy()) == 1.0 for g in gates)
  assert resist.blocks_per_stage(resist.resnet(8)) == []


def test_an_inactive_block_is_exactly_the_identity_and_gets_no_gradient():
  model = _small()
  block = resist.partitionable_blocks(model)[1]  # stage 2: 8 channels, 4x4
  rng = np.random.default_rng(0)
  x = rng.standard_normal([4, 4, 4, 8]).astype(np.float32) * 1e3
  x[0, 0, 0, :2] = [-0.0, np.float32(3e38)]
  x = tf.constant(x)
  weights = tf.constant(rng.standard_normal(x.shape), tf.float32)
  stats = [w.numpy() for w in block.non_trainable_weights if "moving" in w.path]
  block.gate.assign(0.0)
  with tf.GradientTape(persistent=True) as tape:
    tape.watch(x)
    y = block(x, training=True)
    loss = tf.reduce_sum(y * weights) + tf.add_n(block.losses)  # with its weight decay
  assert y.numpy().tobytes() == x.numpy().tobytes()  # bit for bit, -0.0 included
  for grad in tape.gradient(loss, block.trainable_weights):
    assert grad is None or not np.any(grad.numpy())
  np.testing.assert_array_equal(tape.gradient(loss, x), weights)
  for before, w in zip(stats, [w for w in block.non_trainable_weights if "moving" in w.path]):
    np.testing.assert_array_equal(w.numpy(), before)  # statistics untouched

  block.gate.assign(1.0)
  x = x / 1e3
  with tf.GradientTape() as tape:
    y = block(x, training=False)
    loss = tf.reduce_sum(y) + tf.add_n(block.losses)
  branch, _ = block._branch(x, training=False)  # pylint: disable=protected-access
  np.testing.assert_array_equal(y, x + branch)
  assert all(np.any(g.numpy()) for g in tape.gradient(loss, block.trainable_weights))


def test_test_time_gates_scale_the_residual_branches():
  model = _small()
  x = tf.constant(np.random.default_rng(1).standard_normal([2, 8, 8, 3]), tf.float32)
  for block in resist.partitionable_blocks(model):
    block.gate.assign(0.25)
  block = resist.partitionable_blocks(model)[0]
  inputs = tf.random.stateless_normal([2, 8, 8, 4], seed=[1, 2])
  branch, _ = block._branch(inputs, training=False)  # pylint: disable=protected-access
  np.testing.assert_array_equal(block(inputs, training=False), inputs + 0.25 * branch)
  scaled = model(x, training=False)
  resist.set_gates(model, [1.0, 1.0, 1.0])
  assert not np.allclose(scaled, model(x, training=False))


def test_every_replica_runs_its_own_sub_resnet():
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES)
  with strategy.scope():
    model = _small()
  rows = [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
  resist.set_gates(model, rows)
  np.testing.assert_array_equal(resist.get_gates(model), rows)
  x = tf.constant(np.random.default_rng(2).standard_normal([2, 8, 8, 3]), tf.float32)
  outputs = strategy.experimental_local_results(
      tf.function(lambda: strategy.run(lambda: model(x, training=False)))())
  reference = _small()  # the same weights, one device: each replica's gates in turn
  for row, output in zip(rows, outputs):
    resist.set_gates(reference, row)
    np.testing.assert_allclose(output, reference(x, training=False), rtol=1e-5, atol=1e-6)
  assert not np.allclose(outputs[0], outputs[1])
  # A cross-replica read (checkpoints, get_weights) gives replica 0's gates.
  gates = [w.numpy() for w in model.non_trainable_weights if w.path.endswith("/gate")]
  np.testing.assert_array_equal(gates, rows[0])


@pytest.mark.parametrize("kwargs,match", [
    (dict(depth=21), "depth=21"), (dict(depth=2), "depth=2"), (dict(width=0), "width=0"),
    (dict(weight_decay=-1.0), "weight_decay=-1.0"), (dict(num_classes=0), "num_classes=0")])
def test_bad_arguments_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    resist.resnet(**kwargs)


def test_gates_of_the_wrong_shape_are_refused():
  with pytest.raises(ValueError, match=r"\[1, 3\]"):
    resist.set_gates(_small(), [[1.0, 0.0]])
  with pytest.raises(ValueError, match="identity shortcut"):
    resist.ResidualBlock(8, strides=2, partitionable=True)(tf.zeros([1, 4, 4, 8]))
