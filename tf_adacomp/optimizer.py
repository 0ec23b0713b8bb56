"""CompressedOptimizer: a Keras 3 optimizer wrapper that exchanges compressed gradients
or compressed optimizer updates.

Modelled on Keras' ``LossScaleOptimizer``. Two exchanges (``exchange=``; the default is
"updates" with ``reduction="sum"`` and "gradients" with ``reduction="adasum"``):

- ``"gradients"``: in each replica it compresses the gradients (residues are optimizer
  variables), exchanges the compact payloads with the strategy's collectives
  (``exchange.Exchange``), decodes and sums them, and hands the sum to the
  inner optimizer with the inner optimizer's own dense all-reduce switched off, so no
  gradient-sized tensor crosses devices. A step whose summed gradient is not finite
  (e.g. float16 overflow) changes nothing: the residues are restored and the inner
  optimizer is not called. An Embedding's ``IndexedSlices`` gradient that the exchange
  would send as it is (``"none"``, or below the compressor's ``min_size``) takes the
  strategy's own all-reduce instead, which joins the replicas' slices as Keras' does: the
  inner optimizer steps on them as Keras' would (Adam adds the slices' squares).
- ``"updates"`` (the local-optimizer exchange; Horovod's Adasum "delta" mode,
  generalised): each replica first takes the inner optimizer's step on its own mean
  gradient (its gradient times the replica count, since Keras divides every replica's
  loss by it) with its own optimizer state (momentum, Adam moments); the updates
  ``delta = weights after - weights before`` are compressed with error feedback,
  exchanged, and every replica sets ``weights = before + mean(decoded deltas)`` (with
  ``reduction="adasum"``: ``before + Adasum(decoded deltas)``). For SGD with momentum
  this is Deep Gradient Compression's momentum correction (Lin et al., ICLR 2018): the
  velocity is accumulated locally and what the residue holds back is velocity, not
  gradient. The payloads have the format of ``"gradients"``; how many elements a
  compressor such as AdaComp selects depends on what it compresses. A step whose own
  gradient is not finite on some replica changes nothing anywhere (one all-reduced
  flag); a combined update that is not finite leaves weights and residues as they
  were, but the inner optimizers' states have taken their step.

  Per-replica optimizer state: the inner optimizer's slots are created ``on_read`` with
  ``mean`` aggregation, so each replica keeps its own copy (as the residues do); reading
  a slot in cross-replica context gives the mean of the replicas' copies. A checkpoint
  and ``model.save`` (``.keras``) keep that mean and, with 2+ replicas, every replica's
  copy besides (``tf_adacomp.replica_state``): a restore onto as many replicas gives
  each its own copy back (across workers too under ``MultiWorkerMirroredStrategy``),
  so a resumed run is the one that was saved; onto another replica count every replica
  gets the mean (a residue an even share of the sum).

Adam and AdamW under the update exchange: each replica's own step is not linear in its
gradient, so by default (``second_moment="global"``) every replica divides its own first
moment by one shared second moment and the wrapper computes Adam's step itself
(``tf_adacomp.shared_moment``); the mean of the replicas' steps is then Adam's step on
the mean gradient.

With ``local_steps=H`` the update exchange runs once per round of H local steps, on the
pseudo-update of the round (DiLoCo, SparseLoCo; ``tf_adacomp.local_steps``).

Options of the update exchange: ``momentum_masking`` (DGC's momentum factor masking) and,
for either exchange, ``local_clipnorm`` (DGC's local gradient clipping). It works without
a strategy (compression is applied locally, to study its effect on accuracy), under
``MirroredStrategy`` and under ``MultiWorkerMirroredStrategy``.

With ``reduction="adasum"`` the replicas' contributions are combined with Adasum
(``ops.adasum_reduce``) instead of averaged: with ``exchange="gradients"`` the Adasum of
the replicas' own mean gradients is handed to the inner optimizer; with
``exchange="updates"`` the Adasum of the decoded deltas is applied (Horovod's
``DistributedOptimizer(op=hvd.Adasum)``). ``adasum_mode`` is the older name of that
choice and stays accepted: ``adasum_mode="delta"`` is ``exchange="updates"``,
``adasum_mode="gradient"`` is ``exchange="gradients"``.
"""

import threading
import time
from typing import Optional
import weakref

import keras
import numpy as np
import tensorflow as tf

from tf_adacomp import _keywords
from tf_adacomp import compile_log
from tf_adacomp import distribute
from tf_adacomp import ema
from tf_adacomp import exchange as exchange_lib
from tf_adacomp import hierarchy as hierarchy_lib
from tf_adacomp import local_steps as local_steps_lib
from tf_adacomp import replica_state
from tf_adacomp import replica_steps
from tf_adacomp import scaling
from tf_adacomp import shared_moment
from tf_adacomp import stats
from tf_adacomp.compat import keras_multi_worker
from tf_adacomp.compat import loss_scale
from tf_adacomp.compressors import base
from tf_adacomp.compressors import registry
from tf_adacomp.ops import checks
from tf_adacomp.ops import fused

# Keras' base optimizer arguments and their defaults (tests/test_optimizer.py checks them
# against Keras' signature). Keras passes the defaults back when deserializing; any other
# value belongs to the inner optimizer.
_BASE_DEFAULTS = {"weight_decay": None, "clipnorm": None, "global_clipnorm": None,
                  "clipvalue": None, "use_ema": False, "ema_momentum": 0.99,
                  "ema_overwrite_frequency": None, "loss_scale_factor": None,
                  "gradient_accumulation_steps": None}
# The private method of Keras' TensorFlow optimizers that all-reduces gradients in
# `apply` (keras/src/backend/tensorflow/optimizer.py; Keras 3.15): replaced on the inner
# optimizer, whose gradients are summed already (and by ResIST's trainer). Guarded by
# tests/test_optimizer.py.
ALL_REDUCE_HOOK = "_all_reduce_sum_gradients"
ADASUM_MODES = ("gradient", "delta")
EXCHANGES = ("gradients", "updates")
# What ``exchange=None`` means, per reduction (docs/convergence.md has the measurements
# behind "updates"; Adasum keeps its documented default, the Adasum of gradients).
DEFAULT_EXCHANGE = {"sum": "updates", "adasum": "gradients"}
# What ``second_moment=None`` means for an Adam or AdamW under the update exchange.
DEFAULT_SECOND_MOMENT = "global"
_EXCHANGE_OF_ADASUM_MODE = {"gradient": "gradients", "delta": "updates"}


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
class CompressedOptimizer(keras.optimizers.Optimizer):
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
    for argument, default in _BASE_DEFAULTS.items():
      value = kwargs.pop(argument, default)
      if (value is None) != (default is None) or value != default:
        raise ValueError(f"CompressedOptimizer does not take `{argument}`: set it on the "
                         f"inner optimizer. Received: {argument}={value!r}")
    # Keras' own base arguments are valid names too (at their defaults, above): a
    # misspelt one is answered with the closest of either.
    _keywords.refuse_unknown_keywords(
        "CompressedOptimizer", kwargs,
        _keywords.keyword_names(CompressedOptimizer.__init__) + tuple(_BASE_DEFAULTS))
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
      raise TypeError(f"`inner_optimizer` must be a keras.optimizers.Optimizer. "
                      f"Received: inner_optimizer={inner_optimizer!r}")
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
      # The wrapper skips a non-finite step before the inner optimizer sees it, so a
      # LossScaleOptimizer inside would never lower its scale (and skip every later
      # overflowing step); around the wrapper it sees every gradient.
      raise ValueError(
          "CompressedOptimizer cannot wrap a LossScaleOptimizer (its loss scale would never "
          "go down): wrap the other way round, LossScaleOptimizer(CompressedOptimizer("
          "inner)), as Keras' mixed precision does for `model.compile`. Received: "
          f"inner_optimizer={inner_optimizer!r}")
    if not hasattr(inner_optimizer, ALL_REDUCE_HOOK):
      # Without it the inner optimizer would all-reduce the already-summed gradient
      # again: replicas x the gradient, and dense traffic besides.
      raise RuntimeError(
          f"CompressedOptimizer switches off the inner optimizer's own all-reduce "
          f"(`{ALL_REDUCE_HOOK}` of Keras' TensorFlow optimizers), which this "
          f"optimizer does not have (Keras {keras.__version__}, backend "
          f"{keras.backend.backend()}). Received: inner_optimizer={inner_optimizer!r}")
    start_step = checks.non_negative_int(start_step, "start_step")
    reduction = exchange_lib.check_reduction(reduction)
    exchange = _resolve_exchange(reduction, adasum_mode, exchange)
    local_clipnorm = _check_local_clipnorm(local_clipnorm)
    compressor = registry.get_compressor(compressor)
    _check_momentum_masking(momentum_masking, exchange, inner_optimizer, compressor)
    local_steps = local_steps_lib.check_local_steps(local_steps)
    outer_optimizer = local_steps_lib.resolve_outer_optimizer(outer_optimizer)
    _check_rounds(local_steps, outer_optimizer, exchange, reduction, momentum_masking)
    if local_steps > 1 and getattr(inner_optimizer, "use_ema", False):
      # Within a round each replica's weights are its own: there is no one average of
      # them to keep, as Keras' EMA would.
      raise ValueError("`local_steps` > 1 does not take an inner optimizer with "
                       "use_ema=True (the replicas' weights differ within a round). "
                       f"Received: local_steps={local_steps!r}, use_ema=True")
    second_moment = _resolve_second_moment(second_moment, exchange, reduction,
                                           inner_optimizer, momentum_masking, local_steps)
    second_moment_interval = _check_second_moment_interval(second_moment_interval,
                                                           second_moment)
    precondition = _check_precondition(precondition, second_moment)
    hierarchical = hierarchy_lib.check_hierarchical(hierarchical)
    devices_per_worker = hierarchy_lib.check_devices_per_worker(devices_per_worker)
    # Keras 3 model.fit needs a fix under multi-worker MultiWorkerMirroredStrategy:
    # applied here and in build(), so that the standard strategy constructor just works.
    keras_multi_worker.apply_keras_multi_worker_fix_for(tf.distribute.get_strategy())
    # A LossScaleOptimizer around this one must see an overflow on any replica, not only
    # on the first (keras' check is per replica): patched once, other optimizers untouched.
    loss_scale.apply_loss_scale_fix()
    super().__init__(learning_rate=0.0, name=name)
    self.inner_optimizer = inner_optimizer
    self.compressor = compressor
    self.start_step = start_step
    self.reduction = reduction
    self._exchange = exchange_lib.Exchange(compressor, reduction)
    self._adasum_mode_argument = adasum_mode
    self.exchange = exchange
    self.momentum_masking = momentum_masking
    self.local_clipnorm = local_clipnorm
    self.second_moment = second_moment
    self.second_moment_interval = second_moment_interval
    self.precondition = precondition
    self.local_steps = local_steps
    self.outer_optimizer = outer_optimizer
    self.hierarchical = hierarchical
    self.devices_per_worker = devices_per_worker
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
    self.residues = []
    for variable, plan in zip(var_list, self.plans):
      name = _variable_path(variable).replace("/", "_").replace(":", "_")
      self.residues.append(tuple(
          self._add_replica_variable(variable, spec, f"{name}_residue")
          for spec in self.compressor.state_specs(plan)))
    self.bytes_sent = self.add_variable(shape=(len(var_list),), dtype="int64",
                                        aggregation="only_first_replica", name="bytes_sent")
    # The first step compiles the kernels (tens of seconds): say so, and how long it took.
    first = int(self.iterations.numpy()) if tf.executing_eagerly() else 0
    # With local steps the kernels first run (and XLA compiles them) at a round's end.
    first_exchange = (first // self.local_steps + 1) * self.local_steps
    self._compile_log = compile_log.FirstCompile(
        "CompressedOptimizer", lambda: int(self.iterations.numpy()) >= first_exchange)
    self._compile_log.start()
    self._scaling_watch = _watch_scaling(self)
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
    # A checkpoint keeps each replica's own copy of the per-replica state (residues, the
    # inner optimizer's slots): a resume on as many replicas is the run that was saved.
    # Last, once every variable has its value from a restore under way.
    replica_state.attach(self.variables)

  def _add_moment_variables(self, var_list, suffix, aggregation="mean"):
    """One float variable per variable of ``var_list``, a value per replica, stored as
    the replicas' mean (``_add_replica_variable``); with ``"only_first_replica"``, for a
    value equal on every replica, as the first replica's (a mean of equal float32
    copies is not always the value itself)."""
    return [self._add_replica_variable(
        v, tf.TensorSpec(v.shape, v.dtype),
        _variable_path(v).replace("/", "_").replace(":", "_") + "_" + suffix,
        aggregation=aggregation) for v in var_list]

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
    plans = [self.plans[i] for i in indices]
    states = [tuple(tf.convert_to_tensor(r.value) for r in self.residues[i]) for i in indices]
    dense = self.iterations < self.start_step if self.start_step else None
    ctx = tf.distribute.get_replica_context()
    replicas = ctx.num_replicas_in_sync

    if self.second_moment in ("shared", "global"):
      self._apply_shared_moment(grads, trainable_variables, indices, plans, states, dense)
      return
    before = tf.convert_to_tensor(self.iterations)
    if self.exchange == "updates":
      self._apply_updates(grads, trainable_variables, indices, plans, states, dense)
      self._update_ema(before)
      return
    # One replica whose exchange sends every gradient as it is: the sum is its own
    # gradient, and the clip waits for the inner step (``_apply_own``), as Keras'
    # global_clipnorm, the documented equivalent, clips inside its own step.
    clip_after = replicas == 1 and all(
        self._exchange.sends_exactly(p) for p, g in zip(plans, grads) if g is not None)
    if self.local_clipnorm is not None and not clip_after:
      # Each replica's own mean gradient is grads * replicas: clip it to local_clipnorm
      # (dense afterwards, as Keras' global_clipnorm makes an IndexedSlices).
      grads = replica_steps.clip_by_global_norm(grads, self.local_clipnorm / replicas)
    # An Embedding's IndexedSlices that the exchange would send whole and exactly go as
    # Keras' own all-reduce sends them (the replicas' slices joined): the inner Adam then
    # adds the slices' squares to its second moment, as Keras does, where the dense sum
    # would give it the square of the summed duplicate rows.
    slices = [k for k, g in enumerate(grads)
              if isinstance(g, tf.IndexedSlices) and self._exchange.sends_exactly(plans[k])]
    rest = [None if k in slices else g for k, g in enumerate(grads)]
    if any(g is not None for g in rest):
      exchanged = self._exchange.replica_exchange(plans, rest, states, dense, self.hierarchy)
    else:  # nothing for the compressed exchange
      exchanged = exchange_lib.Exchanged(rest, list(states), [None] * len(rest))
    # Keras divides each replica's loss by the replica count, so the sum of the gradients
    # is the mean gradient; with Adasum, Adasum(c * g) = c * Adasum(g) makes this the
    # Adasum of the replicas' own mean gradients.
    sums = [None if s is None else self._exchange.reduction.to_sum(s, replicas)
            for s in exchanged.sums]
    nbytes = list(exchanged.nbytes)
    if slices:
      gathered = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [grads[k] for k in slices])
      for k, total in zip(slices, gathered):
        sums[k] = total
        nbytes[k] = _slices_nbytes(grads[k])
    finite = fused.all_finite(sums)
    self._keep_states(indices, states, exchanged.states, finite)
    self._record_bytes(indices, nbytes)
    if clip_after:
      step = lambda summed: self._apply_own(summed, trainable_variables)  # noqa: E731
    else:
      step = lambda summed: self._apply_inner(summed, trainable_variables)  # noqa: E731
    self._on_every_replica_if(finite, step, sums)
    self._update_ema(before)

  def _update_ema(self, before):
    """The inner optimizer's EMA of the exchanged weights (``tf_adacomp.ema``), if it has
    one and this step was taken (``iterations`` moved on from ``before``)."""
    if self.inner_optimizer.use_ema:
      ema.update_after_exchange(self.inner_optimizer, tf.not_equal(self.iterations, before),
                                self._assign_per_replica)

  def _apply_updates(self, grads, variables, indices, plans, states, dense):
    """The update exchange: local optimizer steps, then the mean (``reduction="sum"``)
    or Adasum (``"adasum"``) of the replicas' compressed weight updates; with
    ``local_steps=H`` only every H-th step ends a round and exchanges anything, weights
    set between steps re-anchor the round, and a variable built with but no longer
    trained joins the exchange of a round in which it was stepped
    (``tf_adacomp.local_steps``)."""
    ctx = tf.distribute.get_replica_context()
    replicas = ctx.num_replicas_in_sync
    # This replica's mean gradient. An Embedding's IndexedSlices stay slices: the inner
    # optimizer takes its step on them as Keras does (Adam adds the slices' squares).
    # Clipped to local_clipnorm in the step (``_apply_own``); a clip leaves a gradient
    # that is not finite not finite, so the unclipped one decides.
    own = [_own_gradient(g, replicas) for g in grads]
    if self.local_steps == 1:
      # Every replica must take the same branch: step only if all gradients are finite.
      bad = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                           tf.cast(tf.logical_not(fused.all_finite(own)), tf.float32))
      stepped = tf.equal(bad, 0.0)
      anchors = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
      with tf.control_dependencies(anchors):
        self._on_every_replica_if(
            stepped, lambda local: self._apply_own(local, variables), own)
      # Automatic control dependencies order these reads after the local step.
      self._finish_round(variables, indices, plans, states, anchors,
                         [None if g is None else tf.convert_to_tensor(v) - a
                          for g, v, a in zip(grads, variables, anchors)], dense, stepped)
      return
    # Rounds of local steps. Nothing crosses devices until the round's last step, which
    # decides whether it was finite. "Idle" variables: the optimizer was built with them
    # and this step does not train them (a layer frozen since, or no gradient); one that
    # this replica stepped in this round joins the round's exchange.
    state = local_steps_lib.round_state(self)
    done = tf.cast(self.iterations, tf.int64)  # the steps before this one
    trained = [k for k, g in enumerate(grads) if g is not None]
    stepping, at = [variables[k] for k in trained], [indices[k] for k in trained]
    idle = [i for i in range(len(self.plans)) if i not in set(at)]
    idle_variables = [self._trainable_variables[i] for i in idle]
    anchors, joins = self._start_round(state, done, stepping, at, idle)
    with tf.control_dependencies(anchors + joins):
      self._apply_own(own, variables)
    round_end = local_steps_lib.is_round_end(self.iterations, self.local_steps)
    # What this step left, for the next step to tell a `set_weights` from (at a round's
    # end the exchange sets the weights, and the next round begins anew).
    tf.cond(round_end, lambda: tf.constant(False),
            lambda: local_steps_lib.record_step(state, at, stepping,
                                                tf.cast(self.iterations, tf.int64)))
    self._record_bytes(indices, [None] * len(indices), traced=False)  # unless a round ends

    def finish(own, with_idle):
      own_states, own_anchors, own_joins = own
      # Automatic control dependencies order these reads after the local step.
      deltas = [tf.convert_to_tensor(v) - a for v, a in zip(stepping, own_anchors)]
      if not with_idle:
        return self._finish_round(stepping, at, [plans[k] for k in trained], own_states,
                                  own_anchors, deltas, dense, None)
      # Read here, in each replica: its own copies.
      idle_anchors = [tf.convert_to_tensor(self.anchors[i]) for i in idle]
      return self._finish_round(
          stepping + idle_variables, at + idle,
          [plans[k] for k in trained] + [self.plans[i] for i in idle],
          list(own_states) + [tuple(tf.convert_to_tensor(r.value) for r in self.residues[i])
                              for i in idle],
          list(own_anchors) + idle_anchors,
          deltas + [tf.where(j, tf.convert_to_tensor(v) - a, tf.zeros_like(a))
                    for j, v, a in zip(own_joins, idle_variables, idle_anchors)],
          dense, None, masks=[None] * len(at) + list(own_joins))

    # Each replica's own values go through the arguments: under MirroredStrategy the
    # function runs for every replica from one thread, and a closure would hand every
    # replica the first one's residues. The pseudo-updates are computed in the round's
    # last step only (a pass over the weights).
    values = ([states[k] for k in trained], anchors, joins)
    if not idle:
      self._on_every_replica_if(round_end, lambda own: finish(own, False), values)
      return
    # Whether an idle variable joins is the same on every replica (all take the same steps).
    joined = tf.reduce_any(tf.stack(joins))
    self._on_every_replica_if(tf.logical_and(round_end, tf.logical_not(joined)),
                              lambda own: finish(own, False), values)
    self._on_every_replica_if(tf.logical_and(round_end, joined),
                              lambda own: finish(own, True), values)

  def _start_round(self, state, done, variables, indices, idle):
    """This replica's anchors for ``variables`` (at ``indices``), which the step after
    ``done`` steps trains, and for each ``idle`` variable (built with, not trained by
    this step) whether this replica stepped it in this round, so that it joins the
    round's exchange.

    A variable's anchor is set to its weights where it joins a round: at the round's
    first step, or at the first step of the round that trains it. On this replica it is
    set again where the weights are not what this replica's last local step left
    (``state``'s fingerprints): they were set from outside, and the round goes on from
    them; ``state.moved_at`` records it (``tf_adacomp.local_steps``). Without a record
    of the step before (the first step, a round's first, or after a restore, which set
    ``iterations``) anchors are set at a round's first step only.
    """
    position = tf.math.floormod(done, self.local_steps)
    begun = done - position  # the steps before this round
    known = tf.equal(tf.convert_to_tensor(state.recorded_at), done)
    stepped_at = tf.convert_to_tensor(state.stepped_at)
    prints = tf.convert_to_tensor(state.fingerprints)

    def jumps(weights, at, candidates):
      # Where `candidates`, whether the weights' fingerprints are not the recorded ones
      # (one pass over `weights`, taken only if any is a candidate).
      recorded = tf.gather(prints, at)
      now = tf.cond(tf.reduce_any(candidates),
                    lambda: local_steps_lib.fingerprints(weights), lambda: recorded)
      return tf.logical_and(candidates, tf.not_equal(now, recorded))

    anchors, jumped, joins = [], [], []
    if indices:
      at = tf.constant(indices, tf.int64)
      fresh = tf.where(known, tf.gather(stepped_at, at) <= begun,
                       tf.fill([len(indices)], tf.equal(position, 0)))
      jumped.append(jumps(variables, at, tf.logical_and(known, tf.logical_not(fresh))))
      for k, (i, variable) in enumerate(zip(indices, variables)):
        anchor, weight = self.anchors[i], tf.convert_to_tensor(variable)
        anchors.append(tf.cond(tf.logical_or(fresh[k], jumped[0][k]),
                               lambda a=anchor, w=weight: _assigned(a, w),
                               lambda a=anchor: tf.convert_to_tensor(a)))
    if idle:
      at = tf.constant(idle, tf.int64)
      joining = tf.logical_and(known, tf.gather(stepped_at, at) > begun)
      idle_variables = [self._trainable_variables[i] for i in idle]
      jumped.append(jumps(idle_variables, at, joining))
      for k, (i, variable) in enumerate(zip(idle, idle_variables)):
        anchor = self.anchors[i]
        anchored = tf.cond(jumped[-1][k],
                           lambda a=anchor, v=variable: _assigned(a, tf.convert_to_tensor(v)),
                           lambda a=anchor: tf.zeros(a.shape, a.dtype))
        with tf.control_dependencies([anchored]):
          joins.append(tf.identity(joining[k]))
    everywhere = list(indices) + list(idle)
    moved_at = tf.convert_to_tensor(state.moved_at)
    moved_at = tf.where(known, moved_at, tf.zeros_like(moved_at))  # a new round, or no record
    if everywhere:
      at = tf.constant(everywhere, tf.int64)
      moved_at = tf.tensor_scatter_nd_update(
          moved_at, at[:, None],
          tf.where(tf.concat(jumped, 0), done + 1, tf.gather(moved_at, at)))
    with tf.control_dependencies([state.moved_at.assign(moved_at)]):
      return [tf.identity(a) for a in anchors], joins

  def _finish_round(self, variables, indices, plans, states, anchors, deltas, dense, stepped,
                    masks=None):
    """A round's end: the replicas' pseudo-updates ``deltas`` (local weights minus
    ``anchors``) compressed, exchanged and combined; the outer optimizer (or the mean)
    moves the anchor and every replica adopts it. ``stepped`` is whether every replica
    took its local step (None: decided here, from the pseudo-updates, with local steps;
    then no delta is None).

    With local steps, where a replica re-anchored a variable in the round (its weights
    were set from outside), every replica first takes the latest such anchor and
    measures its pseudo-update from it (``local_steps.adopt_latest_anchors``).
    ``masks``: None, or per variable None (trained by this step) or whether that idle
    variable joins the round (its delta is zero where not): one that joins gets the mean
    without the outer optimizer's step; one that does not keeps its weights and residues.
    """
    ctx = tf.distribute.get_replica_context()
    replicas = ctx.num_replicas_in_sync
    masks = [None] * len(variables) if masks is None else list(masks)
    if stepped is None:
      moved = local_steps_lib.moved_in_round(
          local_steps_lib.round_state(self), indices,
          tf.cast(self.iterations, tf.int64) - self.local_steps)
      # One all-reduce: whether a replica's round went non-finite, and whether one
      # re-anchored a variable.
      flags = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.stack([
          tf.cast(tf.logical_not(fused.all_finite(deltas)), tf.float32),
          tf.reduce_sum(moved)]))
      stepped = tf.equal(flags[0], 0.0)
      re_anchored = flags[1] > 0.0
      anchor_variables = [self.anchors[i] for i in indices]
      self._on_every_replica_if(
          re_anchored,
          lambda own: local_steps_lib.adopt_latest_anchors(anchor_variables, own[0], own[1]),
          (moved, anchors))

      def measured_again():
        # Automatic control dependencies order these reads after the adoption.
        new = [tf.convert_to_tensor(a) for a in anchor_variables]
        return new, [tf.convert_to_tensor(v) - a if m is None
                     else tf.where(m, tf.convert_to_tensor(v) - a, tf.zeros_like(a))
                     for v, a, m in zip(variables, new, masks)]

      anchors, deltas = tf.cond(re_anchored, measured_again,
                                lambda: (list(anchors), list(deltas)))
      # Nothing that is not finite enters a compressor (its residue is kept anyway).
      deltas = [tf.where(stepped, d, tf.zeros_like(d)) for d in deltas]
    exchanged = self._exchange.replica_exchange(plans, deltas, states, dense,
                                                self.hierarchy)
    # The mean of the replicas' updates (or their Adasum).
    combined = [None if s is None else self._exchange.reduction.to_mean(s, replicas)
                for s in exchanged.sums]
    finite = tf.logical_and(stepped, fused.all_finite(combined))
    if all(m is None for m in masks):
      self._keep_states(indices, states, exchanged.states, finite)
    else:
      for k, mask in enumerate(masks):
        self._keep_states([indices[k]], [states[k]], [exchanged.states[k]],
                          finite if mask is None else tf.logical_and(finite, mask))
    self._record_bytes(indices, exchanged.nbytes)
    if self.momentum_masking:
      sent_step = finite if dense is None else tf.logical_and(finite, tf.logical_not(dense))
      self._mask_momentum(variables, states, deltas, exchanged.states, sent_step)
    present = [k for k, c in enumerate(combined) if c is not None]
    # Idle variables take the mean whatever the outer optimizer: they are not trained.
    stepped_outer = ([] if isinstance(self.outer_optimizer, str)  # "average"
                     else [k for k in present if masks[k] is None])
    averaged = [k for k in present if k not in stepped_outer]
    if averaged:
      self._assign_per_replica(
          [variables[k] for k in averaged],
          [fused.add_if(finite, anchors[k], combined[k]) if masks[k] is None
           else tf.where(masks[k], fused.add_if(finite, anchors[k], combined[k]),
                         tf.convert_to_tensor(variables[k])) for k in averaged])
    if stepped_outer:
      self._outer_step([variables[k] for k in stepped_outer],
                       [anchors[k] for k in stepped_outer],
                       [combined[k] for k in stepped_outer], finite)
    if self.local_steps > 1:
      # A skipped round: a replica whose own steps went non-finite keeps going from the
      # anchor with the finite part of its optimizer state.
      slots = [x for x in self.inner_optimizer.variables if tf.as_dtype(x.dtype).is_floating]
      self._assign_per_replica(slots, [
          tf.where(finite, tf.convert_to_tensor(x),
                   local_steps_lib.without_non_finite(tf.convert_to_tensor(x))) for x in slots])
    return tf.constant(True)

  def _outer_step(self, variables, anchors, updates, finite):
    """The outer optimizer's step from the anchors on the pseudo-gradient ``-updates``
    (the same on every replica); a round that is not finite leaves the anchors and the
    outer optimizer's state as they were."""
    outer = self.outer_optimizer
    old_state = [tf.convert_to_tensor(x) for x in outer.variables]
    with tf.control_dependencies(old_state):
      self._assign_per_replica(variables, anchors)
    gradients = [tf.where(finite, -u, tf.zeros_like(u)) for u in updates]
    outer.apply(gradients, variables)
    # Automatic control dependencies order these reads after the outer step.
    self._assign_per_replica(
        list(variables) + list(outer.variables),
        [tf.where(finite, tf.convert_to_tensor(v), a) for v, a in zip(variables, anchors)]
        + [tf.where(finite, tf.convert_to_tensor(x), old)
           for x, old in zip(outer.variables, old_state)])

  def _apply_shared_moment(self, grads, variables, indices, plans, states, dense):
    """The update exchange with Adam's second moment shared by every replica
    (``shared_moment``): local moments, the shared one computed from the replicas' means
    at the sync steps, the replicas' steps compressed and their mean applied. A step
    whose gradient is not finite on some replica, or whose combined step is not, changes
    nothing (weights, moments, residues, ``iterations``)."""
    ctx = tf.distribute.get_replica_context()
    replicas = ctx.num_replicas_in_sync
    inner = self.inner_optimizer
    own = [_own_gradient(g, replicas) for g in grads]
    if self.local_clipnorm is not None:
      # Dense afterwards, as Keras' global_clipnorm makes an IndexedSlices: Adam then
      # adds the square of the clipped, summed rows, as Keras does.
      own = replica_steps.clip_by_global_norm(own, self.local_clipnorm)
    t = tf.cast(inner.iterations, tf.int64) + 1
    learning_rate = inner.learning_rate
    momentums, velocities = shared_moment.moment_slots(inner)
    present = [k for k, g in enumerate(own) if g is not None]
    indices_present = [indices[k] for k in present]
    slots = [inner._get_variable_index(variables[k]) for k in present]  # pylint: disable=protected-access
    # Per variable: the inner optimizer's first and second moments (this replica's),
    # the shared second moment and, for "global", this replica's moment of m^2.
    tracked = {"m": [momentums[j] for j in slots], "v": [velocities[j] for j in slots],
               "shared": [self.shared_velocities[i] for i in indices_present]}
    if self.second_moment == "global":
      tracked["w"] = [self.momentum_squares[i] for i in indices_present]
    old = {key: [tf.convert_to_tensor(x) for x in xs] for key, xs in tracked.items()}
    old_synced_at = tf.convert_to_tensor(self.moment_synced_at)
    # An Embedding's IndexedSlices gradient: Keras' Adam adds its slices' squares to v.
    sparse = [isinstance(own[k], tf.IndexedSlices) for k in present]
    new = {"m": [], "v": [], "w": []}
    for k, m, v, is_sparse in zip(present, old["m"], old["v"], sparse):
      square = shared_moment.sparse_square(own[k]) if is_sparse else None
      m, v = shared_moment.local_moments(m, v, own[k], inner.beta_1, inner.beta_2, square)
      new["m"].append(m)
      new["v"].append(v)
    for m, w in zip(new["m"], old.get("w", [])):
      new["w"].append(shared_moment.local_momentum_square(w, m, t, inner.beta_1, inner.beta_2))
    # Every replica must take the same branches: step only if all gradients are finite.
    bad = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                         tf.cast(tf.logical_not(fused.all_finite(own)), tf.float32))
    stepped = tf.equal(bad, 0.0)
    if replicas == 1:  # the average of one is free: take it every step (plain Adam)
      sync = stepped
    else:
      sync = tf.logical_and(stepped, tf.logical_or(
          shared_moment.is_sync_step(t, self.second_moment_interval),
          tf.equal(old_synced_at, 0)))
    synced_at = tf.where(sync, t, old_synced_at)
    averaged = ["v", "w"] if "w" in tracked else ["v"]

    def average(values):
      # bfloat16 on the wire: float32's range (a second moment spans many decades),
      # 0.4% relative error, about 0.2% on Adam's step. One replica sends nothing.
      wire = tf.bfloat16 if replicas > 1 else values[0].dtype
      means = tf.distribute.get_replica_context().all_reduce(
          tf.distribute.ReduceOp.MEAN, [tf.cast(x, wire) for x in values])
      means = [tf.cast(x, v.dtype) for x, v in zip(means, values)]
      mean = dict(zip(averaged, (means[i * len(present):(i + 1) * len(present)]
                                 for i in range(len(averaged)))))
      # Sparse (slice-squared) moments add up across replicas: theirs is Keras' exactly.
      shared = [v / replicas if is_sparse else
                v if self.second_moment == "shared" else
                shared_moment.global_moment(v, w, replicas, inner.beta_1)
                for v, w, is_sparse in zip(mean["v"], mean.get("w", mean["v"]), sparse)]
      # Each replica's own moments restart from the replicas' mean (which they keep).
      self._assign_per_replica(
          tracked["shared"] + [x for key in averaged for x in tracked[key]],
          shared + [x for key in averaged for x in mean[key]])
      return tf.constant(True)

    with tf.control_dependencies([x for xs in old.values() for x in xs]):
      self._on_every_replica_if(sync, average, [x for key in averaged for x in new[key]])
    # Automatic control dependencies order these reads after the average.
    after = {key: [tf.convert_to_tensor(x) for x in tracked[key]]
             for key in ["shared"] + averaged}
    # The step, or with precondition="after" the step before its division by the shared
    # moment (the same on every replica, so it can follow the exchange).
    deltas = [None] * len(own)
    divisors = {}
    alpha = shared_moment.step_size(learning_rate, t, synced_at, inner.beta_1, inner.beta_2)
    bound = shared_moment.step_bound(alpha, inner.beta_1, inner.beta_2)
    # Each replica's step is bounded only where the shared moment is older than this
    # step: at an average (every step with one replica) it is Adam's step exactly.
    stale = tf.not_equal(synced_at, t)
    for k, m, v in zip(present, new["m"], after["shared"]):
      update = -tf.cast(alpha, m.dtype) * m
      divisors[k] = shared_moment.divisor(v, inner.epsilon)
      if self.precondition == "before":
        update = update / divisors[k]
      # "after" bounds the same quotient before it is sent (update / divisor, so the
      # two are equal without compression): the mean of bounded steps is bounded.
      update = tf.where(stale, shared_moment.clip(
          update, bound if self.precondition == "before" else bound * divisors[k]), update)
      deltas[k] = tf.where(stepped, update, tf.zeros_like(update))
    exchanged = self._exchange.replica_exchange(plans, deltas, states, dense,
                                                self.hierarchy)
    combined = [None if s is None else self._exchange.reduction.to_mean(s, replicas)
                for s in exchanged.sums]
    if self.precondition == "after":  # the same divisor on every replica: exact
      combined = [c if c is None else c / divisors[k] for k, c in enumerate(combined)]
    finite = tf.logical_and(stepped, fused.all_finite(combined))
    self._keep_states(indices, states, exchanged.states, finite)
    # Every byte counts: a sync step also sends the averaged moments, dense bfloat16
    # (with more than one replica: one replica's average sends nothing).
    nbytes = list(exchanged.nbytes)
    for k in present if replicas > 1 else ():
      size = len(averaged) * variables[k].shape.num_elements() * 2
      moment_bytes = tf.where(sync, tf.constant(size, tf.int64), tf.constant(0, tf.int64))
      nbytes[k] = (moment_bytes if nbytes[k] is None
                   else tf.cast(nbytes[k], tf.int64) + moment_bytes)
    self._record_bytes(indices, nbytes)
    targets, values = [], []
    for key in tracked:
      for i, variable in enumerate(tracked[key]):
        if key == "shared":
          value = after[key][i]
        elif key == "m":
          value = new[key][i]
        else:  # the replicas' mean after an average, this replica's own otherwise
          value = tf.where(sync, after[key][i], new[key][i])
        targets.append(variable)
        values.append(tf.where(finite, value, old[key][i]))
    pairs = [(variables[k], fused.add_if(
        finite, shared_moment.decayed(inner, variables[k], tf.convert_to_tensor(variables[k]),
                                      learning_rate),
        combined[k])) for k in present]
    self._assign_per_replica(targets + [v for v, _ in pairs], values + [x for _, x in pairs])
    self.moment_synced_at.assign(tf.where(finite, synced_at, old_synced_at))
    inner.iterations.assign_add(tf.cast(finite, inner.iterations.dtype))

  def _mask_momentum(self, variables, old_states, deltas, new_states, masked_step):
    """DGC's momentum factor masking: zero this replica's momentum where it sent.

    An element counts as sent where the new residue is not the old residue plus this
    step's update (the compressor sent all or part of it). Variables without a residue
    (sent whole every step) are left alone, and so is everything when ``masked_step`` is
    false (a skipped step or a dense warm-up step).
    """
    slots = _first_moment_slots(self.inner_optimizer)
    targets, values = [], []
    for variable, old, delta, new in zip(variables, old_states, deltas, new_states):
      position = None if delta is None else base.residue_position(old, delta.shape)
      if position is None:
        continue
      residue, new_residue = old[position], new[position]
      held = residue + tf.cast(delta, residue.dtype)  # G of the compressor
      sent = tf.logical_and(masked_step, tf.not_equal(held, new_residue))
      slot = slots[self.inner_optimizer._get_variable_index(variable)]  # pylint: disable=protected-access
      value = tf.convert_to_tensor(slot)
      targets.append(slot)
      values.append(tf.where(sent, tf.zeros_like(value), value))
    self._assign_per_replica(targets, values)

  def _keep_states(self, indices, old_states, new_states, finite):
    """Stores the compressor states of a finite step; keeps the old ones otherwise."""
    for i, old, new in zip(indices, old_states, new_states):
      for variable, old_value, new_value in zip(self.residues[i], old, new):
        variable.assign(tf.where(finite, new_value, old_value))

  def _on_every_replica_if(self, flag, fn, values):
    """Calls ``fn(values)`` in every replica if ``flag`` (``replica_steps``)."""
    replica_steps.on_every_replica_if(flag, fn, values)

  def _assign_per_replica(self, variables, values):
    """Sets each replica's copy of each variable to that replica's value (for weights the
    values are equal on all replicas; for the inner optimizer's slots they differ)."""
    replica_steps.assign_per_replica(
        self._distribution_strategy,
        [v.value if isinstance(v, keras.Variable) else v for v in variables], values)

  def _record_bytes(self, indices, nbytes, traced=True):
    values = tf.tensor_scatter_nd_update(
        tf.zeros([len(self.plans)], tf.int64), [[i] for i in indices],
        [tf.zeros([], tf.int64) if b is None else tf.cast(b, tf.int64) for b in nbytes])
    self.bytes_sent.assign(values)
    if traced:  # once per step, after the exchange created its kernels
      self._compile_log.traced()

  def _apply_own(self, grads, trainable_variables):
    """The inner optimizer's step on this replica's own gradient, clipped to
    ``local_clipnorm`` first. The clip is traced beside the step, as Keras'
    ``global_clipnorm`` clips in ``apply``: TensorFlow's graph optimizer (its arithmetic
    optimizer reorders a chain of scalings such as the clip's and SGD's learning rate)
    then rewrites both alike, and one replica is the inner optimizer with
    ``global_clipnorm`` bit for bit."""
    if self.local_clipnorm is not None:
      grads = replica_steps.clip_by_global_norm(grads, self.local_clipnorm)
    return self._apply_inner(grads, trainable_variables)

  def _apply_inner(self, grads, trainable_variables):
    """The inner optimizer's step on ``grads``: summed (or Adasum-combined) over the
    replicas, or with the update exchange this replica's own (each replica steps its own
    copy)."""
    with ema.deferred():  # its EMA follows the exchange (_update_ema)
      self.inner_optimizer.apply(grads, trainable_variables)
    return tf.constant(True)

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

  def variable_bytes(self):
    """``[(plan, bytes one replica sent for that variable in the last step)]``."""
    if not self.built:
      return []
    return list(zip(self.plans, (int(b) for b in self.bytes_sent.numpy())))

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
    if not self.built or self.second_moment not in ("shared", "global"):
      return None
    replicas = self._distribution_strategy.num_replicas_in_sync
    synced = int(self.moment_synced_at.numpy()) == int(self.inner_optimizer.iterations.numpy())
    if replicas == 1 or not synced:
      return [0] * len(self.plans)
    averaged = 2 if self.second_moment == "global" else 1  # v, and m^2 for "global"
    # The step counts averaged * elements * 2 bytes for each variable that had a gradient;
    # one without sent nothing at all, so the smaller of the two is what was sent.
    return [min(int(sent), averaged * plan.shape.num_elements() * 2)
            for plan, sent in zip(self.plans, self.bytes_sent.numpy())]

  def compression_stats(self):
    """Bytes of the last step per variable kind and in total (see ``stats``)."""
    return stats.summarize(self.variable_bytes()) if self.built else {}

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
    if not self.built:
      return None
    senders = (self.hierarchy.workers if self.hierarchy is not None
               else self._distribution_strategy.num_replicas_in_sync)
    gathered = [i for i, plan in enumerate(self.plans) if not plan.summable]
    if senders < 2 or not gathered or int(self.iterations.numpy()) <= self.start_step:
      return None
    # The dense average of Adam's moments at steps 1, 2, 4, ... is an all-reduce, not
    # part of the all-gather: only the compressed payload counts. (Read twice over if a
    # step ended in between: the thread of _watch_scaling reads during training.)
    for _ in range(3):
      step = int(self.iterations.numpy())
      sent = self.bytes_sent.numpy() - np.asarray(self.moment_bytes() or 0, np.int64)
      if int(self.iterations.numpy()) == step:
        break
    payload = int(sum(sent[i] for i in gathered))
    if payload == 0:
      return None
    dense = sum(self.plans[i].dense_nbytes for i in gathered)
    return scaling.check_allgather(senders, payload, dense, warn=warn)

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
    def shown(value):  # configs hold whole optimizers: keep messages readable
      text = repr(value)
      return text if len(text) <= 400 else text[:400] + "..."

    if not isinstance(config, dict):
      raise TypeError("`config` must be a dict, as CompressedOptimizer.get_config() "
                      f"returns. Received: config={shown(config)}")
    if "inner_optimizer" not in config:
      raise ValueError(
          "CompressedOptimizer.from_config needs the key 'inner_optimizer' (the "
          "serialized inner optimizer, as get_config() writes it). Received: "
          f"config={shown(config)}")
    config = dict(config)

    def deserialize(key, value):
      if isinstance(value, keras.optimizers.Optimizer):
        return value  # already an optimizer: nothing to deserialize
      try:
        return keras.saving.deserialize_keras_object(value, custom_objects=custom_objects)
      except (TypeError, ValueError) as error:
        # Keras' message does not say which of the config's optimizers it was.
        raise ValueError(
            f"`{key}` in the config of CompressedOptimizer cannot be deserialized "
            f"({error}). Received: {key}={shown(value)}") from error

    inner = deserialize("inner_optimizer", config.pop("inner_optimizer"))
    if isinstance(config.get("outer_optimizer"), dict):
      config["outer_optimizer"] = deserialize("outer_optimizer", config["outer_optimizer"])
    if "exchange" not in config and config.get("reduction", "sum") == "sum":
      # Saved before `exchange` existed: adasum_mode did nothing with reduction="sum"
      # (the gradient exchange ran), so keep that rather than refuse "delta" now.
      config["adasum_mode"] = None
      config["exchange"] = "gradients"
    # Saved before `second_moment` existed: each replica kept its own.
    config.setdefault("second_moment", "local")
    # The saved machine's layout: where it does not fit, build() falls back (hierarchy.py).
    config["devices_per_worker"] = hierarchy_lib.saved_devices_per_worker(
        config.get("devices_per_worker"))
    return cls(inner, **config)


_SCALING_PAUSE_MAX_S = 30.0


def _watch_scaling(optimizer) -> Optional[threading.Thread]:
  """Starts a daemon thread that calls ``optimizer.check_scaling()`` once it can tell
  (after the first compressed exchange), or None where it never could (one replica)."""
  if optimizer._distribution_strategy.num_replicas_in_sync < 2:  # pylint: disable=protected-access
    return None
  reference = weakref.ref(optimizer)  # the thread must not keep the optimizer alive

  def watch():
    deadline = time.monotonic() + compile_log.GIVE_UP_S
    pause = compile_log.POLL_S
    while time.monotonic() < deadline:
      watched = reference()
      if watched is None:
        return
      try:
        if watched.check_scaling() is not None:
          return
      except Exception:  # pylint: disable=broad-except
        return  # the optimizer's variables are gone (its strategy ended)
      del watched
      time.sleep(pause)
      # Longer and longer pauses: an optimizer built but not yet (or never) stepped
      # costs a wake-up every 30 s at most, not every half second.
      pause = min(2 * pause, _SCALING_PAUSE_MAX_S)

  thread = threading.Thread(target=watch, daemon=True, name="tf_adacomp_scaling_check")
  thread.start()
  return thread


def _assigned(variable, value):
  """Assigns ``value`` to ``variable`` (this replica's copy) and returns ``value``."""
  with tf.control_dependencies([variable.assign(value)]):
    return tf.identity(value)


def _variable_path(variable):
  """A Keras variable's ``path``; a plain ``tf.Variable`` (no ``path``) its ``name``, as
  Keras' ``add_variable_from_reference`` names the slots of either."""
  return getattr(variable, "path", None) or variable.name


def _no_all_reduce(grads_and_vars):
  return list(grads_and_vars)


def _own_gradient(grad, replicas):
  """A replica's own mean gradient from what Keras hands ``apply`` (its loss divided by
  the replica count): ``grad * replicas``, an ``IndexedSlices`` kept as one (its values
  scaled), so that the inner optimizer steps on it as Keras would."""
  if grad is None:
    return None
  if isinstance(grad, tf.IndexedSlices):
    values = grad.values if replicas == 1 else grad.values * replicas
    return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
  return tf.convert_to_tensor(grad) * replicas


def _slices_nbytes(grad: tf.IndexedSlices):
  """The bytes of one replica's ``IndexedSlices`` on the wire: its values and indices."""
  return (tf.cast(tf.size(grad.values), tf.int64) * grad.values.dtype.size
          + tf.cast(tf.size(grad.indices), tf.int64) * grad.indices.dtype.size)


def _resolve_exchange(reduction, adasum_mode, exchange):
  """The exchange that ``exchange`` and the older ``adasum_mode`` ask for, or ValueError."""
  if adasum_mode is not None and adasum_mode not in ADASUM_MODES:
    raise ValueError(f"`adasum_mode` must be one of {ADASUM_MODES} or None. "
                     f"Received: adasum_mode={adasum_mode!r}")
  if exchange is not None and exchange not in EXCHANGES:
    raise ValueError(f"`exchange` must be one of {EXCHANGES} or None. "
                     f"Received: exchange={exchange!r}")
  if adasum_mode == "delta" and reduction != "adasum":
    raise ValueError("`adasum_mode='delta'` is Adasum of the replicas' updates and needs "
                     "reduction='adasum' (for the mean of the updates, pass "
                     "exchange='updates'). Received: adasum_mode='delta', "
                     f"reduction={reduction!r}")
  implied = _EXCHANGE_OF_ADASUM_MODE.get(adasum_mode)
  if implied is not None and exchange is not None and exchange != implied:
    raise ValueError(f"`adasum_mode={adasum_mode!r}` means exchange={implied!r}, which "
                     f"contradicts `exchange`. Received: adasum_mode={adasum_mode!r}, "
                     f"exchange={exchange!r}")
  return exchange or implied or DEFAULT_EXCHANGE[reduction]


def _resolve_second_moment(second_moment, exchange, reduction, inner_optimizer,
                           momentum_masking, local_steps=1):
  """The second moment ``second_moment`` asks for (None: ``default_second_moment``), or
  ValueError where it cannot apply."""
  if second_moment is None:
    return default_second_moment(inner_optimizer, exchange, reduction, momentum_masking,
                                 local_steps)
  if second_moment not in shared_moment.SECOND_MOMENTS:
    raise ValueError(f"`second_moment` must be one of {shared_moment.SECOND_MOMENTS} or "
                     f"None. Received: second_moment={second_moment!r}")
  if second_moment == "local":
    return second_moment
  if exchange != "updates" or reduction != "sum":
    raise ValueError(f"`second_moment={second_moment!r}` shares Adam's second moment in the "
                     "update exchange and needs exchange='updates' and reduction='sum'. "
                     f"Received: exchange={exchange!r}, reduction={reduction!r}")
  if momentum_masking:
    raise ValueError(f"`second_moment={second_moment!r}` does not take "
                     "momentum_masking=True. Received: momentum_masking=True")
  if local_steps > 1:
    raise ValueError(f"`second_moment={second_moment!r}` shares Adam's second moment at "
                     "every step; with local steps each replica keeps its own (DiLoCo's "
                     "inner AdamW): pass second_moment='local' or None. Received: "
                     f"second_moment={second_moment!r}, local_steps={local_steps!r}")
  shared_moment.check_inner(inner_optimizer, second_moment)
  return second_moment


def default_second_moment(inner_optimizer, exchange="updates", reduction="sum",
                          momentum_masking=False, local_steps=1):
  """What ``second_moment=None`` means for this inner optimizer and exchange.

  ``DEFAULT_SECOND_MOMENT`` ("global") for an Adam or AdamW (without amsgrad,
  clipping, EMA, gradient accumulation or a loss scale factor set on it) under the mean
  update exchange: of the three it came closest to Keras' Adam on the character LSTM
  and the transformer (docs/convergence.md). "local" otherwise: other optimizers keep
  their own state, and their second moment, if any, stays each replica's.

  Args:
    inner_optimizer: the optimizer ``CompressedOptimizer`` wraps.
    exchange: "updates" or "gradients".
    reduction: "sum" or "adasum".
    momentum_masking: whether DGC's momentum masking is on.
    local_steps: steps per round; with more than 1 each replica keeps its own.

  Returns:
    "global" or "local".
  """
  if exchange != "updates" or reduction != "sum" or momentum_masking or local_steps > 1:
    return "local"
  try:
    shared_moment.check_inner(inner_optimizer)
  except ValueError:
    return "local"
  return DEFAULT_SECOND_MOMENT


def _check_second_moment_interval(interval, second_moment):
  if interval is None:
    return None
  interval = checks.positive_int(interval, "second_moment_interval")
  if second_moment == "local":
    raise ValueError("`second_moment_interval` is the longest interval between averages "
                     "of the shared second moment and needs second_moment='shared' or "
                     "'global'. "
                     f"Received: second_moment_interval={interval!r}, "
                     f"second_moment={second_moment!r}")
  return interval


PRECONDITIONS = ("before", "after")


def _check_precondition(precondition, second_moment):
  if precondition not in PRECONDITIONS:
    raise ValueError(f"`precondition` must be one of {PRECONDITIONS}. "
                     f"Received: precondition={precondition!r}")
  if precondition == "after" and second_moment == "local":
    raise ValueError("`precondition='after'` divides the exchanged steps by the shared "
                     "second moment and needs second_moment='shared' or 'global'. "
                     f"Received: precondition='after', second_moment={second_moment!r}")
  return precondition


def _check_rounds(local_steps, outer_optimizer, exchange, reduction, momentum_masking):
  """Raises ValueError where ``local_steps`` or ``outer_optimizer`` cannot apply."""
  if local_steps == 1 and isinstance(outer_optimizer, str):
    return  # the update exchange as it is (or the gradient exchange)
  received = f"local_steps={local_steps!r}, outer_optimizer={outer_optimizer!r}"
  if exchange != "updates" or reduction != "sum":
    raise ValueError("`local_steps` > 1 and `outer_optimizer` exchange the replicas' "
                     "pseudo-updates and need exchange='updates' and reduction='sum'. "
                     f"Received: {received}, exchange={exchange!r}, reduction={reduction!r}")
  if momentum_masking and local_steps > 1:
    raise ValueError("`momentum_masking=True` masks every step's momentum and does not "
                     f"take local_steps > 1. Received: {received}, momentum_masking=True")


def _check_local_clipnorm(local_clipnorm):
  return checks.positive_number(local_clipnorm, "local_clipnorm", optional=True)


def _check_momentum_masking(momentum_masking, exchange, inner_optimizer, compressor):
  """Raises ValueError unless ``momentum_masking`` is a bool that can apply here."""
  if not checks.boolean(momentum_masking, "momentum_masking"):
    return
  if exchange != "updates":
    raise ValueError("`momentum_masking=True` masks the local momentum of the update "
                     "exchange and needs exchange='updates'. Received: "
                     f"momentum_masking=True, exchange={exchange!r}")
  if not _has_first_moment(inner_optimizer):
    raise ValueError("`momentum_masking=True` needs an inner optimizer with a momentum or "
                     "first moment: SGD with momentum > 0, Adam or AdamW. Received: "
                     f"momentum_masking=True, inner_optimizer={inner_optimizer!r}")
  probe = compressor.plan([max(compressor.min_size, 4096)], "float32")
  if base.residue_position(compressor.state_specs(probe), probe.shape) is None:
    raise ValueError("`momentum_masking=True` needs a compressor with a residue (error "
                     "feedback): with this one every element is sent every step. "
                     f"Received: momentum_masking=True, compressor={compressor!r}")


def _has_first_moment(optimizer):
  if isinstance(optimizer, keras.optimizers.SGD):
    return float(optimizer.momentum) > 0
  return isinstance(optimizer, keras.optimizers.Adam)  # AdamW is an Adam


def _first_moment_slots(optimizer):
  """The momentum (SGD) or first-moment (Adam, AdamW) variables of a built optimizer,
  in its variable order (``optimizer._get_variable_index``).

  The one place that reads Keras internals for momentum masking: Keras 3 has no public
  accessor. SGD keeps them in ``momentums`` (an undocumented attribute), Adam and AdamW
  in the private ``_momentums`` (keras/src/optimizers/sgd.py and adam.py, Keras 3.15).
  tests/test_optimizer_updates.py::test_keras_momentum_slots_are_where_masking_reads_them
  fails if either moves.
  """
  attribute = "momentums" if isinstance(optimizer, keras.optimizers.SGD) else "_momentums"
  slots = getattr(optimizer, attribute, None)
  if not slots:
    raise RuntimeError(f"{type(optimizer).__name__} has no `{attribute}` variables in Keras "
                       f"{keras.__version__}: momentum masking needs updating for it.")
  return slots
