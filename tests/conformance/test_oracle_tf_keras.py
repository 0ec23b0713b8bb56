"""The differential oracle for ``tf_adacomp.tf_keras.CompressedOptimizer(inner, "none")``.

With ``compressor="none"`` the tf_keras wrapper must train a tf_keras model as the plain
tf_keras optimizer does:

- One replica (no strategy): plain tf_keras, bit for bit (the wrapper hands the
  gradient, or with the update exchange its own step, to the same optimizer).
- Two replicas (``MirroredStrategy`` on two logical CPUs, the same global batches):
  plain tf_keras under the same strategy where the wrapper's algorithm is tf_keras' on
  the global batch (the gradient exchange; SGD under the update exchange, linear in the
  gradient); Adam under the update exchange keeps each replica's own moments (the
  module docstring: the Keras 3 wrapper's ``second_moment="local"``), so its reference
  is an eager replay: each replica's own tf_keras Adam on its own shard, the weights
  moved by the mean of the replicas' steps. Within ``oracle.FLOAT`` (rtol 1e-5, atol
  2e-6): the replicas' float32 contributions are summed in another order than tf_keras'
  all-reduce (a few ulp per step, 6 steps), while a term dropped or a sign flipped moves
  weights by 1e-3 or more.
- Save and load mid-run (after 3 of 6 steps): a ``tf.train.Checkpoint`` of model and
  optimizer, and tf_keras' ``.keras`` and ``.h5`` ``model.save`` / ``load_model``, then
  training continued, against the uninterrupted run (a SavedModel, ``model.save(dir)``,
  must be refused with a ValueError naming it: its loader would drop the optimizer's
  state; training then goes on as uninterrupted); a checkpoint
  restored onto the other replica count (1 -> 2, 2 -> 1) against the reference
  continuing there from the checkpoint's state (a replica's own slots are stored as the
  replicas' mean: the replay continues from that mean).

Configurations: pairwise over the axes below (``--full``); the fast tier runs the rows in
``FAST_ROWS``.
"""

import dataclasses
import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import oracle
from tf_adacomp import tf_keras as adacomp_tf_keras

AXES = {
    "exchange": ("updates", "gradients"),
    "inner": ("sgd", "adam"),
    "replicas": (1, 2),
    "event": ("none", "checkpoint", "checkpoint_other", "keras", "h5", "savedmodel"),
}
# The fast tier: the first row (one replica, the update exchange) and the third (two
# replicas, the gradient exchange, a checkpoint restored onto one). The second (Adam's own
# moments on each of two replicas, a checkpoint) with --full: two replicas' own Adam
# moments, saved and resumed, are tests/test_replica_state.py's
# test_a_tf_keras_resume_on_as_many_replicas_is_the_uninterrupted_run[keras] in the fast tier.
FAST_ROWS = (0, 2)
OTHER = {1: 2, 2: 1}


@dataclasses.dataclass(frozen=True)
class TfKerasConfig:
  exchange: str = "updates"
  inner: str = "sgd"
  replicas: int = 1
  event: str = "none"
  steps: int = oracle.STEPS
  tf_keras: bool = True  # for oracle.KNOWN_DEFECTS' predicates

  @property
  def id(self):
    return f"{self.exchange},{self.inner},replicas={self.replicas},event={self.event}"

  @property
  def counts(self):
    return (self.replicas, OTHER[self.replicas]) if self.event == "checkpoint_other" else (
        self.replicas,)


CONFIGS = [TfKerasConfig(**row) for row in oracle.pairwise(AXES)]
# Beside the array (--full): oracle defect E's configuration (fixed: an .h5 file keeps
# each replica's own Adam moments), the one where each replica's state differs.
CONFIGS += [TfKerasConfig(exchange="updates", inner="adam", replicas=2, event="h5")]


def _strategy(replicas):
  if replicas == 1:
    return tf.distribute.get_strategy()
  return tf.distribute.MirroredStrategy(oracle.DEVICES[:replicas])


def _model():
  tf_keras.utils.set_random_seed(1)
  return tf_keras.Sequential([tf_keras.Input([oracle.FEATURES]),
                              tf_keras.layers.Dense(oracle.OUTPUTS)])


def _inner(c):
  if c.inner == "sgd":
    return tf_keras.optimizers.SGD(oracle.SGD_LR, momentum=oracle.MOMENTUM)
  return tf_keras.optimizers.Adam(oracle.ADAM_LR)


def _optimizer(c, wrapped):
  inner = _inner(c)
  return (adacomp_tf_keras.CompressedOptimizer(inner, "none", exchange=c.exchange)
          if wrapped else inner)


def _compiled(c, wrapped, strategy):
  with strategy.scope():
    model = _model()
    model.compile(optimizer=_optimizer(c, wrapped), loss="mse")
  return model


def _fit(model, x, y, first, last):
  rows = slice(first * oracle.GLOBAL_BATCH, last * oracle.GLOBAL_BATCH)
  model.fit(x[rows], y[rows], batch_size=oracle.GLOBAL_BATCH, epochs=1, shuffle=False,
            verbose=0)


def _copies(variable, strategy):
  if isinstance(strategy, tf.distribute.MirroredStrategy):
    return [np.asarray(v) for v in strategy.experimental_local_results(variable)]
  return [variable.numpy()]


def _custom_objects():
  return {"CompressedOptimizer": adacomp_tf_keras.CompressedOptimizer}


def train(c, wrapped, directory):
  """``model.fit`` for ``c.steps`` steps, ``c.event`` after step 3."""
  os.makedirs(directory, exist_ok=True)
  x, y = oracle.data("dense", c.steps)
  strategy = _strategy(c.replicas)
  model = _compiled(c, wrapped, strategy)
  start = model.get_weights()
  cut = 3
  _fit(model, x, y, 0, cut)
  if c.event in ("checkpoint", "checkpoint_other"):
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        os.path.join(directory, "ckpt"))
    if c.event == "checkpoint_other":
      strategy = _strategy(OTHER[c.replicas])
    model = _compiled(c, wrapped, strategy)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(path).expect_partial()
  elif c.event == "savedmodel" and wrapped:
    # Refused (tf_adacomp.tf_keras): its loader would drop the optimizer's state. The
    # refusal changes nothing: training goes on as uninterrupted.
    with pytest.raises(ValueError, match="SavedModel"):
      model.save(os.path.join(directory, "saved_model"))
  elif c.event in ("keras", "h5"):
    path = os.path.join(directory, {"keras": "model.keras", "h5": "model.h5"}[c.event])
    model.save(path)
    with strategy.scope():
      model = tf_keras.models.load_model(path, custom_objects=_custom_objects())
  _fit(model, x, y, cut, c.steps)
  return oracle.Run(start, [_copies(v, strategy) for v in model.weights],
                    int(model.optimizer.iterations.numpy()))


def replay(c, start):
  """Each replica's own tf_keras optimizer (eager, no strategy) on its own shard; the
  weights moved by the mean of the replicas' steps (the update exchange)."""
  x, y = oracle.data("dense", c.steps)
  weights = [w.copy() for w in start]
  replicas = c.replicas
  models = optimizers = None

  def replicas_from(weights, slots=None):
    nonlocal models, optimizers
    models, optimizers = [], []
    for _ in range(replicas):
      model = _model()
      model.set_weights(weights)
      optimizer = _inner(c)
      optimizer.build(model.trainable_variables)
      if slots is not None:
        for variable, value in zip(optimizer.variables(), slots):
          variable.assign(value)
      models.append(model)
      optimizers.append(optimizer)

  replicas_from(weights)
  for step in range(c.steps):
    if step == 3 and c.event == "checkpoint_other":  # restored as the replicas' mean
      slots = [np.mean([o.variables()[j].numpy() for o in optimizers], axis=0)
               for j in range(len(optimizers[0].variables()))]
      replicas = OTHER[c.replicas]
      replicas_from(weights, slots)
    rows = slice(step * oracle.GLOBAL_BATCH, (step + 1) * oracle.GLOBAL_BATCH)
    per = oracle.GLOBAL_BATCH // replicas
    xs, ys = x[rows], y[rows]
    for r, (model, optimizer) in enumerate(zip(models, optimizers)):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf_keras.losses.mean_squared_error(
            ys[r * per:(r + 1) * per], model(xs[r * per:(r + 1) * per], training=True)))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
    mean = [np.mean([m.get_weights()[k] - w for m in models], axis=0).astype(np.float32)
            for k, w in enumerate(weights)]
    weights = [w + d for w, d in zip(weights, mean)]
    for model in models:
      model.set_weights(weights)
  return oracle.Run([s.copy() for s in start], [[w] * replicas for w in weights],
                    int(optimizers[0].iterations.numpy()))


def _plain(c, directory):
  """``train(c, False, directory)`` once per process for each run it is
  (``oracle.computed_once``): the exchange is the wrapper's alone, and the SavedModel
  event only refuses the wrapper's save (the plain run goes on uninterrupted, as with
  no event)."""
  key = dataclasses.replace(c, exchange="updates",
                            event="none" if c.event == "savedmodel" else c.event)
  return oracle.computed_once(("tf_keras", key), lambda: train(c, False, directory))


def _linear(c):
  return c.exchange == "gradients" or c.inner == "sgd"


@pytest.mark.parametrize("config", [
    pytest.param(c, id=c.id, marks=oracle.marks(c) + (
        [] if i in FAST_ROWS else [pytest.mark.slow])) for i, c in enumerate(CONFIGS)])
def test_trains_as_plain_tf_keras(config, tmp_path):
  ours = train(config, True, str(tmp_path / "ours"))
  if max(config.counts) == 1 or _linear(config):
    reference = _plain(config, str(tmp_path / "reference"))
  else:
    reference = replay(config, ours.start)
  how = oracle.EXACT if max(config.counts) == 1 else oracle.FLOAT
  oracle.compare(config, ours, reference, how=how)
