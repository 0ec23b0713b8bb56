"""CompressedOptimizer: a Keras 3 optimizer wrapper that exchanges compressed gradients
or compressed optimizer updates.

Modelled on Keras' ``LossScaleOptimizer``: a shell that checks its arguments
(``steps.arguments``), creates the variables its exchange mode needs, forwards Keras'
settings to the inner optimizer, and hands each step to one mode of ``tf_adacomp.steps``
(their module docstrings say what each does):

- ``exchange="gradients"``: ``steps.gradients``;
- ``exchange="updates"`` (the default with ``reduction="sum"``): ``steps.updates``; with
  ``local_steps`` > 1, ``steps.local_rounds``; with Adam's shared second moment,
  ``steps.shared_adam``.

Each guarded by ``steps.guard``: a step that is not finite on some replica changes
nothing, on every replica. Per-replica state (residues, the inner optimizer's slots
under the update exchange) is kept per replica, and a checkpoint or ``.keras`` file keeps
every replica's copy beside the mean (``tf_adacomp.replica_state``). It works without a
strategy (compression applied locally, to study its effect on accuracy), under
``MirroredStrategy`` and under ``MultiWorkerMirroredStrategy``.
"""

from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from tf_adacomp import compile_log
from tf_adacomp import distribute
from tf_adacomp import ema
from tf_adacomp import exchange as exchange_lib
from tf_adacomp import hierarchy as hierarchy_lib
from tf_adacomp import local_steps as local_steps_lib
from tf_adacomp import replica_state
from tf_adacomp import replica_steps
from tf_adacomp import wrapper_config
from tf_adacomp import wrapper_stats
from tf_adacomp.compat import keras_multi_worker
from tf_adacomp.compat import loss_scale
from tf_adacomp.compressors import registry
from tf_adacomp.steps import arguments
from tf_adacomp.steps import gradients as gradients_step
from tf_adacomp.steps import guard as guard_lib
from tf_adacomp.steps import inner as inner_lib
from tf_adacomp.steps import local_rounds
from tf_adacomp.steps import shared_adam
from tf_adacomp.steps import updates as updates_step
# Public names of this module (examples and users read them here).
from tf_adacomp.steps.arguments import ADASUM_MODES, ALL_REDUCE_HOOK, DEFAULT_EXCHANGE, EXCHANGES  # noqa: F401  pylint: disable=unused-import
from tf_adacomp.steps.shared_adam import DEFAULT_SECOND_MOMENT, PRECONDITIONS, default_second_moment  # noqa: F401  pylint: disable=unused-import

_BASE_DEFAULTS = arguments.BASE_DEFAULTS


class _InnerSetting:
  """A data descriptor: the base optimizer setting of this name is the inner optimizer's.

  Keras' base class writes and reads these on the wrapper too: its ``__init__`` writes the
  defaults before there is an inner optimizer (ignored: the wrapper refused any other
  value), and its ``build`` reads ``gradient_accumulation_steps`` to create accumulators,
  which only the inner optimizer needs; while ``_reading_own_settings`` is set the
  wrapper's own default is read instead.
  """

  def __set_name__(self, owner, name):
    self.name = name  # pylint: disable=attribute-defined-outside-init

  def __get__(self, wrapper, owner=None):
    if wrapper is None:
      return self
    inner = wrapper.__dict__.get("inner_optimizer")
    if inner is None or wrapper.__dict__.get("_reading_own_settings"):
      return _BASE_DEFAULTS[self.name]
    return getattr(inner, self.name)

  def __set__(self, wrapper, value):
    inner = wrapper.__dict__.get("inner_optimizer")
    if inner is not None:
      setattr(inner, self.name, value)


@keras.saving.register_keras_serializable(package="tf_adacomp")
class CompressedOptimizer(wrapper_stats.ByteCounts, keras.optimizers.Optimizer):
  """Wraps a Keras optimizer so that gradients (or its updates) are exchanged compressed.

  Mixed precision (``mixed_float16``): wrap ``LossScaleOptimizer(CompressedOptimizer(
  inner))``, as ``model.compile`` does under that policy (the other order is refused,
  below). Keras' ``LossScaleOptimizer`` checks only each replica's own gradients, and in
  Keras 3 they are not all-reduced before ``apply``; creating a ``CompressedOptimizer``
  therefore installs ``tf_adacomp.compat.loss_scale.apply_loss_scale_fix``: a loss scale
  optimizer around this wrapper all-reduces its "not finite" flag, so that an overflow
  on any one replica lowers the loss scale on every replica and skips the step
  everywhere (weights, residues, the inner optimizer's slots and ``iterations``
  unchanged, as Keras does for one replica). Loss scale optimizers around other
  optimizers keep Keras' behaviour. (A step finite on every replica whose combined sum
  or update is not, a float32 overflow of the sum, is left to this wrapper as described
  in the module docstring, and does not lower the scale.)

  Args:
    inner_optimizer: the ``keras.optimizers.Optimizer`` that applies the gradients (its
      learning rate, schedule and slots are used as they are).
    compressor: a ``Compressor``, a registered name ("adacomp", "topk", "fp16", ...)
      or a serialized compressor. Default "adacomp".
    start_step: int >= 0; the first ``start_step`` steps exchange dense float32
      gradients (or, with ``exchange="updates"``, each replica's own weight update, whose
      float32 mean every replica applies) as a warm-up before compression begins; fp16
      and bf16 send their float32 values beside their half-precision payloads, and after
      warm-up 8 bytes per step remain of that. Residues stay zero meanwhile.
    name: optional name.
    reduction: "sum" (default) or "adasum": how the replicas' contributions combine
      (with ``exchange="updates"``, "sum" applies the mean of the replicas' updates).
    adasum_mode: the older name of ``exchange`` for ``reduction="adasum"``: "gradient"
      (``exchange="gradients"``) or "delta" (``exchange="updates"``; needs
      ``reduction="adasum"``). Default None: ``exchange`` decides.
    exchange: "gradients" (compress the gradients, apply the inner optimizer to their
      decoded sum) or "updates" (each replica steps the inner optimizer on its own
      gradient with its own state, the weight updates are compressed with error feedback
      and every replica applies their mean; see the module docstring). Default None:
      the one ``adasum_mode`` names, else ``DEFAULT_EXCHANGE[reduction]``: "updates"
      with ``reduction="sum"``, "gradients" with ``"adasum"``. "updates" is the default
      because it reached dense accuracy where the gradient exchange fell behind, with
      SGD+momentum and with Adam (docs/convergence.md): each replica's optimizer state
      sees its own dense gradient instead of sparse, delayed spikes. The payloads have
      the same format either way; how many elements AdaComp sends depends on what it
      compresses (an update usually sends more than a gradient).
    momentum_masking: bool, default False. With ``exchange="updates"``, DGC's momentum
      factor masking: after each step, the inner optimizer's momentum (SGD with
      ``momentum > 0``) or first moment (Adam, AdamW) is set to zero, on each replica,
      wherever that replica's compressor sent an element of its update (its residue did
      not simply absorb it), so that a delayed element does not keep being pushed by a
      stale momentum. Tensors sent whole (dense plans, warm-up steps) are not masked.
    local_clipnorm: None (default) or a float > 0: each replica's own mean gradient (the
      gradient its local optimizer steps on with ``exchange="updates"``; its gradient
      times the replica count) is clipped to this global norm over all variables before
      it enters the residue or the local step, with Keras' arithmetic: scaled by ``c *
      min(1 / norm, 1 / c)``, an Embedding's IndexedSlices counting its slices' squares
      in the norm and coming out dense (its duplicate rows summed). One replica with
      ``local_clipnorm=c`` is the inner optimizer with ``global_clipnorm=c``, bit for
      bit. DGC clips each node's share of a
      summed gradient at ``T / sqrt(N)``; for a threshold ``T`` meant for the averaged
      gradient that is ``local_clipnorm = T * sqrt(N)`` here.
    second_moment: None (default), "local", "shared" or "global"; Adam's second moment
      under the update exchange (``tf_adacomp.shared_moment`` has the algorithm).
      "local": each replica divides its own first moment by its own second moment, and
      the mean of those steps is not Adam's step on the mean gradient (Adam is not
      linear in its gradient). "shared": every replica divides by the same second
      moment, the replicas' mean, averaged (a dense bfloat16 all-reduce, counted in the
      bytes) at steps 1, 2, 4, 8, ...; the step is then linear in the first moment, and
      without compression every replica takes Adam's step on the mean gradient with that
      second moment (1-bit Adam's and 0/1 Adam's observation). Between averages each
      replica's step is clipped to Adam's own bound on a step (the shared moment is
      then older than the replica's, and an element first seen since the last average
      has none); at an average, and at every step with one replica, it is Adam's step
      unclipped. "global": as "shared", with the second moment of the mean gradient
      estimated from the replicas' own (a replica's smaller batch has R times its
      noise); it also keeps a moving average of each replica's squared first moment. An
      Embedding's sparse gradient adds its slices' squares, as Keras' Adam does (clipped
      by ``local_clipnorm`` it is dense, as Keras' ``global_clipnorm`` makes it). The
      wrapper computes Adam's step itself: the inner optimizer must be an Adam or AdamW
      without ``amsgrad``, clipping (use ``local_clipnorm``), EMA, gradient accumulation
      or loss scale factor. None means ``default_second_moment(inner_optimizer, ...)``:
      ``DEFAULT_SECOND_MOMENT`` where it applies, "local" otherwise
      (docs/convergence.md has the measurements). With one replica "shared" and
      "global" are the plain inner optimizer.
    precondition: "before" (default) or "after", with ``second_moment`` "shared" or
      "global": where Adam's division by the shared second moment happens. "before":
      each replica's Adam step is compressed (the residue holds steps). "after": each
      replica's first moment times the step size is compressed, and the decoded mean is
      divided by ``sqrt(v) + epsilon`` on arrival (the same on every replica, so the
      result is the same without compression); the residue then holds momentum, whose
      large elements AdaComp sends first, where Adam's normalised steps are flat.
    second_moment_interval: None (default) or an int >= 1, with ``second_moment``
      "shared" or "global": the longest number of steps between scheduled averages of
      the second moment (steps 1, 2, 4, ... below it, then every
      ``second_moment_interval`` steps). None lets the interval keep doubling.
    local_steps: int >= 1, default 1; with ``exchange="updates"``, the steps of a round
      (``tf_adacomp.local_steps``). Each replica takes ``local_steps`` steps of the inner
      optimizer on its own data from the round's anchor; at the round's last step the
      pseudo-updates (local weights minus anchor) are compressed with error feedback,
      exchanged and combined by ``outer_optimizer``, and every replica adopts the new
      anchor. Only that step sends anything. Within a round the replicas' weights
      differ. With more than 1, an Adam or AdamW keeps each replica's own moments.
    outer_optimizer: None (default: ``local_steps.DEFAULT_OUTER``, "average"),
      "average" (the anchor moves by the mean pseudo-update) or a Keras optimizer that
      steps the anchor on the pseudo-gradient, minus the mean pseudo-update (DiLoCo's:
      ``tf_adacomp.local_steps.diloco()``); its state is checkpointed with the wrapper's.
      With ``local_steps=1`` and "average" the update exchange is as without rounds.
    hierarchical: None (default), True or False: whether the devices of one worker sum
      their gradients (or updates) densely first and send one compressed payload per
      worker over the network (``tf_adacomp.hierarchy``; docs/distributed.md). None:
      hierarchical when a worker has more than one device (a
      ``MultiWorkerMirroredStrategy`` with several local devices, or a
      ``MirroredStrategy`` given ``devices_per_worker`` > 1); False: every replica sends
      its own payload to every other. The worker's error feedback state lives on its
      first device, and ``bytes_sent`` counts what one worker sent.
    devices_per_worker: None (default) or an int >= 1: under a ``MirroredStrategy``, how
      many consecutive devices share a host (replicas ``0..n-1`` are the first host's);
      None is one host. Under ``MultiWorkerMirroredStrategy`` the strategy's own number
      (``len(strategy.extended.worker_devices)``), and another value is refused when
      the optimizer is built. A value restored from a saved config (``load_model``) that
      does not fit where it is restored is replaced, with a warning
      (``tf_adacomp.hierarchy``).

  Raises:
    TypeError: ``inner_optimizer`` is not a Keras optimizer; an unknown keyword argument
      (named with its value and the closest valid name: ``local_step=8`` -> "Did you
      mean 'local_steps'?").
    ValueError: unknown compressor, reduction, adasum_mode or exchange;
      ``adasum_mode="delta"`` without ``reduction="adasum"``; an ``adasum_mode`` that
      contradicts ``exchange``; ``momentum_masking`` not a bool, or True where it cannot
      apply (gradient exchange, an inner optimizer without momentum, a compressor
      without residue); ``local_clipnorm`` not a finite number > 0; ``start_step`` < 0;
      ``second_moment`` not None or one of ``shared_moment.SECOND_MOMENTS``, or "shared"
      or "global" where it cannot apply (another exchange or reduction, momentum
      masking, an inner optimizer that is not an Adam or AdamW or has settings the
      shared step would drop);
      ``second_moment_interval`` not an int >= 1, or set with "local"; ``precondition``
      not "before" or "after", or "after" with "local"; ``local_steps`` not an int
      >= 1; ``outer_optimizer`` not None, "average" or a Keras optimizer (or one with
      clipping, EMA or gradient accumulation, or a ``LossScaleOptimizer``);
      ``local_steps`` > 1 or a Keras ``outer_optimizer`` with the gradient exchange,
      Adasum, ``momentum_masking`` (``local_steps`` > 1) or a shared ``second_moment``;
      ``hierarchical`` not None or a bool; ``devices_per_worker`` not None or an int
      >= 1 (a TypeError if not an int), or one that does not divide the replicas or
      differs from a multi-worker strategy's own (when built; not one restored from a
      saved config);
      a base optimizer argument other than its Keras default (set those on the inner
      optimizer); an ``inner_optimizer`` that is a ``LossScaleOptimizer`` (wrap
      ``LossScaleOptimizer(CompressedOptimizer(inner))`` instead).
    RuntimeError: the inner optimizer has no ``_all_reduce_sum_gradients`` (the Keras
      TensorFlow optimizers' all-reduce, which the wrapper switches off): a Keras
      release that renamed it, or another backend.
  """


  def __init__(self, inner_optimizer, compressor="adacomp", start_step=0, name=None,
               reduction="sum", adasum_mode=None, exchange=None, momentum_masking=False,
               local_clipnorm=None, second_moment=None, second_moment_interval=None,
               precondition="before", local_steps=1, outer_optimizer=None, hierarchical=None,
               devices_per_worker=None, **kwargs):
    settings = arguments.resolve(
        CompressedOptimizer.__init__, inner_optimizer, compressor, start_step, reduction,
        adasum_mode, exchange, momentum_masking, local_clipnorm, second_moment,
        second_moment_interval, precondition, local_steps, outer_optimizer, hierarchical,
        devices_per_worker, kwargs)
    # Keras 3 model.fit needs a fix under multi-worker MultiWorkerMirroredStrategy:
    # applied here and in build(), so that the standard strategy constructor just works.
    keras_multi_worker.apply_keras_multi_worker_fix_for(tf.distribute.get_strategy())
    # A LossScaleOptimizer around this one must see an overflow on any replica, not only
    # on the first (keras' check is per replica): patched once, other optimizers untouched.
    loss_scale.apply_loss_scale_fix()
    super().__init__(learning_rate=0.0, name=name)
    self.inner_optimizer = inner_optimizer
    for field, value in settings._asdict().items():
      setattr(self, field, value)
    self._exchange = exchange_lib.Exchange(self.compressor, self.reduction)
    self._adasum_mode_argument = adasum_mode
    self.hierarchy = None  # set by build(), from the strategy

  # A LossScaleOptimizer around this one decides whether a step is finite over all
  # replicas (compat.loss_scale reads this marker): apply runs a collective, which every
  # replica must reach or skip together.
  agree_on_finite_across_replicas = True

  # Keras' base settings that the inner optimizer applies: read and set on the wrapper,
  # they are the inner optimizer's (tests/test_optimizer_dropin.py).
  weight_decay = _InnerSetting()
  clipnorm = _InnerSetting()
  clipvalue = _InnerSetting()
  global_clipnorm = _InnerSetting()
  gradient_accumulation_steps = _InnerSetting()

  @property
  def adasum_mode(self):
    """"delta" with the update exchange, "gradient" with the gradient exchange."""
    return "delta" if self.exchange == "updates" else "gradient"

  # --- Variables -------------------------------------------------------------------

  def build(self, var_list):
    keras_multi_worker.apply_keras_multi_worker_fix_for(self._distribution_strategy)
    self.hierarchy = hierarchy_lib.resolve(self._distribution_strategy, self.hierarchical,
                                           self.devices_per_worker)
    self.plans = [self.compressor.plan(v.shape, v.dtype, _variable_path(v)) for v in var_list]
    self.residues = [tuple(self._add_replica_variable(v, spec, _variable_name(v, "residue"))
                           for spec in self.compressor.state_specs(plan))
                     for v, plan in zip(var_list, self.plans)]
    self.bytes_sent = self.add_variable(shape=(len(var_list),), dtype="int64",
                                        aggregation="only_first_replica", name="bytes_sent")
    # The first step compiles the kernels (tens of seconds): say so, and how long it took.
    first = int(self.iterations.numpy()) if tf.executing_eagerly() else 0
    # With local steps the kernels first run (and XLA compiles them) at a round's end.
    first_exchange = (first // self.local_steps + 1) * self.local_steps
    self._compile_log = compile_log.FirstCompile(
        "CompressedOptimizer", lambda: int(self.iterations.numpy()) >= first_exchange)
    self._compile_log.start()
    self._scaling_watch = wrapper_stats.watch_scaling(self)
    if self.second_moment in ("shared", "global"):
      # The second moment every replica divides by (equal on all; a checkpoint stores
      # it) and, for "global", each replica's moment of its squared first moment.
      self.shared_velocities = self._add_moment_variables(var_list, "shared_velocity",
                                                          aggregation="only_first_replica")
      # The step the shared moment was last computed at (0: never), for its bias
      # correction; the same on every replica.
      self.moment_synced_at = self.add_variable(
          shape=(), dtype="int64", aggregation="only_first_replica", name="moment_synced_at")
      if self.second_moment == "global":
        self.momentum_squares = self._add_moment_variables(var_list, "momentum_square")
    if self.local_steps > 1:
      # The weights every replica held when the round began (equal on all).
      self.anchors = self._add_moment_variables(var_list, "anchor",
                                                aggregation="only_first_replica")
    if not isinstance(self.outer_optimizer, str):
      # Its state is the same on every replica (it steps the anchor, which is), and it
      # is handed pseudo-gradients that are means already: no all-reduce of its own.
      self.outer_optimizer.build(var_list)
      setattr(self.outer_optimizer, ALL_REDUCE_HOOK, _no_all_reduce)
    if self.exchange == "updates":
      # Each replica steps the inner optimizer with its own state, so its slots hold one
      # value per replica (on-read, as the residues): a checkpoint stores their mean
      # rather than replica 0's copy, and each replica's copy beside it (replica_state).
      with tf.variable_creator_scope(replica_steps.one_value_per_replica):
        self.inner_optimizer.build(var_list)
    else:
      self.inner_optimizer.build(var_list)
    if self.inner_optimizer.use_ema:
      # Its average follows the exchanged weights, not each replica's own (tf_adacomp.ema).
      ema.defer(self.inner_optimizer)
    # Keras' TensorFlow optimizers all-reduce gradients in `apply`. The wrapped one only
    # ever receives gradients already summed over replicas, so that second, dense
    # all-reduce is switched off (an instance attribute: replica threads share it).
    setattr(self.inner_optimizer, ALL_REDUCE_HOOK, _no_all_reduce)
    self._reading_own_settings = True  # no accumulators here: the inner optimizer has them
    try:
      super().build(var_list)
    finally:
      self._reading_own_settings = False
    self._step = self._make_step()
    # A checkpoint keeps each replica's own copy of the per-replica state (residues, the
    # inner optimizer's slots): a resume on as many replicas is the run that was saved.
    # Last, once every variable has its value from a restore under way.
    replica_state.attach(self.variables)

  def _make_step(self):
    """The exchange mode's step (``tf_adacomp.steps``) over this wrapper's state."""
    guard = guard_lib.Guard(self._exchange, self.hierarchy, self.plans, self.residues,
                            self.bytes_sent, self._distribution_strategy,
                            on_traced=self._compile_log.traced)
    inner = inner_lib.KerasInner(self.inner_optimizer, self.local_clipnorm)
    if self.second_moment in ("shared", "global"):
      return shared_adam.SharedMoment(
          guard, inner, self.second_moment, self.precondition, self.second_moment_interval,
          self.local_clipnorm, self.shared_velocities, self.moment_synced_at,
          getattr(self, "momentum_squares", None))
    if self.exchange == "gradients":
      return gradients_step.GradientExchange(guard, inner, self.local_clipnorm)
    if self.local_steps > 1:
      return local_rounds.LocalRounds(guard, inner, self.local_steps, self.anchors,
                                      self._trainable_variables, self.outer_optimizer)
    return updates_step.UpdateExchange(guard, inner, self.momentum_masking,
                                       self.outer_optimizer)

  def _add_moment_variables(self, var_list, suffix, aggregation="mean"):
    """One float variable per variable of ``var_list``, a value per replica, stored as
    the replicas' mean (``_add_replica_variable``); with ``"only_first_replica"``, for a
    value equal on every replica, as the first replica's (a mean of equal float32
    copies is not always the value itself)."""
    return [self._add_replica_variable(v, tf.TensorSpec(v.shape, v.dtype),
                                       _variable_name(v, suffix), aggregation=aggregation)
            for v in var_list]

  def _add_replica_variable(self, reference, spec, name, aggregation=None):
    """A variable with one value per replica (each replica's residue is its own).

    ``on_read`` synchronization keeps a separate copy on every replica. A floating
    state (a residue) has ``sum`` aggregation: a checkpoint stores the sum of the
    replicas' residues (the total not yet sent) and a restore splits it evenly, so
    nothing is lost across a restore, whatever the number of replicas then (onto as
    many replicas, each gets its own back: ``tf_adacomp.replica_state``). An integer
    state (the FFT compressor's step counter) is the same on every replica: a checkpoint
    stores the first replica's and a restore gives it to every replica (summed, a restore
    with fewer replicas would move the theta schedule forward;
    tests/test_optimizer_restore.py). ``aggregation="mean"`` is for a value of each
    replica's own whose mean is what counts (Adam's moment of m^2), and
    ``"only_first_replica"`` for a float equal on every replica (an anchor, the shared
    second moment).
    """
    # A plain tf.Variable (which Keras' optimizers accept too) is its own tf.Variable.
    colocate_with = reference.value if isinstance(reference, keras.Variable) else reference
    if aggregation is None:
      aggregation = "sum" if spec.dtype.is_floating else "only_first_replica"
    with self._distribution_strategy.extended.colocate_vars_with(colocate_with):
      with keras.name_scope(self.name, caller=self):
        variable = keras.Variable(initializer="zeros", shape=spec.shape, dtype=spec.dtype.name,
                                  trainable=False, aggregation=aggregation,
                                  synchronization="on_read", name=name)
    self._track_variable(variable)
    return variable

  def _is_built(self):
    return self.built

  @property
  def variables(self):
    outer = [] if isinstance(self.outer_optimizer, str) else self.outer_optimizer.variables
    return self._variables + self.inner_optimizer.variables + outer

  @property
  def replica_state(self):
    """Each replica's own copy of the per-replica state, as a ``.keras`` file keeps it
    (``tf_adacomp.replica_state.FileCopies``; Keras saves and loads it after
    ``inner_optimizer``, whose entry holds the replicas' means). Empty before ``build``
    and with one replica."""
    return replica_state.FileCopies(self.variables if self.built else [])

  # --- Applying gradients ----------------------------------------------------------

  def apply(self, grads, trainable_variables=None):
    if tf.distribute.in_cross_replica_context():
      raise ValueError("CompressedOptimizer.apply() must be called in a replica context.")
    distribute.warn_once_if_training_alone(self, "CompressedOptimizer")
    if not self.built:
      with keras.name_scope(self.name, caller=self):
        self.build(trainable_variables)
      self.built = True
    if trainable_variables is None:
      trainable_variables = self._trainable_variables
    grads, trainable_variables = list(grads), list(trainable_variables)
    self._check_variables_are_known(trainable_variables)  # Keras' ValueError, before any change
    indices = [self._get_variable_index(v) for v in trainable_variables]
    dense = self.iterations < self.start_step if self.start_step else None
    if not self.inner_optimizer.use_ema:
      self._step(grads, trainable_variables, indices, dense)
      return
    before = tf.convert_to_tensor(self.iterations)
    self._step(grads, trainable_variables, indices, dense)
    # The inner optimizer's EMA of the exchanged weights (tf_adacomp.ema), if this step
    # was taken (`iterations` moved on from `before`).
    ema.update_after_exchange(self.inner_optimizer, tf.not_equal(self.iterations, before),
                              self._step.guard.assign_per_replica)

  # --- Forwarded to the inner optimizer -------------------------------------------

  @property
  def learning_rate(self):
    return self.inner_optimizer.learning_rate

  @learning_rate.setter
  def learning_rate(self, learning_rate):
    self.inner_optimizer.learning_rate = learning_rate

  @property
  def iterations(self):
    return self.inner_optimizer.iterations

  def scale_loss(self, loss):
    return self.inner_optimizer.scale_loss(loss)

  def finalize_variable_values(self, var_list):
    self.inner_optimizer.finalize_variable_values(var_list)

  def exclude_from_weight_decay(self, var_list=None, var_names=None):
    """Excludes variables from the inner optimizer's weight decay (which applies it).

    Args:
      var_list: variables to exclude.
      var_names: strings; a variable whose name contains one of them is excluded.
    """
    self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

  def set_weights(self, weights):
    """Sets all of ``variables``: the wrapper's and the inner optimizer's (its iterations
    and slots), in that order (Keras' own ``set_weights`` sets the wrapper's only).

    Args:
      weights: a list of arrays (or variables), one per entry of ``variables``.

    Raises:
      ValueError: the optimizer is not built, or ``weights`` has another length or a
        shape that differs from its variable's.
    """
    if not self.built:
      raise ValueError("You are calling `set_weights()` on an optimizer that has not yet "
                       "been built: call `optimizer.build(trainable_variables)` first (as "
                       "Keras' optimizers say).")
    variables = self.variables
    if len(weights) != len(variables):
      raise ValueError(f"`set_weights()` got {len(weights)} values for the optimizer's "
                       f"{len(variables)} variables (one per entry of `variables`).")
    for variable, weight in zip(variables, weights):
      if tuple(variable.shape) != tuple(np.shape(weight)):
        raise ValueError(f"Optimizer variable {variable.path} has shape {variable.shape}, "
                         f"not the shape {np.shape(weight)} of the value given for it.")
      variable.assign(weight)

  # --- Statistics and serialization -----------------------------------------------

  def moment_bytes(self):
    """Of ``variable_bytes()``, what the last step's average of Adam's moments sent.

    With the shared second moment (``second_moment="shared"`` or ``"global"``) the
    replicas average their moments, dense bfloat16, at steps 1, 2, 4, 8, ...: those bytes
    are counted in ``variable_bytes()`` beside the compressed exchange's, and
    ``CompressionStats`` keeps them out of the compression ratio.

    Returns:
      Bytes per variable, in ``variable_bytes()``'s order (zeros at a step that averaged
      nothing), or None without a shared second moment.
    """
    return wrapper_stats.moment_bytes(self)

  def check_scaling(self, warn: bool = True) -> Optional[bool]:
    """Whether the all-gather of this exchange has more senders than pays (scaling.py).

    The compact payloads (AdaComp, top-k, FFT) go to every sender: each receives one
    per sender and step, and past ``scaling.crossover_senders`` senders that is more
    bytes than a dense ring all-reduce would move. The senders are the workers with the
    hierarchical exchange, the replicas otherwise; the payload is what the last step
    sent. A thread started by ``build`` calls this once, after the first compressed
    exchange, so that a job past the crossover is told
    (``scaling.AllGatherScalingWarning``) without asking.

    Args:
      warn: a bool; whether a True result also warns.

    Returns:
      True past the crossover, False before it, None when it cannot tell (not built,
      one sender, no compact payload, a warm-up step or a step that sent nothing).
    """
    return wrapper_stats.check_scaling(self, warn)

  def get_config(self):
    return {
        "name": self.name,
        "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
        "compressor": registry.serialize(self.compressor),
        "start_step": self.start_step,
        "reduction": self.reduction,
        "adasum_mode": self._adasum_mode_argument,
        "exchange": self.exchange,
        "momentum_masking": self.momentum_masking,
        "local_clipnorm": self.local_clipnorm,
        "second_moment": self.second_moment,
        "second_moment_interval": self.second_moment_interval,
        "precondition": self.precondition,
        "local_steps": self.local_steps,
        "outer_optimizer": local_steps_lib.serialize_outer(self.outer_optimizer),
        "hierarchical": self.hierarchical,
        "devices_per_worker": self.devices_per_worker,
    }

  @classmethod
  def from_config(cls, config, custom_objects=None):
    """Makes a ``CompressedOptimizer`` from a ``get_config()`` dict.

    Args:
      config: the dict ``get_config`` returns (older ones too); ``inner_optimizer`` a
        serialized Keras optimizer (or an optimizer).
      custom_objects: for Keras' deserialization of the inner and outer optimizers.

    Returns:
      The optimizer.

    Raises:
      TypeError: ``config`` is not a dict.
      ValueError: ``config`` has no ``inner_optimizer``, or its ``inner_optimizer`` or
        ``outer_optimizer`` cannot be deserialized (an unknown class: a custom
        optimizer not registered or not in ``custom_objects``).
    """
    inner, config = wrapper_config.keras3_arguments(config, custom_objects)
    return cls(inner, **config)


def _variable_path(variable):
  """A Keras variable's ``path``; a plain ``tf.Variable`` (no ``path``) its ``name``, as
  Keras' ``add_variable_from_reference`` names the slots of either."""
  return getattr(variable, "path", None) or variable.name


def _variable_name(variable, suffix):
  """The name of ``variable``'s state ``suffix`` ("residue", "anchor", ...)."""
  return _variable_path(variable).replace("/", "_").replace(":", "_") + "_" + suffix


def _no_all_reduce(grads_and_vars):
  return list(grads_and_vars)
