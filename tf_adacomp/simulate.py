"""N learners simulated in one process: the compressed exchange without tf.distribute.

Each learner computes the gradient of its shard of the batch, compresses it with its own
state (residues), and the payloads are combined by the package's own exchange
(``exchange.Exchange.local_exchange``, as ``CompressedAllReduce`` runs it), then
averaged and applied. Useful to study how compression affects accuracy and how many
bytes it sends, on any machine.
"""

from typing import Dict

import keras
import tensorflow as tf

from tf_adacomp import exchange
from tf_adacomp import stats
from tf_adacomp.compressors import registry
from tf_adacomp.ops import checks


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
    learners = checks.positive_int(learners, "learners")
    self.model = model
    self.optimizer = optimizer
    self.loss = keras.losses.get(loss)
    self.compressor = registry.get_compressor(compressor)
    self._exchange = exchange.Exchange(self.compressor)
    self.learners = learners
    variables = model.trainable_variables
    self.plans = [self.compressor.plan(v.shape, v.dtype, v.path) for v in variables]
    self.state = [[[tf.Variable(s, trainable=False) for s in self.compressor.init(p)]
                   for p in self.plans] for _ in range(learners)]
    self._step = tf.function(self._train_step)

  def _train_step(self, x, y):
    variables = self.model.trainable_variables
    xs, ys = tf.split(x, self.learners), tf.split(y, self.learners)
    grads, states, losses = [], [], []
    for learner in range(self.learners):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(self.loss(ys[learner], self.model(xs[learner], training=True)))
      losses.append(loss)
      grads.append(tape.gradient(loss, variables))
      states.append([tuple(v.read_value() for v in s) for s in self.state[learner]])
    # The package's exchange, with every learner on this device.
    devices = [""] * self.learners
    _, exchanged = self._exchange.local_exchange(self.plans, grads, states, devices, [""])
    for learner in range(self.learners):
      for state_vars, new in zip(self.state[learner], exchanged.states[learner]):
        for var, value in zip(state_vars, new):
          var.assign(value)
    averaged = [total / self.learners for total in exchanged.sums]
    sent = {plan.name: nbytes for plan, nbytes in zip(self.plans, exchanged.nbytes)}
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
