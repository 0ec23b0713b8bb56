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
from tf_adacomp import wrapper_config
from tf_adacomp import wrapper_stats
from tf_adacomp.compat import internals
from tf_adacomp.compat import keras_multi_worker
from tf_adacomp.compat import loss_scale
from tf_adacomp.compressors import cast
from tf_adacomp.compressors import registry
from tf_adacomp.steps import arguments
from tf_adacomp.steps import choice as choice_lib
from tf_adacomp.steps import estimated_adam
from tf_adacomp.steps import gradients as gradients_step
from tf_adacomp.steps import guard as guard_lib
from tf_adacomp.steps import inner as inner_lib
from tf_adacomp.steps import local_rounds
from tf_adacomp.steps import shared_adam
from tf_adacomp.steps import updates as updates_step
from tf_adacomp.steps import variables as variables_lib
# Public names of this module (examples and users read them here).
from tf_adacomp.steps.arguments import ADASUM_MODES, ALL_REDUCE_HOOK, DEFAULT_EXCHANGE, EXCHANGES  # noqa: F401  pylint: disable=unused-import
from tf_adacomp.steps.shared_adam import DEFAULT_SECOND_MOMENT, PRECONDITIONS, default_second_moment  # noqa: F401  pylint: disable=unused-import

@keras.saving.register_keras_serializable(package="tf_adacomp")
class CompressedOptimizer(inner_lib.Forwarding, wrapper_stats.Reports,
                          keras.optimizers.Optimizer):
  """Wraps a Keras optimizer so that gradients (or its updates) are exchanged compressed.

  Mixed precision (``mixed_float16``): ``LossScaleOptimizer(CompressedOptimizer(inner))``,
  as ``model.compile`` makes it (the other order is refused). Creating a
  ``CompressedOptimizer`` installs ``compat.loss_scale.apply_loss_scale_fix``: an
  overflow on any one replica lowers the loss scale and skips the step on every replica
  (Keras 3 checks each replica's own gradients only); loss scale optimizers around other
  optimizers keep Keras' behaviour.

  Args:
    inner_optimizer: the ``keras.optimizers.Optimizer`` that applies the gradients (its
      learning rate, schedule and slots are used as they are).
    compressor: a ``Compressor``, a registered name ("adacomp", "topk", "fp16", ...)
      or a serialized compressor. Default "adacomp". Named "adacomp" where an Adam or
      AdamW inside rounds of local steps divides by its estimate (the default there),
      it is AdaComp with bins of ``local_steps.ADAM_ROUND_BIN_SIZE`` (150) on dense and
      recurrent kernels, not 500 (``steps.arguments.compressor_of_rounds``).
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
    exchange: "gradients" (``steps.gradients``: compress the gradients, apply the inner
      optimizer to their decoded sum) or "updates" (``steps.updates``: each replica
      steps the inner optimizer on its own gradient with its own state, and the weight
      updates are compressed with error feedback and their mean applied). Default None:
      the one ``adasum_mode`` names, else ``DEFAULT_EXCHANGE[reduction]``: "updates"
      with ``reduction="sum"`` (it reached dense accuracy where the gradient exchange
      fell behind, with SGD+momentum and with Adam: docs/convergence.md), "gradients"
      with ``"adasum"``.
    momentum_masking: bool, default False. With ``exchange="updates"``, DGC's momentum
      factor masking (``steps.momentum_masking``): each replica's momentum or first
      moment is zeroed wherever its compressor sent an element of its update.
    local_clipnorm: None (default) or a float > 0: each replica's own mean gradient (its
      gradient times the replica count) is clipped to this global norm over all
      variables before it enters the residue or the local step, with Keras' arithmetic
      (``replica_steps.clip_by_global_norm``): one replica with ``local_clipnorm=c`` is
      the inner optimizer with ``global_clipnorm=c``, bit for bit. DGC's threshold ``T``
      for the averaged gradient is ``local_clipnorm = T * sqrt(N)`` here.
    second_moment: None (default), "local", "shared" or "global"; Adam's second moment
      under the update exchange (``steps.shared_adam`` has the details, and what the
      inner optimizer must be: an Adam or AdamW without amsgrad, clipping, EMA, gradient
      accumulation or loss scale factor). "local": each replica's own. "shared": every
      replica divides by one second moment, the replicas' mean, averaged (dense
      bfloat16, counted in the bytes) at steps 1, 2, 4, 8, ...: the mean of the steps is
      then Adam's step on the mean gradient. "global": the second moment of the mean
      gradient, which each replica by default estimates from its own moments at every
      step, nothing averaged (``steps.estimated_adam``; with local steps too, where
      "shared" does not apply), or, given ``second_moment_interval``, as "shared" with
      that estimate made from the replicas' averages. None:
      ``default_second_moment(inner_optimizer, ...)``: ``DEFAULT_SECOND_MOMENT`` where
      it applies, "local" otherwise.
    precondition: "before" (default) or "after", with a shared ``second_moment``: whether
      each replica's Adam step is compressed ("before"), or its first moment times the
      step size, divided by the shared moment on arrival ("after"; equal without
      compression).
    second_moment_interval: None (default), 0, "doubling" or an int >= 1: when the
      replicas average a shared ``second_moment``. 0, with "global": never; each replica
      divides by its own estimate of the global batch's second moment at every step, as
      inside local steps (no moment bytes; docs/convergence.md measures it against the
      averages). "doubling": at steps 1, 2, 4, 8, ... An int: the same up to that
      interval, then every that many steps. None: 0 for "global", "doubling" for
      "shared" and for ``precondition="after"`` (which divides by the averaged moment).
      Configs saved with None and averages keep their averages when loaded.
    local_steps: int >= 1, default 1; with ``exchange="updates"``, the steps of a round
      (``steps.local_rounds``, ``tf_adacomp.local_steps``): each replica takes them on
      its own data from the round's anchor, and only the round's last step exchanges its
      pseudo-update (compressed, with error feedback). With more than 1, an Adam or AdamW
      keeps each replica's own moments (and by default divides by its own estimate of
      the global batch's second moment: ``second_moment``); with that default and
      ``compressor="none"``, "bf16" or "fp16" (compressors that send every element) on
      several replicas, a round's end sets each replica's first moment to the one
      inferred from the mean pseudo-update, sending nothing more
      (``steps.estimated_adam``).
    outer_optimizer: None (default), "average" (the anchor moves by the mean
      pseudo-update), "predictive" (``tf_adacomp.local_steps.Predictive()``: the anchor
      also moves by 0.7 times its last move, which every replica takes out of what it
      sends; error feedback corrects it) or a Keras optimizer that steps the anchor on
      minus the mean pseudo-update (DiLoCo's: ``tf_adacomp.local_steps.diloco()``); its
      state is checkpointed with the wrapper's. None: "predictive" where an Adam or
      AdamW inside rounds of local steps divides by its estimate of the global second
      moment (the default ``second_moment``) and the compressor compresses, else
      "average" (``local_steps.default_outer``; docs/convergence.md).
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
    dense_when_faster: None (default), True, False or "float32". True: the wrapper
      measures, in the training itself, a step with the compressed exchange against a
      step with the dense float32 all-reduce and, where the compressor compresses, one
      with the dense bfloat16 all-reduce (the values cast to bfloat16 for the sum, as
      the ``"bf16"`` compressor), every replica agreeing, and exchanges with the fastest
      (float32 wherever it is within 2% of the fastest;
      ``steps.choice``: probes of 10 exchanges each, the medians of their step times,
      the dense probe skipped where two scouts of a sixteenth of its bytes estimate a
      dense exchange at over 4 compressed steps, or ended after 1 or 2 exchanges where
      dense is clearly slower, and bf16's with them, or where it is clearly slower than
      the faster of the two; the compressed exchange probed once more where bf16 is
      ahead; probed again after 200 exchanges, twice as late each time the same choice
      wins, and late enough that a probe's slower steps cost at most 2% of the time
      between probes; at most 10,000). A dense step is Keras' (the gradients summed, one inner
      step; the replicas' optimizer states averaged at the first after compressed
      ones) and keeps the residues for later; with ``local_steps`` or a shared moment,
      the exchange is chosen, dense, bf16 or compressed. ``exchange_choice()`` says what
      it chose and why. Needs reduction="sum", no ``start_step`` and no
      ``momentum_masking``. "float32": the same, with the float32 all-reduce the only
      dense candidate (nothing rounded where the exchange is not compressed). None:
      True where it applies and ``compressor`` is not "none", else False. False: every
      exchange compressed (a run that must be the same from one run to the next: the
      choice follows measured times).

  Raises:
    TypeError: ``inner_optimizer`` is not a Keras optimizer; an unknown keyword argument
      (named with its value and the closest valid name: ``local_step=8`` -> "Did you
      mean 'local_steps'?"); ``devices_per_worker`` not an int.
    ValueError: an argument out of its range or not one of its values (named with the
      value received); a combination that cannot apply, naming both (each mode's module
      in ``tf_adacomp.steps`` checks its own: ``adasum_mode="delta"`` without Adasum,
      ``momentum_masking`` without a momentum or a residue, a shared ``second_moment``
      with an inner optimizer that is not a plain Adam or AdamW, ``local_steps`` > 1
      with the gradient exchange, Adasum, momentum masking, ``second_moment="shared"``
      or an inner ``use_ema``, ...); ``devices_per_worker`` that does not fit the strategy (when
      built); a base optimizer argument other than its Keras default (set those on the
      inner optimizer); an ``inner_optimizer`` that is a ``LossScaleOptimizer`` (wrap
      ``LossScaleOptimizer(CompressedOptimizer(inner))`` instead).
    RuntimeError: the inner optimizer has no ``_all_reduce_sum_gradients`` (the Keras
      TensorFlow optimizers' all-reduce, which the wrapper switches off): a Keras
      release that renamed it, or another backend.
  """

  def __init__(self, inner_optimizer, compressor="adacomp", start_step=0, name=None,
               reduction="sum", adasum_mode=None, exchange=None, momentum_masking=False,
               local_clipnorm=None, second_moment=None, second_moment_interval=None,
               precondition="before", local_steps=1, outer_optimizer=None, hierarchical=None,
               devices_per_worker=None, dense_when_faster=None, **kwargs):
    settings = arguments.resolve(
        CompressedOptimizer.__init__, inner_optimizer, compressor, start_step, reduction,
        adasum_mode, exchange, momentum_masking, local_clipnorm, second_moment,
        second_moment_interval, precondition, local_steps, outer_optimizer, hierarchical,
        devices_per_worker, dense_when_faster, kwargs)
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
  weight_decay = inner_lib.InnerSetting()
  clipnorm = inner_lib.InnerSetting()
  clipvalue = inner_lib.InnerSetting()
  global_clipnorm = inner_lib.InnerSetting()
  gradient_accumulation_steps = inner_lib.InnerSetting()

  @property
  def adasum_mode(self):
    """"delta" with the update exchange, "gradient" with the gradient exchange."""
    return "delta" if self.exchange == "updates" else "gradient"

  # --- Variables -------------------------------------------------------------------

  def build(self, var_list):
    keras_multi_worker.apply_keras_multi_worker_fix_for(self._distribution_strategy)
    self.hierarchy = hierarchy_lib.resolve(self._distribution_strategy, self.hierarchical,
                                           self.devices_per_worker)
    self.plans = [self.compressor.plan(v.shape, v.dtype, variables_lib.variable_path(v))
                  for v in var_list]
    make = variables_lib.Maker(self)
    self.residues = [tuple(make.one(v, spec, "residue")
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
    if self.estimates_own_moment:
      # Each replica's moment of its squared first moment (steps.estimated_adam).
      self.momentum_squares = make.like(var_list, "momentum_square")
    elif self.second_moment in ("shared", "global"):
      # The second moment every replica divides by (equal on all; a checkpoint stores
      # it) and, for "global", each replica's moment of its squared first moment.
      self.shared_velocities = make.like(var_list, "shared_velocity", "only_first_replica")
      # The step the shared moment was last computed at (0: never), for its bias
      # correction; the same on every replica.
      self.moment_synced_at = self.add_variable(
          shape=(), dtype="int64", aggregation="only_first_replica", name="moment_synced_at")
      if self.second_moment == "global":
        self.momentum_squares = make.like(var_list, "momentum_square")
    if self.local_steps > 1:
      # The weights every replica held when the round began (equal on all).
      self.anchors = make.like(var_list, "anchor", "only_first_replica")
    self._choice = None
    if self.dense_when_faster:
      # bf16 rounds what it sums: a candidate only where the compressor is lossy too.
      self._choice = choice_lib.Choice(
          make, var_list[0], bf16=(self.dense_when_faster is True
                                   and not cast.sends_every_element(self.compressor)))
    if self._choice is not None:
      self.exchange_choice_state = self._choice.checkpointed  # by name in a checkpoint
    inner_lib.build(self.inner_optimizer, var_list, per_replica=self.exchange == "updates",
                    outer_optimizer=self.outer_optimizer)
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
    # With one exchange per step the choice takes the whole step (Keras' dense step where
    # dense); with rounds or a shared moment it takes their exchanges.
    whole_step = (self._choice is not None and self.local_steps == 1
                  and self.second_moment not in ("shared", "global"))
    guard = guard_lib.Guard(self._exchange, self.hierarchy, self.plans, self.residues,
                            self.bytes_sent, self._distribution_strategy,
                            on_traced=self._compile_log.traced,
                            choice=None if whole_step else self._choice)
    inner = inner_lib.KerasInner(self.inner_optimizer, self.local_clipnorm)
    if self.estimates_own_moment:
      inner = estimated_adam.EstimatedGlobalAdam(
          self.inner_optimizer, self.local_clipnorm, self.momentum_squares,
          self._trainable_variables, self._distribution_strategy.num_replicas_in_sync)
    elif self.second_moment in ("shared", "global"):
      return shared_adam.SharedMoment(
          guard, inner, self.second_moment, self.precondition, self.second_moment_interval,
          self.shared_velocities, self.moment_synced_at,
          getattr(self, "momentum_squares", None))
    if self.exchange == "gradients":
      step = gradients_step.GradientExchange(guard, inner)
    elif self.local_steps > 1:
      # Uncompressed or cast to half precision, the mean pseudo-update is what the
      # replicas stepped: their Adam first moments are reconciled from it
      # (steps.estimated_adam). One replica has nothing to reconcile, and keeps Keras'.
      step = local_rounds.LocalRounds(
          guard, inner, self.local_steps, self.anchors, self._trainable_variables,
          self.outer_optimizer,
          infer_first_moments=(self.estimates_own_moment
                               and cast.sends_every_element(self.compressor)
                               and self._distribution_strategy.num_replicas_in_sync > 1))
    else:
      step = updates_step.UpdateExchange(guard, inner, self.momentum_masking,
                                         self.outer_optimizer)
    if whole_step:
      step = choice_lib.ChosenStep(self._choice, guard, inner, step,
                                   per_replica=self.exchange == "updates")
    # The inner optimizer's EMA, if any, follows the exchanged weights (tf_adacomp.ema).
    return ema.AfterExchange(step) if self.inner_optimizer.use_ema else step

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    # A tf.train.Checkpoint matches the wrapper's own variables by their names here
    # (residues/0/0, momentum_squares/1, exchange_choice_state/phase, ...), not by their
    # places in Keras' list: which variables there are depends on the settings, and
    # matched by place a checkpoint written with other settings (or by an earlier
    # release: the shared moment's averages) restored one variable's value into another
    # (or failed on a dtype). A variable the checkpoint lacks keeps its initial value.
    return internals.checkpoint_children_by_name(
        super()._trackable_children(save_type, **kwargs), save_type)

  @property
  def variables(self):
    outer = [] if isinstance(self.outer_optimizer, str) else self.outer_optimizer.variables
    return self._variables + self.inner_optimizer.variables + outer

  @property
  def estimates_own_moment(self):
    """Whether each replica divides by its own estimate of the global batch's second
    moment, nothing averaged (``second_moment="global"`` with ``second_moment_interval=0``,
    the default, or inside local steps; ``steps.estimated_adam``)."""
    return shared_adam.estimates_own_moment(self.second_moment, self.second_moment_interval,
                                            self.local_steps)

  @property
  def replica_state(self):
    """Each replica's own copy of the per-replica state, as a ``.keras`` file keeps it
    (``tf_adacomp.replica_state.FileCopies``; Keras saves and loads it after
    ``inner_optimizer``, whose entry holds the replicas' means). Empty before ``build``
    and with one replica."""
    return replica_state.FileCopies(self.variables if self.built else [])

  def exchange_choice(self):
    """What ``dense_when_faster`` chose, and why.

    Returns:
      None where it is off (``dense_when_faster=False``, ``compressor="none"``, ...) or
      before ``build``; else a dict:
      ``"exchange"`` ("compressed", "dense" or "bf16": what the last exchange was;
      before the first, "compressed", the first probe's), ``"phase"`` ("probing
      compressed", "probing dense", "probing bf16", "confirming compressed" or
      "chosen"), and the replicas'
      median step times in seconds at the last decision, ``"compressed_step_seconds"``,
      ``"dense_step_seconds"`` and ``"bf16_step_seconds"`` (None before the first, and
      bf16's where it was not probed; where a probe stopped early, its last period;
      dense's where the scouts skipped its probe, their estimate), and
      ``"scouted_dense_seconds"``,
      the last scouts' estimate of a dense exchange (None where they could not tell:
      ``steps.choice``).
    """
    if not self.built or self._choice is None:
      return None
    return choice_lib.describe(self._choice)

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
    self._step(grads, trainable_variables, indices, dense)

  # --- Forwarded to the inner optimizer (and learning_rate, iterations) ------------

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
        "dense_when_faster": self.dense_when_faster,
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
