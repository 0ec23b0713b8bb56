"""ResIST as a Keras callback: rounds of independent sub-ResNet training, then an average.

    with strategy.scope():
      model = tf_adacomp.resist.resnet(depth=20)
      model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=..., metrics=...)
    trainer = tf_adacomp.resist.ResIST(local_steps=50)
    model.fit(train, epochs=..., callbacks=[trainer])
    model.evaluate(test)          # all blocks on, partitioned branches scaled by 1/S
    trainer.communication()       # bytes per round: ResIST, local SGD, data-parallel

Each round (Dun et al., UAI 2022): the partition of the partitionable blocks is dealt
from the seed and the round index (``partition.deal``: the same on every replica, no
communication) and set as the replicas' gates; each replica runs ``local_steps`` SGD steps
on its own sub-ResNet and its own data, with the optimizer's all-reduce switched off (its
copy of the weights drifts from the others'); then every variable (weights and
batch-normalisation statistics) becomes its average over the replicas that held it,
shared layers over all (``sync.HolderAverage``), and the optimizer state is reset. At the
end of ``fit`` all blocks are switched on, the partitioned residual branches scaled by
``partition.inference_scale``. With ``partition=False`` the same loop is local SGD: every
replica trains the whole network and every variable is averaged over all.
"""

from typing import Any, Dict, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_adacomp.compat import internals
from tf_adacomp.compat import patches
from tf_adacomp.optimizer import ALL_REDUCE_HOOK
from tf_adacomp.optimizer import CompressedOptimizer
from tf_adacomp.ops import checks
from tf_adacomp.resist import model as model_lib
from tf_adacomp.resist import partition as partition_lib
from tf_adacomp.resist import sync

# The Keras all-reduce hook that CompressedOptimizer also switches off (one name, one place).
_HOOK = ALL_REDUCE_HOOK


def _synced_variables(model):
  """``(shared, blocks)``: the float variables averaged at a sync, gates left out."""
  blocks = model_lib.partitionable_blocks(model)
  gates = {id(b.gate) for b in blocks}
  in_blocks = [[v for v in b.weights if id(v) not in gates] for b in blocks]
  taken = {id(v) for vs in in_blocks for v in vs} | gates
  shared = [v for v in model.weights
            if id(v) not in taken and tf.as_dtype(v.dtype).is_floating]
  return shared, in_blocks


def communication(model: keras.Model, replicas: int, local_steps: int = 50,
                  min_blocks: int = 0, seed: int = 0, rounds: int = 100) -> Dict[str, float]:
  """Bytes one replica sends, ResIST against local SGD and data-parallel, on ``model``.

  Without training: ResIST's figure is the mean over ``rounds`` dealt partitions (what
  ``ResIST.communication`` measures, round by round, during ``fit``).

  Args:
    model: a built model with partitionable blocks (``resnet``).
    replicas: S >= 1.
    local_steps: steps per round (data-parallel exchanges once per step).
    min_blocks, seed: as ``ResIST``'s.
    rounds: partitions to average over.

  Returns:
    ``resist_bytes_per_round`` (mean over replicas of its own trained parameters and
    segment lengths), ``resist_padded_bytes_per_round`` (every buffer padded to the
    longest, as TensorFlow's all-gather sends it), ``local_sgd_bytes_per_round`` (every
    variable, batch-normalisation statistics included, and the lengths),
    ``data_parallel_bytes_per_step`` (every trainable parameter, float32: the gradient
    all-reduce; Keras does not exchange batch-normalisation statistics) and
    ``data_parallel_bytes_per_round`` (times ``local_steps``).

  Raises:
    ValueError: an argument out of range (named, with the value).
  """
  local_steps = checks.int_at_least(local_steps, "local_steps", 1, word="int")
  shared, blocks = _synced_variables(model)
  shared_words = sum(int(np.prod(v.shape)) for v in shared)
  block_words = np.array([sum(int(np.prod(v.shape)) for v in b) for b in blocks], np.int64)
  stages = model_lib.blocks_per_stage(model)
  sent, padded = [], []
  for r in range(rounds):
    held = partition_lib.deal(stages, replicas, r, seed, min_blocks)
    cost = sync.round_bytes(np.concatenate(
        [np.full([replicas, 1], shared_words), held * block_words[None]], axis=1))
    sent.append(cost.sent.mean())
    padded.append(cost.padded)
  everything = sync.round_bytes(np.concatenate(
      [np.full([replicas, 1], shared_words), np.tile(block_words, [replicas, 1])], axis=1))
  trainable = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
  return {
      "resist_bytes_per_round": float(np.mean(sent)),
      "resist_padded_bytes_per_round": float(np.mean(padded)),
      "local_sgd_bytes_per_round": float(everything.padded),
      "data_parallel_bytes_per_step": float(sync.WORD_BYTES * trainable),
      "data_parallel_bytes_per_round": float(sync.WORD_BYTES * trainable * local_steps),
  }


class ResIST(keras.callbacks.Callback):
  """Trains a model with partitionable blocks by ResIST (or local SGD) inside ``model.fit``.

  The model comes from ``resist.resnet`` (or has ``resist.ResidualBlock`` layers) and
  is compiled with a Keras optimizer (not a ``CompressedOptimizer``) in the strategy's
  scope: ``MirroredStrategy``, ``MultiWorkerMirroredStrategy`` (through
  ``tf_adacomp.distribute.multi_worker_strategy()``) or none.

  Args:
    local_steps: SGD steps of every round (50 in Dun et al.).
    min_blocks: the minimum number of partitionable blocks of each sub-ResNet (0: none);
      also sets the test-time scale ``max(1/S, min_blocks / num_blocks)``.
    seed: the partitions' seed, the same on every replica and worker.
    partition: True for ResIST; False for local SGD (every replica trains every block;
      test time: all blocks, unscaled).

  Raises:
    ValueError: ``local_steps`` < 1, ``min_blocks`` < 0 or ``seed`` < 0; when training
      starts, ``min_blocks`` above the number of partitionable blocks, a
      ``CompressedOptimizer``, or ``steps_per_execution`` > 1.
  """

  def __init__(self, local_steps: int = 50, min_blocks: int = 0, seed: int = 0,
               partition: bool = True):
    super().__init__()
    self.local_steps = checks.int_at_least(local_steps, "local_steps", 1, word="int")
    self.min_blocks = checks.int_at_least(min_blocks, "min_blocks", 0, word="int")
    self.seed = checks.int_at_least(seed, "seed", 0, word="int")
    self.partition = bool(partition)
    self.rounds = 0          # exchanges so far (all fits)
    self.round_bytes = []    # sync.RoundBytes of each exchange
    self.held = None         # the current round's partition, bool [replicas, blocks]
    self._exchange = None
    self._round_index = 0
    self._steps_in_round = 0
    self._in_round = False
    self._hooked = None

  # --- The protocol ------------------------------------------------------------------

  @property
  def replicas(self) -> int:
    """S, the replicas of the model's strategy (all workers')."""
    return self.model.distribute_strategy.num_replicas_in_sync

  def partition_of(self, round_index: int) -> np.ndarray:
    """The partition of round ``round_index``, bool ``[replicas, num_blocks]``."""
    stages = model_lib.blocks_per_stage(self.model)
    if not self.partition:
      return partition_lib.everything(sum(stages), self.replicas)
    return partition_lib.deal(stages, self.replicas, round_index, self.seed, self.min_blocks)

  def inference_scale(self) -> float:
    """The test-time factor of the partitioned residual branches."""
    if not self.partition:
      return 1.0
    num_blocks = sum(model_lib.blocks_per_stage(self.model))
    return partition_lib.inference_scale(self.replicas, num_blocks, self.min_blocks)

  def _start_round(self):
    self.held = self.partition_of(self._round_index)
    model_lib.set_gates(self.model, self.held.astype(np.float32))
    self._steps_in_round = 0
    self._in_round = True

  def _end_round(self):
    lengths = self._exchange(self.held)
    sync.reset_optimizer(self.model.optimizer)
    self.round_bytes.append(sync.round_bytes(lengths))
    self.rounds += 1
    self._round_index += 1
    self._in_round = False

  def _set_inference_gates(self):
    num_blocks = sum(model_lib.blocks_per_stage(self.model))
    model_lib.set_gates(self.model, np.full(num_blocks, self.inference_scale(), np.float32))

  # --- Keras callback hooks ----------------------------------------------------------

  def on_train_begin(self, logs=None):
    model = self.model
    optimizer = model.optimizer
    if isinstance(optimizer, CompressedOptimizer) or not hasattr(optimizer, _HOOK):
      raise ValueError("ResIST trains every replica on its own between exchanges: compile "
                       "the model with a Keras optimizer (TensorFlow backend). "
                       f"Received: optimizer={optimizer!r}")
    steps_per_execution = getattr(model, "steps_per_execution", 1) or 1
    if steps_per_execution != 1:
      raise ValueError("ResIST counts steps in on_train_batch_end: compile with "
                       f"steps_per_execution=1. Received: steps_per_execution="
                       f"{steps_per_execution}")
    num_blocks = sum(model_lib.blocks_per_stage(model))
    if self.partition and self.min_blocks > num_blocks:
      raise ValueError(f"`min_blocks` must be <= the model's {num_blocks} partitionable "
                       f"blocks. Received: min_blocks={self.min_blocks}")
    if self._exchange is None or self._exchange.strategy is not model.distribute_strategy:
      shared, blocks = _synced_variables(model)
      self._exchange = sync.HolderAverage(model.distribute_strategy, shared, blocks)
    # Each replica steps on its own gradient: no all-reduce (an instance attribute read
    # when the train step is traced; the train function is remade to trace it).
    self._hooked = optimizer
    patches.patch_instance(optimizer, internals.ALL_REDUCE_LOCAL, sync.local_gradients)
    model.make_train_function(force=True)
    # A fit that starts mid-way (resumed, or after a partial round) starts a new round.
    iterations = int(optimizer.iterations.numpy())
    self._round_index = -(-iterations // self.local_steps)
    self._in_round = False

  def on_train_batch_begin(self, batch, logs=None):
    if not self._in_round:
      self._start_round()

  def on_train_batch_end(self, batch, logs=None):
    self._steps_in_round += 1
    if self._steps_in_round == self.local_steps:
      self._end_round()

  def on_train_end(self, logs=None):
    if self._in_round and self._steps_in_round:
      self._end_round()  # a last, partial round: the replicas leave fit identical
    self._in_round = False
    self._set_inference_gates()
    if self._hooked is not None:
      patches.unpatch_instance(self._hooked, internals.ALL_REDUCE_LOCAL)
      self._hooked = None
    self.model.train_function = None  # a later fit traces the optimizer's own all-reduce

  def on_test_begin(self, logs=None):
    # Validation inside fit: all blocks on. Mid-round, the replicas still differ, and each
    # evaluates its own copy; at a round boundary they are identical.
    if self._in_round:
      self._set_inference_gates()

  def on_test_end(self, logs=None):
    if self._in_round:
      model_lib.set_gates(self.model, self.held.astype(np.float32))

  # --- Accounting ----------------------------------------------------------------------

  def communication(self) -> Dict[str, Any]:
    """Measured bytes per round of this trainer, with data-parallel's on the same model.

    Returns:
      ``method`` ("resist" or "local_sgd"), ``replicas``, ``local_steps``, ``rounds``,
      ``bytes_per_round`` (mean over rounds and replicas of the bytes one replica sent:
      its trained parameters and segment lengths), ``padded_bytes_per_round`` (each
      buffer padded to the longest, as TensorFlow's all-gather sends it),
      ``inference_scale``, and ``communication(model, ...)``'s references
      (``local_sgd_bytes_per_round``, ``data_parallel_bytes_per_step`` and ``..._round``).
    """
    measured: Dict[str, Optional[float]] = {"bytes_per_round": None,
                                            "padded_bytes_per_round": None}
    if self.round_bytes:
      measured = {
          "bytes_per_round": float(np.mean([b.sent.mean() for b in self.round_bytes])),
          "padded_bytes_per_round": float(np.mean([b.padded for b in self.round_bytes]))}
    reference = communication(self.model, self.replicas, self.local_steps,
                              self.min_blocks if self.partition else 0, self.seed, rounds=1)
    return {"method": "resist" if self.partition else "local_sgd",
            "replicas": self.replicas, "local_steps": self.local_steps,
            "rounds": self.rounds, **measured, "inference_scale": self.inference_scale(),
            "local_sgd_bytes_per_round": reference["local_sgd_bytes_per_round"],
            "data_parallel_bytes_per_step": reference["data_parallel_bytes_per_step"],
            "data_parallel_bytes_per_round": reference["data_parallel_bytes_per_round"]}
