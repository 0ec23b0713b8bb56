"""A tiny linear model trained under ``model.fit`` on replicas that see different data,
with the eager, strategy-free pieces a NumPy replay of an exchange needs.

Each replica's shard of a batch has its own target map, so the replicas' gradients
disagree; ``own_mean_gradients`` gives, eagerly and without a strategy, the gradient one
replica computes on its shard. Used by tests/test_optimizer_updates.py,
tests/test_optimizer_adasum.py and tests/test_shared_moment.py.
"""

import math

import keras
import numpy as np
import tensorflow as tf

import tf_adacomp

# The 4 logical CPU devices of tests/conftest.py.
DEVICES = [f"/cpu:{i}" for i in range(4)]
FEATURES, OUTPUTS, PER_REPLICA = 5, 3, 4


def linear_model():
  keras.utils.set_random_seed(1)
  return keras.Sequential([keras.Input([FEATURES]), keras.layers.Dense(OUTPUTS)])


def data(replicas, steps):
  rng = np.random.default_rng(7)
  x = rng.standard_normal([steps * replicas * PER_REPLICA, FEATURES]).astype(np.float32)
  maps = rng.standard_normal([replicas, FEATURES, OUTPUTS]).astype(np.float32)
  shard = (np.arange(len(x)) // PER_REPLICA) % replicas
  y = np.einsum("nf,nfo->no", x, maps[shard]).astype(np.float32)
  return x, y


def own_mean_gradients(weights, x, y):
  """Per-variable gradients of the mean squared error of one shard (no strategy)."""
  net = linear_model()
  net.set_weights(weights)
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(keras.losses.mean_squared_error(y, net(x)))
  return [g.numpy() for g in tape.gradient(loss, net.trainable_variables)]


def fit(optimizer, replicas, steps, cross_device_ops=None):
  """``model.fit`` for ``steps`` steps on ``replicas`` devices; ``optimizer`` is a factory.

  Returns ``(start weights, model, strategy)``.
  """
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES[:replicas],
                                                     cross_device_ops=cross_device_ops)
  x, y = data(replicas, steps)
  with strategy.scope():
    net = linear_model()
    net.compile(optimizer=optimizer(), loss="mse")
  start = net.get_weights()
  net.fit(x, y, batch_size=replicas * PER_REPLICA, epochs=1, shuffle=False, verbose=0)
  return start, net, strategy


def fit_on_shards(net, strategy, replicas, x, y, first, last):
  """``net.fit`` on global batches ``first`` to ``last`` of ``x, y`` (``data``'s), each
  replica fed its own shard of each (the ``PER_REPLICA`` consecutive rows Keras would
  split it into, as ``shards`` gives them) by a pipeline of its own: NumPy arrays would go
  through a ``MultiDeviceIterator``, whose per-device functions cost more CPU than these
  models' steps (about 0.4 CPU-s a fit on 4 replicas); the weights come out bit-identical
  either way."""
  def shard(context):
    r = context.input_pipeline_id  # the replica (one pipeline per replica)
    own = (np.arange(first, last)[:, None] * replicas * PER_REPLICA + r * PER_REPLICA
           + np.arange(PER_REPLICA)).ravel()
    return tf.data.Dataset.from_tensor_slices((x[own], y[own])).batch(PER_REPLICA)

  dataset = strategy.distribute_datasets_from_function(shard, tf.distribute.InputOptions(
      experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
      experimental_fetch_to_device=False))
  net.fit(dataset, epochs=1, shuffle=False, verbose=0)


def shards(replicas, step, steps):
  """``[(x, y)]`` of each replica at ``step``."""
  x, y = data(replicas, steps)
  batch = slice(step * replicas * PER_REPLICA, (step + 1) * replicas * PER_REPLICA)
  xb, yb = x[batch], y[batch]
  return [(xb[r * PER_REPLICA:(r + 1) * PER_REPLICA], yb[r * PER_REPLICA:(r + 1) * PER_REPLICA])
          for r in range(replicas)]


def replica_weights(net, strategy):
  """``[[copy on each replica] per trainable variable]``."""
  return [[c.numpy() for c in strategy.experimental_local_results(v.value)]
          for v in net.trainable_variables]


def replica_values(variable, strategy):
  """Each replica's copy of a (Keras) variable."""
  value = variable.value if isinstance(variable, keras.Variable) else variable
  return [c.numpy() for c in strategy.experimental_local_results(value)]



def np_topk(held, density):
  """TopK with error feedback: (sent values, new residue, sent mask) of ``held``."""
  flat = held.ravel()
  k = max(1, math.ceil(density * flat.size))
  sent = np.zeros(flat.size, bool)
  sent[np.argsort(-np.abs(flat), kind="stable")[:k]] = True
  values = np.where(sent, flat, 0).astype(np.float32)
  return values.reshape(held.shape), np.where(sent, 0, flat).reshape(held.shape), sent.reshape(
      held.shape)


def assert_replicas_hold(model, strategy, expected, rtol=1e-5, atol=1e-6):
  for v, copies in enumerate(replica_weights(model, strategy)):
    for copy in copies:  # bit-identical on every replica
      np.testing.assert_array_equal(copy, copies[0])
    np.testing.assert_allclose(copies[0], expected[v], rtol=rtol, atol=atol)
