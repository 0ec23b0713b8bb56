"""A pre-activation ResNet (CIFAR variant) whose residual blocks switch on and off per replica.

``resnet(depth)`` builds He et al.'s pre-activation ResNet for 32x32 images (2016b: the
CIFAR network of 2016a, section 4.2, with batch normalisation and ReLU before each
convolution): a 3x3 stem, three stages of ``n = (depth - 2) / 6`` basic blocks (``width``,
2 ``width`` and 4 ``width`` filters; the first block of stages 2 and 3 halves the
resolution through a 1x1 projection), then BN, ReLU, global average pooling and a dense
head.

Every block but the first of each stage is *partitionable*: its output is
``x + gate * F(x)``, ``F`` the residual branch, with ``gate`` a non-trainable variable
held per replica (``synchronization="on_read"``: every replica has a value of its own).
A gate of 0 takes the other branch of a ``tf.cond``: the block is skipped, the output is
exactly ``x``, ``F`` is not computed, its batch-normalisation statistics are not updated
and its weights get a zero gradient (their weight decay is inside the skipped branch
too). A gate of 1 is the plain block; a gate in between scales the residual branch (the
test-time rule of ResIST).
"""

import weakref
from typing import List, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_adacomp.compat import internals
from tf_adacomp.ops import checks

STAGE_WIDTHS = (1, 2, 4)


def _check_depth(depth):
  if not checks.is_int(depth) or depth < 8 or (depth - 2) % 6:
    raise ValueError(f"`depth` must be 6n + 2 with n >= 1 (8, 14, 20, 32, 44, 56, 110). "
                     f"Received: depth={depth!r}")


@keras.saving.register_keras_serializable(package="tf_adacomp")
class ResidualBlock(keras.layers.Layer):
  """A pre-activation basic block: ``x + F(x)``, or ``x + gate * F(x)`` when partitionable.

  ``F(x) = conv3x3(relu(bn(conv3x3(relu(bn(x))))))``. When the block changes the
  resolution or the channels, the shortcut is a 1x1 convolution of ``relu(bn(x))``.

  Args:
    filters: output channels.
    strides: 1 or 2 (the first convolution's and the projection's stride).
    partitionable: whether ResIST may switch the block off (needs an identity
      shortcut: ``strides == 1`` and as many input channels as ``filters``).
    weight_decay: L2 factor of the convolution kernels (0 for none). A partitionable
      block adds it only while it is on, so a skipped block gets no gradient at all.
    stage: the stage index (0-based) the block belongs to; ResIST deals blocks per stage.
    **kwargs: ``keras.layers.Layer`` arguments (``name``, ...).

  Raises:
    ValueError: ``filters`` < 1, ``strides`` not 1 or 2, ``weight_decay`` < 0, or (when
      built) a partitionable block without an identity shortcut.
  """

  def __init__(self, filters, strides=1, partitionable=False, weight_decay=0.0, stage=0,
               **kwargs):
    super().__init__(**kwargs)
    checks.int_at_least(filters, "filters", 1, word="int")
    if strides not in (1, 2):
      raise ValueError(f"`strides` must be 1 or 2. Received: strides={strides!r}")
    if not weight_decay >= 0:
      raise ValueError(f"`weight_decay` must be >= 0. Received: weight_decay={weight_decay!r}")
    self.filters = filters
    self.strides = strides
    self.partitionable = bool(partitionable)
    self.weight_decay = float(weight_decay)
    self.stage = int(stage)
    # A partitionable block's decay is added in call(), inside the branch that runs.
    regularizer = (keras.regularizers.L2(self.weight_decay)
                   if self.weight_decay and not self.partitionable else None)

    def conv(kernel, stride, name):
      return keras.layers.Conv2D(filters, kernel, stride, padding="same", use_bias=False,
                                 kernel_initializer="he_normal",
                                 kernel_regularizer=regularizer, name=name)

    self.bn1 = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name="bn1")
    self.conv1 = conv(3, strides, "conv1")
    self.bn2 = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name="bn2")
    self.conv2 = conv(3, 1, "conv2")
    self._conv = conv
    self.projection = None
    self.gate = None

  def build(self, input_shape):
    input_shape = tuple(input_shape)
    needs_projection = self.strides != 1 or input_shape[-1] != self.filters
    if needs_projection and self.partitionable:
      raise ValueError(f"A partitionable block needs an identity shortcut (strides 1, "
                       f"{self.filters} input channels). Received: strides={self.strides}, "
                       f"input_shape={input_shape}")
    self.bn1.build(input_shape)
    self.conv1.build(input_shape)
    inner = self.conv1.compute_output_shape(input_shape)
    self.bn2.build(inner)
    self.conv2.build(inner)
    if needs_projection:
      self.projection = self._conv(1, self.strides, "projection")
      self.projection.build(input_shape)
    if self.partitionable:
      # One value per replica: each replica trains its own sub-ResNet. Reading it in a
      # cross-replica context (checkpoints, get_weights) gives replica 0's value.
      self.gate = keras.Variable(1.0, shape=(), dtype="float32", trainable=False,
                                 synchronization="on_read",
                                 aggregation="only_first_replica", name="gate")

  def compute_output_shape(self, input_shape):
    return self.conv1.compute_output_shape(tuple(input_shape))

  def _branch(self, x, training):
    """``F(x)`` and the pre-activated input (the projection's input)."""
    pre = tf.nn.relu(self.bn1(x, training=training))
    y = self.conv1(pre)
    y = self.conv2(tf.nn.relu(self.bn2(y, training=training)))
    return y, pre

  def _decay(self):
    return self.weight_decay * (tf.reduce_sum(tf.square(self.conv1.kernel.value))
                                + tf.reduce_sum(tf.square(self.conv2.kernel.value)))

  def call(self, x, training=None):
    if self.gate is None:
      y, pre = self._branch(x, training)
      return y + (x if self.projection is None else self.projection(pre))
    gate = tf.convert_to_tensor(self.gate.value)  # this replica's value

    def on():
      y, _ = self._branch(x, training)
      decay = self._decay() if self.weight_decay else tf.zeros([], x.dtype)
      return x + tf.cast(gate, x.dtype) * y, tf.cast(decay, x.dtype)

    def off():  # exactly x: nothing of the branch runs, nothing flows back into it
      return tf.identity(x), tf.zeros([], x.dtype)

    y, decay = tf.cond(gate > 0, on, off)
    if self.weight_decay:
      self.add_loss(decay)
    return y

  def get_config(self):
    return {**super().get_config(), "filters": self.filters, "strides": self.strides,
            "partitionable": self.partitionable, "weight_decay": self.weight_decay,
            "stage": self.stage}


def resnet(depth: int = 20, num_classes: int = 10, input_shape: Sequence[int] = (32, 32, 3),
           width: int = 16, weight_decay: float = 1e-4, name=None) -> keras.Model:
  """The pre-activation CIFAR ResNet with partitionable blocks (see the module docstring).

  Args:
    depth: 6n + 2 (n >= 1): 8, 14, 20 (0.27M parameters at width 16), 32, 56, 110...
      Each stage has ``n - 1`` partitionable blocks.
    num_classes: outputs of the dense head (logits).
    input_shape: the shape of one input image.
    width: filters of the first stage (16 in He et al.); the others have 2x and 4x.
    weight_decay: L2 factor of every convolution and dense kernel (0 for none).
    name: the model's name (default ``f"preact_resnet{depth}"``).

  Returns:
    An uncompiled functional ``keras.Model`` (build it in the strategy's scope).

  Raises:
    ValueError: ``depth`` not 6n + 2 with n >= 1, ``width`` or ``num_classes`` < 1, or
      ``weight_decay`` < 0.
  """
  _check_depth(depth)
  checks.int_at_least(width, "width", 1, word="int")
  checks.int_at_least(num_classes, "num_classes", 1, word="int")
  if not weight_decay >= 0:
    raise ValueError(f"`weight_decay` must be >= 0. Received: weight_decay={weight_decay!r}")
  blocks = (depth - 2) // 6
  regularizer = keras.regularizers.L2(weight_decay) if weight_decay else None
  inputs = keras.Input(tuple(input_shape))
  x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False,
                          kernel_initializer="he_normal", kernel_regularizer=regularizer,
                          name="stem")(inputs)
  for stage, factor in enumerate(STAGE_WIDTHS):
    for block in range(blocks):
      x = ResidualBlock(width * factor, strides=2 if stage and not block else 1,
                        partitionable=block > 0, weight_decay=weight_decay, stage=stage,
                        name=f"stage{stage + 1}_block{block + 1}")(x)
  x = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name="head_bn")(x)
  x = keras.layers.ReLU(name="head_relu")(x)
  x = keras.layers.GlobalAveragePooling2D(name="head_pool")(x)
  outputs = keras.layers.Dense(num_classes, kernel_regularizer=regularizer, name="head")(x)
  return keras.Model(inputs, outputs, name=name or f"preact_resnet{depth}")


def partitionable_blocks(model: keras.Model) -> List[ResidualBlock]:
  """The model's partitionable ``ResidualBlock`` layers, stage by stage, in model order."""
  layers = internals.flatten_layers(model)
  blocks = [layer for layer in layers
            if isinstance(layer, ResidualBlock) and layer.partitionable]
  for block in blocks:
    if not block.built:
      raise ValueError(f"Build the model before ResIST uses it. Received: an unbuilt "
                       f"block {block.name!r}")
  return sorted(blocks, key=lambda b: b.stage)  # stable: model order within a stage


def blocks_per_stage(model: keras.Model) -> List[int]:
  """The number of partitionable blocks of each stage (0 for stages without any)."""
  stages = [b.stage for b in partitionable_blocks(model)]
  return [stages.count(s) for s in range(max(stages) + 1)] if stages else []


_REPLICA_IDS = weakref.WeakKeyDictionary()  # strategy -> its local replicas' global ids


def local_replica_ids(strategy) -> List[int]:
  """The global replica ids (``replica_id_in_sync_group``) of this worker's replicas."""
  if strategy not in _REPLICA_IDS:
    ids = tf.function(lambda: strategy.run(
        lambda: tf.distribute.get_replica_context().replica_id_in_sync_group))()
    _REPLICA_IDS[strategy] = [int(i) for i in strategy.experimental_local_results(ids)]
  return _REPLICA_IDS[strategy]


def set_gates(model: keras.Model, gates) -> None:
  """Sets every replica's gates: ``gates[r, k]`` on replica ``r`` for block ``k``.

  No communication: each of this worker's replicas gets its own row.

  Args:
    model: a model with partitionable blocks (``resnet``), built.
    gates: ``[replicas, num_blocks]`` (or ``[num_blocks]``: the same on every replica)
      float values; 0 switches a block off, 1 on.

  Raises:
    ValueError: ``gates`` of the wrong shape, or not finite.
  """
  blocks = partitionable_blocks(model)
  strategy = model.distribute_strategy
  replicas = strategy.num_replicas_in_sync
  gates = np.asarray(gates, np.float32)
  if gates.ndim == 1:
    gates = np.broadcast_to(gates, [replicas, gates.shape[0]])
  if gates.shape != (replicas, len(blocks)) or not np.all(np.isfinite(gates)):
    raise ValueError(f"`gates` must be finite, of shape [replicas, blocks] = "
                     f"[{replicas}, {len(blocks)}]. Received: gates={gates.tolist()}")
  ids = local_replica_ids(strategy)
  for k, block in enumerate(blocks):
    for rid, component in zip(ids, strategy.experimental_local_results(block.gate.value)):
      component.assign(gates[rid, k])


def get_gates(model: keras.Model) -> np.ndarray:
  """This worker's gates, ``[local replicas, num_blocks]`` (rows in local replica order)."""
  blocks = partitionable_blocks(model)
  strategy = model.distribute_strategy
  columns = [[float(c.numpy()) for c in strategy.experimental_local_results(b.gate.value)]
             for b in blocks]
  local = len(local_replica_ids(strategy))
  return np.array(columns, np.float32).T.reshape(local, len(blocks))
