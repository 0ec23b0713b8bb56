"""N learners simulated in one process: the compressed exchange without tf.distribute.

Each learner computes the gradient of its shard of the batch, compresses it with its own
state (residues), and the payloads are combined exactly as the real exchange combines
them (summed when the plan is summable, otherwise stacked as a gathered payload and
decoded in learner order), then averaged and applied. Useful to study how compression
affects accuracy and how many bytes it sends, on any machine.
"""

from typing import Dict

import keras
import tensorflow as tf

from tf_adacomp import stats
from tf_adacomp.compressors import registry
from tf_adacomp.ops import adacomp as adacomp_ops


class SimulatedLearners:
  """Trains a Keras model as ``learners`` data-parallel learners with a compressor.

  Args:
    model: a built Keras model.
    optimizer: a Keras optimizer applied to the averaged decoded gradient.
    loss: a Keras loss (callable or name).
    compressor: a ``Compressor``, name or config (see ``get_compressor``).
    learners: int >= 1, the number of simulated learners; batches are split evenly.

  Raises:
    ValueError: ``learners`` < 1 or an unknown compressor.
  """

  def __init__(self, model, optimizer, loss, compressor="adacomp", learners: int = 4):
    if isinstance(learners, bool) or not isinstance(learners, int) or learners < 1:
      raise ValueError(f"`learners` must be an integer >= 1. Received: learners={learners!r}")
    self.model = model
    self.optimizer = optimizer
    self.loss = keras.losses.get(loss)
    self.compressor = registry.get_compressor(compressor)
    self.learners = learners
    variables = model.trainable_variables
    self.plans = [self.compressor.plan(v.shape, v.dtype, v.path) for v in variables]
    self.state = [[[tf.Variable(s, trainable=False) for s in self.compressor.init(p)]
                   for p in self.plans] for _ in range(learners)]
    self._step = tf.function(self._train_step)

  def _train_step(self, x, y):
    variables = self.model.trainable_variables
    xs, ys = tf.split(x, self.learners), tf.split(y, self.learners)
    payloads = [[] for _ in variables]
    losses = []
    for learner in range(self.learners):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(self.loss(ys[learner], self.model(xs[learner], training=True)))
      losses.append(loss)
      grads = tape.gradient(loss, variables)
      for i, (grad, plan) in enumerate(zip(grads, self.plans)):
        state = tuple(v.read_value() for v in self.state[learner][i])
        payload, new_state = self.compressor.compress(grad, state, plan)
        for var, value in zip(self.state[learner][i], new_state):
          var.assign(value)
        payloads[i].append(payload)
    averaged, sent = [], {}
    for i, plan in enumerate(self.plans):
      if plan.summable:
        combined = tf.add_n(payloads[i])
        per_learner = self.compressor.payload_nbytes(payloads[i][0], plan)
      else:
        combined = tf.stack(payloads[i])
        per_learner = adacomp_ops.exchange_nbytes(tf.stack(
            [self.compressor.payload_nbytes(p, plan) for p in payloads[i]]))
      averaged.append(self.compressor.decompress(combined, plan) / self.learners)
      sent[plan.name] = per_learner
    self.optimizer.apply_gradients(zip(averaged, variables))
    return tf.add_n(losses) / self.learners, sent

  def train_step(self, x, y):
    """One step on a global batch (its size divisible by ``learners``).

    Returns:
      ``(loss, bytes_sent)``: the mean loss and, per variable path, the bytes one
      learner sends for it this step (padding of the exchange included).
    """
    return self._step(x, y)


def compression_report(plans, bytes_sent_steps) -> Dict[str, Dict[str, float]]:
  """Dense float32 bytes vs bytes sent, per layer kind and in total, over steps.

  Args:
    plans: the ``TensorPlan`` of every variable.
    bytes_sent_steps: list of ``{variable path: bytes}`` dicts, one per step.

  Returns:
    ``stats.summarize`` of the bytes per learner per step, averaged over the steps.
  """
  steps = max(len(bytes_sent_steps), 1)
  return stats.summarize(
      (plan, sum(int(s[plan.name]) for s in bytes_sent_steps) / steps) for plan in plans)
