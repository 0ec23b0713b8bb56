"""Adam with the global batch's second moment, estimated by each replica from its own
moments (``second_moment="global"`` inside local steps, and at every step by default:
``second_moment_interval=0``).

Each replica takes Adam's steps on its own gradient (within a round, or at every step
before the replicas' steps are averaged), from a batch R times smaller than the global
one. Its own second moment ``v_r`` then holds R times the
gradient noise that Adam on the global batch would divide by, and its steps are smaller
wherever the gradient is noisy: the mean of the replicas' steps is not Adam's step on
the global batch, and local Adam falls behind (docs/convergence.md). Each replica
instead divides by ``shared_moment.global_moment(v_r, w_r, R)``, the estimate of the
mean gradient's second moment from its own ``v_r`` (moving average of g^2) and ``w_r``
(of its bias-corrected first moment squared), which "global" with averages computes
from the replicas' means. Nothing crosses devices for it: the estimate is each
replica's own.

Per replica and step ``t`` (1-based), with ``g`` its own mean gradient:

    m <- m + (1 - beta_1) (g - m);   v <- v + (1 - beta_2) (g^2 - v)
    w <- w + (1 - beta_2) ((m / (1 - beta_1^t))^2 - w)
    weights <- decayed(weights) - lr sqrt(1 - beta_2^t) / (1 - beta_1^t)
                                  * m / (sqrt(global_moment(v, w, R)) + epsilon)

An Embedding's ``IndexedSlices`` gradient adds its slices' squares to ``v`` as Keras'
Adam does; those add up across replicas, so its estimate is ``v / R``. With one replica
the estimate is ``v``: Keras' Adam.

Inside rounds of local steps whose pseudo-updates are sent whole (uncompressed, or cast
to bfloat16 or float16) the replicas' first moments are reconciled at each round's end
at no cost in bytes (``infer_first_moments``): each replica's ``m`` becomes the first
moment that, over the round's H steps, would have moved the weights by the replicas'
mean pseudo-update,

    m <- -mean_update * (sqrt(estimate) + epsilon) / (alpha_t H)

which is the same on every replica up to their estimates. Left to drift apart, the
replicas' own first moments cost local AdamW about half a point on the small GPT; this
recovers it (docs/convergence.md). Where the pseudo-update was compressed (AdaComp), the
mean is not what the replicas stepped, and the inference costs accuracy instead: it is
off there.
"""

import tensorflow as tf

from tf_adacomp import shared_moment
from tf_adacomp.steps import inner as inner_lib


class EstimatedGlobalAdam(inner_lib.KerasInner):
  """A Keras Adam (or AdamW) inner optimizer whose own steps divide by each replica's
  estimate of the global batch's second moment.

  Args:
    optimizer: the built inner Adam or AdamW.
    local_clipnorm: as ``KerasInner``.
    momentum_squares: per variable the optimizer was built with, each replica's moving
      average of its squared first moment (``w``).
    variables: the variables the optimizer was built with, in that order.
    replicas: the number of replicas R.
  """

  def __init__(self, optimizer, local_clipnorm, momentum_squares, variables, replicas):
    super().__init__(optimizer, local_clipnorm)
    self.momentum_squares = momentum_squares
    self.index = {id(v): i for i, v in enumerate(variables)}
    self.replicas = replicas
    # Per variable (by id), whether its last traced step was on IndexedSlices (an
    # Embedding's, unclipped): its estimate is then v / R (set when a step is traced).
    self._sparse = {}

  def _estimate(self, v, w, sparse):
    """This replica's estimate of the global batch's second moment."""
    return v / self.replicas if sparse else shared_moment.global_moment(
        v, w, self.replicas, self.optimizer.beta_1)

  def own_step(self, grads, variables):
    optimizer = self.optimizer
    grads = self.clip(grads)
    beta_1, beta_2 = optimizer.beta_1, optimizer.beta_2
    t = tf.cast(optimizer.iterations, tf.int64) + 1
    learning_rate = optimizer.learning_rate
    alpha = shared_moment.step_size(learning_rate, t, t, beta_1, beta_2)
    momentums, velocities = shared_moment.moment_slots(optimizer)
    targets, values = [], []
    for grad, variable in zip(grads, variables):
      if grad is None:
        continue
      j = optimizer._get_variable_index(variable)  # pylint: disable=protected-access
      m_slot, v_slot = momentums[j], velocities[j]
      w_slot = self.momentum_squares[self.index[id(variable)]]
      sparse = isinstance(grad, tf.IndexedSlices)
      self._sparse[id(variable)] = sparse
      square = shared_moment.sparse_square(grad) if sparse else None
      m, v = shared_moment.local_moments(tf.convert_to_tensor(m_slot),
                                         tf.convert_to_tensor(v_slot), grad, beta_1,
                                         beta_2, square)
      w = shared_moment.local_momentum_square(tf.convert_to_tensor(w_slot), m, t, beta_1,
                                              beta_2)
      update = -tf.cast(alpha, m.dtype) * m / shared_moment.divisor(
          self._estimate(v, w, sparse), optimizer.epsilon)
      weights = shared_moment.decayed(optimizer, variable, tf.convert_to_tensor(variable),
                                      learning_rate)
      targets += [m_slot, v_slot, w_slot, variable]
      values += [m, v, w, weights + update]
    for target, value in zip(targets, values):
      target.assign(value)
    optimizer.iterations.assign_add(1)
    return tf.constant(True)

  def infer_first_moments(self, variables, mean_updates, steps, apply):
    """At a round's end, sets this replica's first moment of each of ``variables`` to
    the one that over ``steps`` of its Adam steps would have moved the weights by the
    replicas' mean pseudo-update (module docstring), at no cost in bytes.

    The step size ``alpha_t`` is that of the round's last step (``iterations`` after
    it). AdamW's weight decay in the pseudo-update is taken as Adam's step (it is
    ``lr * weight_decay`` of the weights a step, orders of magnitude smaller).

    Args:
      variables: the variables the round trained, each trained from the round's anchor
        (``finish`` leaves out a round re-anchored by ``set_weights``).
      mean_updates: per variable, the replicas' mean pseudo-update (weights minus the
        anchor), the same on every replica.
      steps: the round's steps H (a Python int).
      apply: bool scalar tensor; where false (a round not applied) each first moment is
        kept, and so where ``alpha_t`` is 0 (a schedule at its end: nothing to infer).
    """
    optimizer = self.optimizer
    momentums, velocities = shared_moment.moment_slots(optimizer)
    t = tf.cast(optimizer.iterations, tf.int64)
    alpha = shared_moment.step_size(optimizer.learning_rate, t, t, optimizer.beta_1,
                                    optimizer.beta_2)
    apply = tf.logical_and(apply, alpha > 0)
    scale = tf.where(apply, alpha * steps, 1.0)  # never divides by 0
    targets, values = [], []
    for variable, mean_update in zip(variables, mean_updates):
      j = optimizer._get_variable_index(variable)  # pylint: disable=protected-access
      m_slot = momentums[j]
      estimate = self._estimate(
          tf.convert_to_tensor(velocities[j]),
          tf.convert_to_tensor(self.momentum_squares[self.index[id(variable)]]),
          self._sparse.get(id(variable), False))
      inferred = (-mean_update * shared_moment.divisor(estimate, optimizer.epsilon)
                  / tf.cast(scale, mean_update.dtype))
      targets.append(m_slot)
      values.append(tf.where(apply, inferred, tf.convert_to_tensor(m_slot)))
    for target, value in zip(targets, values):
      target.assign(value)
