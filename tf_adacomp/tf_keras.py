"""CompressedOptimizer for tf_keras (Keras 2, ``TF_USE_LEGACY_KERAS=1``).

A ``tf_keras`` model trained with ``model.fit`` under ``MultiWorkerMirroredStrategy`` or
``MirroredStrategy`` (Horovod's use) exchanges compressed payloads when its optimizer is
wrapped, one line::

    import tf_keras  # or tf.keras with TF_USE_LEGACY_KERAS=1
    from tf_adacomp import tf_keras as adacomp

    optimizer = adacomp.CompressedOptimizer(tf_keras.optimizers.SGD(0.1, momentum=0.9))

The wrapper is a shell over the steps of the Keras 3 ``tf_adacomp.CompressedOptimizer``
(``tf_adacomp.steps``: the one guarded step, the gradient and update exchanges), with an
adapter for tf_keras' optimizers (``steps.inner.TfKerasInner``); the payloads cross
devices and workers through ``exchange.Exchange``, with each replica's residue (error
feedback) for what it has not sent yet. The two exchanges (``exchange=``):

- ``"updates"`` (the default for a ``tf_keras.optimizers.Optimizer`` with
  ``reduction="sum"``): each replica
  steps the inner optimizer on its own mean gradient with its own slots (momentum, Adam
  moments: one value per replica, stored in checkpoints as their mean and, for a
  restore onto as many replicas, each replica's copy: see below), and every
  replica sets its weights to the weights before the step plus the mean of the
  replicas' compressed updates. For SGD with momentum this is Deep Gradient
  Compression's momentum correction; without compression it is the plain optimizer's
  step. Each replica's Adam moments are its own (the Keras 3 wrapper's
  ``second_moment="local"``).
- ``"gradients"`` (the default with ``reduction="adasum"``, as in the Keras 3 wrapper,
  and for a legacy optimizer, whose slots this wrapper cannot give one value per
  replica; Horovod's ``DistributedOptimizer``): the gradients are
  compressed and the inner optimizer applies their decoded sum, with its own dense
  all-reduce switched off.

Compressors, Adasum, the dense warm-up (``start_step``), local gradient clipping and the
hierarchical exchange (devices of a worker sum densely first) work as in the Keras 3
wrapper, and a step whose gradients (or combined update) are not finite changes neither
the weights nor the residues.

The residues are the wrapper's variables, one value per replica: a ``tf.train.Checkpoint``
of the model or optimizer (``ModelCheckpoint``, ``BackupAndRestore``,
``model.save_weights``) stores their sum and a restore splits it over the replicas then
present, as in the Keras 3 wrapper. With 2+ replicas a checkpoint, a ``.keras`` and an
``.h5`` file also keep every replica's own copy of each per-replica state (residues,
slots: ``tf_adacomp.replica_state``; in ``.h5``, entries after the variables,
``tf_keras_saving.h5_copies``), which a restore onto as many replicas gives back to
each, so that the resumed run is the one that was saved; onto another number, every
replica gets the slots' mean and an even share of the residues' sum. ``model.save`` to a
``.keras`` or ``.h5`` file keeps
the same state (the residues' sum, the inner optimizer's step counter and slots) and
``tf_keras.models.load_model`` restores it, with or without a strategy scope
(``load_weights`` into a model whose optimizer has not stepped yet keeps the state until
the optimizer is built, at its first step). The SavedModel format
(``model.save(directory)``) is refused while the model holds this optimizer: tf_keras'
loader compiles the model again with a new optimizer and drops the state the SavedModel
holds (for every optimizer, tf_keras' own too), so the residues and the step counter
would be lost without a word; ``include_optimizer=False`` or ``model.export`` saves the
model alone.

Not here (Keras 3 only, ``tf_adacomp.CompressedOptimizer``): the shared Adam moment
(``second_moment="shared"``/``"global"``), ``local_steps``, momentum masking, and mixed
precision (a ``LossScaleOptimizer`` around this wrapper is refused at its first step).
"""

try:
  import tf_keras
except ImportError as error:  # an optional dependency: say how to get it
  raise ImportError(
      "tf_adacomp.tf_keras needs the `tf_keras` package (Keras 2 for TensorFlow 2.16+): "
      "pip install tf_keras, in the version of your TensorFlow (e.g. tf_keras~=2.21.0 "
      "for TensorFlow 2.21).") from error
import tensorflow as tf

from tf_adacomp import _keywords
from tf_adacomp import distribute
from tf_adacomp import exchange as exchange_lib
from tf_adacomp import hierarchy as hierarchy_lib
from tf_adacomp import optimizer as optimizer_lib
from tf_adacomp import replica_state
from tf_adacomp import tf_keras_saving
from tf_adacomp import replica_steps
from tf_adacomp import wrapper_config
from tf_adacomp import wrapper_stats
from tf_adacomp.compat import internals
from tf_adacomp.compressors import registry
from tf_adacomp.ops import checks
from tf_adacomp.steps import gradients as gradients_step
from tf_adacomp.steps import guard as guard_lib
from tf_adacomp.steps import inner as inner_lib
from tf_adacomp.steps import updates as updates_step

# The optimizers this wrapper takes: tf_keras' own (TF 2.11+) and its legacy ones
# (OptimizerV2, which Horovod's DistributedOptimizer required).
INNER_OPTIMIZERS = (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer)
EXCHANGES = ("gradients", "updates")


@tf_keras.saving.register_keras_serializable(package="tf_adacomp")
class CompressedOptimizer(inner_lib.Forwarding, wrapper_stats.ByteCounts,
                          tf_keras_saving.Saving, tf_keras.optimizers.Optimizer):
  """Wraps a tf_keras optimizer so that the replicas exchange compressed updates or
  gradients (see the module docstring).

  Args:
    inner_optimizer: a ``tf_keras.optimizers.Optimizer`` or a
      ``tf_keras.optimizers.legacy.Optimizer``, with its own learning rate, schedule
      and slots.
    compressor: a ``Compressor``, a registered name ("adacomp", "topk", "fp16", "bf16",
      "fft", "none") or a serialized compressor. Default "adacomp".
    start_step: int >= 0; the first ``start_step`` steps exchange dense float32
      gradients before compression begins (residues stay zero meanwhile).
    reduction: "sum" (default) or "adasum": how the replicas' contributions combine
      (Horovod's ``op=hvd.Adasum`` is "adasum"; with ``exchange="updates"``, "sum"
      applies the mean of the replicas' updates).
    exchange: None (default), "updates" or "gradients". None: as the Keras 3 wrapper
      (``tf_adacomp.optimizer.DEFAULT_EXCHANGE``: "updates" with ``reduction="sum"``,
      "gradients" with "adasum") for a ``tf_keras.optimizers.Optimizer``, "gradients"
      for a legacy one (which cannot take "updates").
    local_clipnorm: None (default) or a float > 0: each replica's own mean gradient is
      clipped to this global norm before it enters its residue.
    hierarchical: None (default), True or False, as for ``tf_adacomp.CompressedOptimizer``:
      whether the devices of one worker sum their gradients densely and send one
      compressed payload per worker (None: when a worker has several devices).
    devices_per_worker: None or an int >= 1, as for ``tf_adacomp.CompressedOptimizer``.
    name: the optimizer's name.

  Raises:
    TypeError: ``inner_optimizer`` is not a tf_keras optimizer (a Keras 3 one is named
      with the wrapper to use instead), or is a legacy one with ``exchange="updates"``;
      an unknown keyword argument (named with its value and the closest valid name).
    ValueError: an argument out of its range, named with the value received.
  """

  # The base class's settings are the inner optimizer's, read and written through.
  weight_decay = inner_lib.InnerSetting()
  clipnorm = inner_lib.InnerSetting()
  clipvalue = inner_lib.InnerSetting()
  global_clipnorm = inner_lib.InnerSetting()
  use_ema = inner_lib.InnerSetting()
  ema_momentum = inner_lib.InnerSetting()
  ema_overwrite_frequency = inner_lib.InnerSetting()
  jit_compile = inner_lib.InnerSetting()

  @_keywords.suggest_keywords
  def __init__(self, inner_optimizer, compressor="adacomp", start_step=0, reduction="sum",
               exchange=None, local_clipnorm=None, hierarchical=None,
               devices_per_worker=None, name="CompressedOptimizer"):
    if not isinstance(inner_optimizer, INNER_OPTIMIZERS):
      hint = (" It is a Keras 3 optimizer: wrap it with tf_adacomp.CompressedOptimizer."
              if type(inner_optimizer).__module__.startswith("keras.") else "")
      raise TypeError(f"`inner_optimizer` must be a tf_keras optimizer (tf_keras.optimizers."
                      f"Optimizer or tf_keras.optimizers.legacy.Optimizer).{hint} Received: "
                      f"inner_optimizer={inner_optimizer!r}")
    if isinstance(inner_optimizer, (CompressedOptimizer,
                                    tf_keras.mixed_precision.LossScaleOptimizer)):
      raise TypeError(f"`inner_optimizer` must be a plain tf_keras optimizer, not a "
                      f"{type(inner_optimizer).__name__}. Received: "
                      f"inner_optimizer={inner_optimizer!r}")
    compressor = registry.get_compressor(compressor)
    start_step = checks.non_negative_int(start_step, "start_step")
    reduction = exchange_lib.check_reduction(reduction)
    if exchange is None:
      # The Keras 3 wrapper's default for the reduction (Adasum: of gradients, as
      # Horovod's), where each replica can keep its own slots.
      exchange = (optimizer_lib.DEFAULT_EXCHANGE[reduction]
                  if isinstance(inner_optimizer, tf_keras.optimizers.Optimizer)
                  else "gradients")
    if exchange not in EXCHANGES:
      raise ValueError(f"`exchange` must be one of {EXCHANGES}. Received: exchange={exchange!r}")
    if exchange == "updates" and not isinstance(inner_optimizer, tf_keras.optimizers.Optimizer):
      raise TypeError(
          "`exchange=\"updates\"` needs a tf_keras.optimizers.Optimizer (each replica keeps "
          "its own slots, which a legacy optimizer makes where this wrapper cannot reach): "
          "tf_keras.optimizers.legacy.SGD becomes tf_keras.optimizers.SGD. Received: "
          f"inner_optimizer={inner_optimizer!r}")
    local_clipnorm = checks.positive_number(local_clipnorm, "local_clipnorm", optional=True)
    hierarchical = hierarchy_lib.check_hierarchical(hierarchical)
    devices_per_worker = hierarchy_lib.check_devices_per_worker(devices_per_worker)
    # Not Optimizer.__init__ (as tf_keras' own LossScaleOptimizerV3): it would make an
    # `iterations` of the wrapper's own, a checkpoint dependency that the inner
    # optimizer's files do not have, and write the base settings, which are the inner
    # optimizer's (the `InnerSetting`s above). The rest of what it sets is set here; a canary
    # (tests/compat/test_internals.py) names any attribute a release adds to it.
    self.name = name
    self._variables = self._no_dependency([])
    self._mesh = None
    self._run_with_dtensor = False
    self._distribution_strategy = tf.distribute.get_strategy()
    self.inner_optimizer = inner_optimizer
    self.compressor = compressor
    self.start_step = start_step
    self.reduction = reduction
    self.exchange = exchange
    self.local_clipnorm = local_clipnorm
    self.hierarchical = hierarchical
    self.devices_per_worker = devices_per_worker
    self._exchange = exchange_lib.Exchange(compressor, reduction)
    self._built = False
    # A file's state loaded before `build` (load_weights into a new model), set by it.
    self._pending_state = None

  # --- Variables -------------------------------------------------------------------

  def build(self, var_list):
    """Creates the residues (one value per replica) for ``var_list``; once.

    Args:
      var_list: the model's trainable variables, in the order their gradients come.
    """
    if self._built:
      return
    strategy = tf.distribute.get_strategy()
    self._distribution_strategy = strategy
    self.hierarchy = hierarchy_lib.resolve(strategy, self.hierarchical,
                                           self.devices_per_worker)
    self._index = {_key(v): i for i, v in enumerate(var_list)}
    self.plans = [self.compressor.plan(v.shape, v.dtype, v.name) for v in var_list]
    residues = []
    names = set()
    for variable, plan in zip(var_list, self.plans):
      name = variable.name.split(":")[0].replace("/", "_") + "_residue"
      residues.append(tuple(_replica_variable(strategy, variable, spec, _unique(name, names))
                            for spec in self.compressor.state_specs(plan)))
    self.residues = residues
    with strategy.extended.colocate_vars_with(var_list[0]):
      self.bytes_sent = tf.Variable(
          tf.zeros([len(var_list)], tf.int64), trainable=False, name="bytes_sent",
          synchronization=tf.VariableSynchronization.ON_READ,
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    # Listed for `variables`, not tracked: a checkpoint names them by their attributes.
    self._variables = self._no_dependency(
        [v for state in residues for v in state] + [self.bytes_sent])
    if self.exchange == "updates":
      # Each replica steps the inner optimizer with its own state: its slots hold one
      # value per replica: a checkpoint stores their mean, and each replica's copy beside
      # it (replica_state).
      with tf.variable_creator_scope(replica_steps.one_value_per_replica):
        self.inner_optimizer.build(var_list)
    else:
      # Made now rather than at the inner optimizer's first step, so that a file's list
      # of variables (`.h5`, `.keras`) and a loaded wrapper's, built by the loader, agree.
      _build_inner(self.inner_optimizer, var_list)
    guard = guard_lib.Guard(self._exchange, self.hierarchy, self.plans, self.residues,
                            self.bytes_sent, strategy)
    inner = inner_lib.TfKerasInner(self.inner_optimizer, self.local_clipnorm)
    self._step = self._no_dependency(
        updates_step.UpdateExchange(guard, inner) if self.exchange == "updates"
        else gradients_step.GradientExchange(guard, inner))
    self._built = True
    pending, self._pending_state = self._pending_state, None
    if pending is not None:
      self._assign_state(*pending)
    # A checkpoint keeps each replica's own copy of the per-replica state (residues, the
    # inner optimizer's slots): a resume on as many replicas is the run that was saved.
    # Last, once every variable has its value from a restore under way.
    replica_state.attach(self.variables)

  @property
  def variables(self):
    """The wrapper's variables (residues, ``bytes_sent``), then the inner optimizer's.

    tf_keras' legacy ``.h5`` writer, which stores this list and nothing else of an
    optimizer, gets each replica's copies of the per-replica state after it
    (``tf_keras_saving.Saving``), so that a resume on as many replicas is exact there too.
    """
    inner = self.inner_optimizer.variables
    variables = list(self._variables) + list(inner() if callable(inner) else inner)
    if internals.called_by_tf_keras_h5_writer():
      return variables + tf_keras_saving.h5_copies(variables)
    return variables

  # --- Applying gradients ----------------------------------------------------------

  def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False,
                      **kwargs):
    """Exchanges this replica's updates (or gradients) compressed and applies their
    mean (or sum) on every replica.

    Args:
      grads_and_vars: ``(gradient, variable)`` pairs of this replica (None gradients
        are left out, as tf_keras does).
      name: unused (tf_keras' signature).
      skip_gradients_aggregation: must be False: this wrapper is the aggregation.
      **kwargs: ``experimental_aggregate_gradients`` (the legacy name), must be True.

    Returns:
      The inner optimizer's ``iterations``.

    Raises:
      ValueError: called in a cross-replica context, or with gradients aggregated
        already (by a ``LossScaleOptimizer`` around this wrapper, for instance).
    """
    del name
    aggregate = kwargs.pop("experimental_aggregate_gradients", True)
    if kwargs:
      raise TypeError(f"Unexpected arguments of apply_gradients: {sorted(kwargs)}")
    if skip_gradients_aggregation or not aggregate:
      raise ValueError(
          "tf_adacomp's CompressedOptimizer aggregates the gradients itself (compressed): "
          "it cannot take gradients aggregated already (tf_keras' LossScaleOptimizer "
          "aggregates them first; mixed precision is supported with Keras 3's "
          "tf_adacomp.CompressedOptimizer). Received: skip_gradients_aggregation="
          f"{skip_gradients_aggregation}, experimental_aggregate_gradients={aggregate}")
    if tf.distribute.in_cross_replica_context():
      raise ValueError("CompressedOptimizer.apply_gradients() must be called in a replica "
                       "context (in model.fit, or inside strategy.run).")
    distribute.warn_once_if_training_alone(self, "tf_adacomp.tf_keras.CompressedOptimizer")
    pairs = [(g, v) for g, v in grads_and_vars if g is not None]
    if not pairs:
      raise ValueError("No gradients provided for any variable.")
    # (An Embedding's IndexedSlices are made dense by the exchange: Horovod's
    # sparse_as_dense=True, always.)
    grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
    with tf.init_scope():
      self.build(variables)
    unknown = [v.name for v in variables if _key(v) not in self._index]
    if unknown:
      raise ValueError(f"CompressedOptimizer was built for other variables (its residues "
                       f"are theirs): make a new optimizer for these. Received variables "
                       f"it does not know: {unknown}")
    self._step(grads, variables, [self._index[_key(v)] for v in variables],
               self.iterations < self.start_step if self.start_step else None)
    return self.iterations

  # --- Forwarded to the inner optimizer (and learning_rate, iterations) ------------

  lr = inner_lib.Forwarding.learning_rate

  def finalize_variable_values(self, var_list):
    finalize = getattr(self.inner_optimizer, "finalize_variable_values", None)
    if finalize is not None:
      finalize(var_list)

  # --- Statistics and serialization -----------------------------------------------

  def _is_built(self):
    return self._built

  def get_config(self):
    return {
        "name": self.name,
        "inner_optimizer": tf_keras.optimizers.serialize(self.inner_optimizer),
        "compressor": registry.serialize(self.compressor),
        "start_step": self.start_step,
        "reduction": self.reduction,
        "exchange": self.exchange,
        "local_clipnorm": self.local_clipnorm,
        "hierarchical": self.hierarchical,
        "devices_per_worker": self.devices_per_worker,
    }

  @classmethod
  def from_config(cls, config, custom_objects=None):
    """Makes a ``CompressedOptimizer`` from a ``get_config()`` dict.

    Args:
      config: the dict ``get_config`` returns.
      custom_objects: for tf_keras' deserialization of the inner optimizer.

    Returns:
      The optimizer.

    Raises:
      TypeError: ``config`` is not a dict.
      ValueError: ``config`` has no ``inner_optimizer``, or it cannot be deserialized.
    """
    config = wrapper_config.checked(config)
    inner = config.pop("inner_optimizer")
    if not isinstance(inner, INNER_OPTIMIZERS):
      legacy = "legacy" in str(inner.get("module", "")) if isinstance(inner, dict) else False
      try:
        inner = tf_keras.optimizers.deserialize(inner, custom_objects=custom_objects,
                                                use_legacy_optimizer=legacy)
      except (TypeError, ValueError) as error:
        raise ValueError(f"`inner_optimizer` in the config of CompressedOptimizer cannot "
                         f"be deserialized ({error}). Received: "
                         f"inner_optimizer={wrapper_config.shown(inner)}") from error
    return cls(inner, **config)


def _build_inner(optimizer, var_list):
  """Makes the inner optimizer's variables (step counter, slots) for ``var_list``.

  tf_keras' own ``.h5`` loader builds a legacy optimizer the same way: ``OptimizerV2``
  has no public ``build`` (its private ``_create_all_weights`` is what its
  ``apply_gradients`` calls first)."""
  if isinstance(optimizer, tf_keras.optimizers.Optimizer):
    optimizer.build(var_list)
  else:
    optimizer._create_all_weights(var_list)  # pylint: disable=protected-access


def _unique(name, taken):
  """``name``, or ``name_1``, ``name_2``, ... if taken (then marked taken): tf_keras'
  ``.h5`` file keys the optimizer's variables by name, so two states of one variable
  (the FFT compressor's) or two variables whose paths differ only by "/" and "_" must
  not share one."""
  unique, suffix = name, 0
  while unique in taken:
    suffix += 1
    unique = f"{name}_{suffix}"
  taken.add(unique)
  return unique


def _key(variable):
  """One key per model variable (``model.fit`` hands the optimizer the distributed
  variables themselves, the same objects at every step)."""
  return id(variable)


def _replica_variable(strategy, reference, spec, name):
  """A variable with one value per replica, colocated with ``reference``: a floating
  state (a residue) is stored summed over the replicas and split evenly on restore; an
  integer state (the FFT compressor's counter) is the same on every replica, stored as
  the first replica's."""
  aggregation = (tf.VariableAggregation.SUM if spec.dtype.is_floating
                 else tf.VariableAggregation.ONLY_FIRST_REPLICA)
  with strategy.extended.colocate_vars_with(reference):
    return tf.Variable(tf.zeros(spec.shape, spec.dtype), trainable=False, name=name,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=aggregation)
