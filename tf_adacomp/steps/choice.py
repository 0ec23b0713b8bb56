"""The measured choice between the compressed exchange, the dense float32 all-reduce and
the dense bfloat16 one (``CompressedOptimizer(dense_when_faster=True)``).

Where links are fast, compressing costs more than it saves: on one host, or over 1
Gbit/s with a small model, the compressed step is slower than Keras' dense step
(docs/performance.md). Which one is faster depends on the model, the link and the
devices, so the wrapper measures it on the cluster it runs on, in the training itself:

1. **Probe compressed**: ``SETTLE + PROBE`` exchanges compressed. Each exchange takes the
   time when its values are ready (``tf.timestamp``); the time from one exchange to the
   next is a *period*: the exchange, the apply, the next step's compute and whatever
   Keras does in between, all that a step costs. The first ``SETTLE`` periods of a
   phase (XLA compilation, a collective's set-up) are not counted.
   During the settling exchanges the probe also *scouts* the link: once the values are
   ready, before they are exchanged (the link is idle then: the last exchange is
   over), a scalar all-reduce (the link's latency) and one of zeros of
   ``1 / SCOUT_FRACTION`` of a dense exchange's bytes, both timed. From them, the dense
   exchange's time is estimated (latency + ``SCOUT_FRACTION`` times the zeros' transfer);
   where that alone exceeds ``EARLY_FACTORS[1]`` times the compressed median, the dense
   probe is skipped: on a slow link a dense step costs as much as tens of compressed
   ones, and each scout a sixteenth of one. The lower of the probe's estimates is kept
   (a delay only ever adds), and a transfer shorter than ``SCOUT_MIN_SECONDS`` or than
   twice the latency estimates nothing: it is the link's jitter, or a burst its buffer
   let through at once, more than its bandwidth.
2. **Probe dense**: the same with the dense all-reduce (the values summed in their own
   dtype, one all-reduce per dtype; the residues are kept for later, so nothing is
   lost). The probe stops early where dense already loses clearly: its first period
   more than ``EARLY_FACTORS[1]`` times the compressed median (a slow link: one dense
   step is all it costs), or its second, past the one-off costs of the first, more than
   ``EARLY_FACTORS[2]`` times.
3. **Probe bf16** (where it is a candidate: the compressor compresses, and the user did
   not ask for float32 alone) after a whole dense probe: the same with the values cast
   to bfloat16 for the all-reduce (half dense's bytes; rounded, nothing held back, as
   the ``"bf16"`` compressor). Where dense's probe ended early or was skipped, so is
   bf16's: its step is at least half of dense's (the same compute, half the transfer),
   more than the compressed step. It ends early as dense's does, measured against the
   faster of the two probed before. Where bf16 comes out ahead, the compressed exchange
   and then the dense one are probed once more (**confirming**, no scouts, no early
   end) before the decision: probed before bf16's, their periods were among the run's
   first or came right after the last choice's, and those are longer; probed again,
   they follow bf16's, and a near tie goes against bf16.
4. **Decide**: the medians (robust to an evaluation or a checkpoint between two steps)
   averaged over the replicas in one all-reduce, so that every replica decides the
   same. A lossy exchange (compressed or bf16, the faster of the two; bf16 on a tie)
   is kept only where its median is below ``1 - MARGIN`` times dense's: near a tie the
   exact exchange wins.
5. **Run** the choice for ``recheck`` exchanges (``RECHECK`` at first, doubled each time
   the same choice wins again, up to ``RECHECK_MAX``; and long enough that the next
   probes' steps of the slower exchanges cost at most ``PROBE_SHARE`` of the time until
   then: on a slow link one dense step is worth many compressed ones), then probe
   again: costs drift (another job on the link, a bigger batch late in training).

The schedule counts exchanges (with local steps, a round's end), and every replica
takes the same branches: the phase and the count are the same on all, and the one value
that is not (the times) is averaged before anything depends on it.

Where the optimizer exchanges every step, the choice takes the whole step
(``ChosenStep``): a dense step is Keras' own, the gradients' all-reduce and one inner
step (bf16: the gradients cast for the all-reduce). With rounds of local steps or a
shared moment it takes the exchange (``Choice.exchange``, through ``steps.guard.Guard``):
the same values, summed dense (or cast to bfloat16 and summed).
"""

import tensorflow as tf

from tf_adacomp import replica_steps
from tf_adacomp.compressors import base
from tf_adacomp.exchange import engine as engine_lib
from tf_adacomp.exchange.wire import Exchanged
from tf_adacomp.ops import fused

SETTLE = 2  # periods of a phase not counted (compilation, a collective's set-up)
PROBE = 8  # periods counted per probe
# Dense's first and second periods, this many times the compressed median, end its probe
# (the first carries one-off costs: the dense branch's first run, a collective's set-up).
EARLY_FACTORS = {1: 4.0, 2: 2.0}
MARGIN = 0.02  # compressed must be this much faster than dense to be kept
SCOUT_FRACTION = 16  # a scout sends this fraction of a dense exchange's bytes
# A scout's transfer shorter than this (or than twice the latency) is the link's jitter
# more than its bandwidth: no estimate, and the dense probe runs.
SCOUT_MIN_SECONDS = 0.005
RECHECK = 200  # exchanges between probes, at first
RECHECK_MAX = 10_000
PROBE_SHARE = 0.02  # the most a probe's extra time may be of the time between probes

# Phases (the variable ``phase``; bf16's came later, and their numbers with them).
PROBING_COMPRESSED, PROBING_DENSE, CHOSEN = 0, 1, 2
PROBING_BF16, CONFIRMING_COMPRESSED, CONFIRMING_DENSE = 3, 4, 5
# ``chosen``: what the last decision chose (NONE, the variables' zeros, before any).
NONE, COMPRESSED, DENSE, BF16 = 0, 1, 2, 3
# An exchange's kind (what the schedule returns, and the branch the step takes).
KIND_COMPRESSED, KIND_DENSE, KIND_BF16 = 0, 1, 2
KIND_NAMES = ("compressed", "dense", "bf16")


class Choice:
  """The state and the schedule of the measured choice, one per optimizer wrapper.

  Args:
    make: ``steps.variables.Maker`` of the wrapper (its variables, one value per
      replica: the times are each replica's own, the schedule is equal on all).
    reference: a variable of the wrapper's (the new ones are named after it and placed
      beside it).
    bf16: whether the dense bfloat16 all-reduce is a candidate (its probe runs).
  """

  def __init__(self, make, reference, bf16=False):
    self.bf16 = bf16
    # The saved ones by name, for the wrapper's checkpoint (its ``_trackable_children``).
    self.checkpointed = tf.__internal__.tracking.AutoTrackable()

    def one(suffix, shape, dtype, aggregation, saved=True):
      variable = make.one(reference, tf.TensorSpec(shape, dtype),
                          f"exchange_choice_{suffix}", aggregation=aggregation, saved=saved)
      if saved:
        setattr(self.checkpointed, suffix, variable)
      return variable

    self.phase = one("phase", [], tf.int64, "only_first_replica")
    self.count = one("count", [], tf.int64, "only_first_replica")
    self.chosen = one("chosen", [], tf.int64, "only_first_replica")
    self.recheck = one("recheck", [], tf.int64, "only_first_replica")
    # Seconds: each probe's counted periods ([compressed, dense]) on this replica, the
    # replicas' medians of the last decision ([compressed, dense]; 0: not measured),
    # and when this replica's last exchange began (0: none yet). That time is not saved:
    # restored, the first period would span the gap between the save and the restore.
    self.periods = one("periods", [2, PROBE], tf.float64, "mean")
    self.medians = one("medians", [2], tf.float64, "mean")
    self.last_time = one("last_time", [], tf.float64, "mean", saved=False)
    # This replica's estimate of a dense exchange's seconds from the last scout (0: none).
    self.scouted = one("scouted", [], tf.float64, "mean")
    # 1 where the last step was dense or bf16 (``ChosenStep``: the replicas' states are
    # equal).
    self.last_dense = one("last_dense", [], tf.int64, "only_first_replica")
    # bf16's probe: its counted periods and the replicas' median at the last decision
    # (0: not measured). Variables of their own, not a third row of ``periods``: a
    # checkpoint written before bf16 was a candidate restores by name, as it was.
    self.bf16_periods = one("bf16_periods", [PROBE], tf.float64, "mean")
    self.bf16_median = one("bf16_median", [], tf.float64, "mean")

  def exchange(self, plans, values, states, compressed):
    """This exchange, compressed (``compressed(values, states)``, an ``Exchanged``),
    dense or bf16, as the schedule says; the periods recorded and the schedule moved on.

    Args:
      plans, values, states: the exchange's (``steps.guard.Guard.exchange``).
      compressed: a function of ``(values, states)``: the compressed exchange.

    Returns:
      An ``Exchanged``: the dense one sums the values exactly (bf16: cast to bfloat16
      and back), keeps the states as they were (nothing was held back) and counts the
      bytes of what it summed (4 per element of float32, 2 of bf16).
    """
    present = [k for k, v in enumerate(values) if v is not None]
    # Dense, with the plan's static shape (an Embedding's IndexedSlices summed into rows).
    dense_values = [engine_lib.densified(values[k], plans[k]) for k in present]
    kind, scout, scout_bytes = self._begin(dense_values)

    # Each replica's values and states (and bf16's flag) go through the arguments
    # (switch_on_every_replica).
    def run_compressed(own):
      own_values, own_states, _ = own
      full_values, full_states = [None] * len(values), list(states)
      for j, k in enumerate(present):
        full_values[k], full_states[k] = own_values[j], own_states[j]
      exchanged = compressed(full_values, full_states)
      return ([exchanged.sums[k] for k in present],
              [tuple(exchanged.states[k]) for k in present],
              [tf.cast(exchanged.nbytes[k], tf.int64) for k in present])

    def run_dense(own):
      own_values, own_states, bf16 = own
      if self.bf16:  # in every replica's own context (cond_on_every_replica)
        sums, nbytes = replica_steps.cond_on_every_replica(
            bf16, lambda v: _dense_sums(tf.distribute.get_replica_context(), v, True),
            lambda v: _dense_sums(tf.distribute.get_replica_context(), v, False),
            own_values)
      else:
        sums, nbytes = _dense_sums(tf.distribute.get_replica_context(), own_values, False)
      return sums, [tuple(tf.identity(s) for s in state) for state in own_states], nbytes

    # Two branches, compressed and dense, bf16's cast a condition inside the dense one:
    # ChosenStep's shape (there a branch per variant cost the chosen dense step on one
    # host; a round's end measured the same either way, docs/performance.md).
    sums, new_states, nbytes = replica_steps.switch_on_every_replica(
        tf.cast(tf.not_equal(kind, KIND_COMPRESSED), tf.int32), [run_compressed, run_dense],
        (dense_values, [tuple(states[k]) for k in present], tf.equal(kind, KIND_BF16)))
    # The scout's bytes counted with the first value's, as dense ones are.
    nbytes = list(nbytes)
    nbytes[0] += tf.where(scout, tf.constant(_scout_sent(scout_bytes), tf.int64),
                          tf.constant(0, tf.int64))
    full_sums, full_states, full_nbytes = [None] * len(values), list(states), [None] * len(values)
    for j, k in enumerate(present):
      full_sums[k], full_states[k], full_nbytes[k] = sums[j], tuple(new_states[j]), nbytes[j]
    return Exchanged(full_sums, full_states, full_nbytes)

  def _begin(self, dense_values):
    """The schedule moved on at the time ``dense_values`` are ready (a scout run where
    it says): ``(this exchange's kind, an int32 KIND_*; whether it scouted; a scout's
    bytes)``."""
    with tf.control_dependencies(dense_values):  # when this step's values are ready
      now = tf.timestamp()
    dense_bytes = sum(v.shape.num_elements() * v.dtype.size for v in dense_values)
    scout_bytes = dense_bytes // SCOUT_FRACTION
    kind = self._schedule(now, scout_bytes)
    with tf.control_dependencies([kind]):  # the schedule's new phase and count
      scout = (tf.equal(tf.convert_to_tensor(self.phase), PROBING_COMPRESSED)
               & tf.less_equal(tf.convert_to_tensor(self.count), SETTLE))
    return kind, scout, scout_bytes

  def _keep(self, estimate, count):
    """Keeps a scout's ``estimate`` (negative: none this exchange): the lowest of a
    probe's scouts (a delay only ever adds), its first setting it."""
    old = tf.convert_to_tensor(self.scouted)
    return self.scouted.assign(tf.where(estimate < 0.0, old, tf.where(
        tf.equal(count, 1), estimate, tf.minimum(old, estimate))))

  def _schedule(self, now, scout_bytes=0):
    """Records the period that ends at ``now``, moves the schedule one exchange on,
    scouts where the new count says so (``scout_bytes`` > 0: a scout's bytes; 0, no
    scouts) and returns this exchange's kind (an int32 ``KIND_*``, equal on every
    replica).

    Between a decision and the next probe (nearly every exchange) only the count moves:
    the rest of the schedule (some sixty scalar ops, the conditional all-reduce of the
    medians and the scout's conditional) is skipped: on one host those alone made the
    default's dense step measurably slower than Keras' (docs/performance.md, "Between
    probes"). No period is recorded there, so ``last_time`` may be stale: the probe
    that follows counts no period before its ``SETTLE + 1``-th."""
    steady = (tf.equal(tf.convert_to_tensor(self.phase), CHOSEN)
              & tf.less(tf.convert_to_tensor(self.count), tf.convert_to_tensor(self.recheck)))
    return replica_steps.cond_on_every_replica(
        steady, self._count_one, lambda own: self._move(own, scout_bytes), now)

  def _count_one(self, now):
    """The schedule's step between probes: one more exchange of the chosen kind."""
    del now  # no period is recorded between probes
    with tf.control_dependencies([self.count.assign_add(1)]):
      # One gather (the step's only op here besides the count): the kind by ``chosen``.
      return tf.gather(
          tf.constant([KIND_COMPRESSED, KIND_COMPRESSED, KIND_DENSE, KIND_BF16]),
          tf.convert_to_tensor(self.chosen))

  def _move(self, now, scout_bytes):
    """``_schedule`` where a probe runs, or the next begins."""
    phase, count = tf.convert_to_tensor(self.phase), tf.convert_to_tensor(self.count)
    chosen, recheck = tf.convert_to_tensor(self.chosen), tf.convert_to_tensor(self.recheck)
    last = tf.convert_to_tensor(self.last_time)
    period = now - last
    # The period ending now is the previous exchange's, of this phase when count >= 1.
    slot = count - 1 - SETTLE
    probing = tf.not_equal(phase, CHOSEN)
    counted = probing & (slot >= 0) & (slot < PROBE) & (last > 0.0)
    # The periods' rows: compressed, dense (the confirming probes' too), bf16.
    row = tf.where(tf.equal(phase, PROBING_BF16), tf.constant(2, tf.int64),
                   tf.where(tf.equal(phase, PROBING_DENSE)
                            | tf.equal(phase, CONFIRMING_DENSE),
                            tf.constant(1, tf.int64), tf.constant(0, tf.int64)))
    periods = tf.concat([tf.convert_to_tensor(self.periods),
                         tf.convert_to_tensor(self.bf16_periods)[tf.newaxis]], 0)
    index = tf.stack([row, tf.clip_by_value(slot, 0, PROBE - 1)])
    periods = tf.where(counted, tf.tensor_scatter_nd_update(periods, [index], [period]),
                       periods)
    medians = [_median(periods[k]) for k in range(3)]
    full = SETTLE + PROBE
    dense_probe = tf.equal(phase, PROBING_DENSE) & (last > 0.0)
    bf16_probe = tf.equal(phase, PROBING_BF16) & (last > 0.0)
    early_dense = {k: dense_probe & tf.equal(count, k) for k in EARLY_FACTORS}
    early_bf16 = {k: bf16_probe & tf.equal(count, k) for k in EARLY_FACTORS}
    full_dense = tf.equal(phase, PROBING_DENSE) & tf.equal(count, full)
    full_bf16 = tf.equal(phase, PROBING_BF16) & tf.equal(count, full)
    confirming = tf.equal(phase, CONFIRMING_COMPRESSED) | tf.equal(phase, CONFIRMING_DENSE)
    to_confirm_dense = tf.equal(phase, CONFIRMING_COMPRESSED) & tf.equal(count, full)
    full_confirming = tf.equal(phase, CONFIRMING_DENSE) & tf.equal(count, full)
    to_dense_probe = tf.equal(phase, PROBING_COMPRESSED) & tf.equal(count, full)
    # A whole dense probe goes on to bf16's (where it is a candidate); nothing is
    # decided there.
    to_bf16_probe = full_dense & self.bf16
    scouted = tf.convert_to_tensor(self.scouted)
    # The replicas' mean of [the compressed median, dense's (its first period or median,
    # or the scout's estimate of a dense exchange), bf16's (its first periods or median;
    # 0: not probed)].
    dense_time = tf.where(full_dense | tf.equal(phase, PROBING_BF16) | confirming,
                          medians[1], tf.where(to_dense_probe, scouted, period))
    bf16_time = tf.where(full_bf16 | confirming, medians[2],
                         tf.where(bf16_probe, period, 0.0))
    measuring = [to_dense_probe, full_bf16, full_confirming, *early_dense.values(),
                 *early_bf16.values()]
    if not self.bf16:
      measuring.append(full_dense)
    measured = replica_steps.cond_on_every_replica(
        tf.reduce_any(tf.stack(measuring)), _mean_over_replicas,
        lambda own: tf.zeros([3], tf.float64),
        tf.stack([medians[0], dense_time, bf16_time]))
    compressed_s, dense_s, bf16_s = measured[0], measured[1], measured[2]
    # A dense exchange alone longer than EARLY_FACTORS[1] compressed periods: no probe.
    skipped = to_dense_probe & (dense_s > EARLY_FACTORS[1] * compressed_s)
    decided = skipped | full_confirming | (full_dense & ~to_bf16_probe)
    bf16_done = full_bf16
    for k, factor in EARLY_FACTORS.items():
      decided = decided | (early_dense[k] & (dense_s > factor * compressed_s))
      bf16_done = bf16_done | (early_bf16[k]
                               & (bf16_s > factor * tf.minimum(compressed_s, dense_s)))
    # The faster lossy exchange (bf16 on a tie; not probed, not a candidate), kept only
    # where it beats dense by the margin. A probe that ended early lost to the one it
    # was measured against: its period exceeds twice that one's.
    bf16_probed = bf16_s > 0.0
    bf16_or_inf = tf.where(bf16_probed, bf16_s, tf.constant(float("inf"), tf.float64))
    lossy_s = tf.minimum(compressed_s, bf16_or_inf)
    lossy = tf.where(bf16_or_inf <= compressed_s, tf.constant(BF16, tf.int64),
                     tf.constant(COMPRESSED, tf.int64))
    new_choice = tf.where(lossy_s < (1.0 - MARGIN) * dense_s, lossy,
                          tf.constant(DENSE, tf.int64))
    # bf16 ahead: the compressed and the dense exchange are probed once more before
    # deciding. Their probes ran first, in the run's first steps or right after the
    # last choice, and such periods are longer (measured: 1.5x the wide MLP's steady
    # compressed period over 1 Gbit/s and 1.26x dense's, where bf16's, probed last, was
    # 1.1x its own): the order alone made bf16 look faster.
    to_confirm = bf16_done & tf.equal(new_choice, BF16)
    decided = decided | (bf16_done & ~to_confirm)
    # The same choice again: the next probe comes twice as late (the probes of the
    # slower exchanges cost, and nothing changed).
    new_recheck = tf.where(tf.equal(new_choice, chosen),
                           tf.clip_by_value(2 * recheck, RECHECK, RECHECK_MAX),
                           tf.constant(RECHECK, tf.int64))
    # The probes' extra time, each one's exchanges times what each cost over the
    # fastest one, at most PROBE_SHARE of the time until the next probe.
    faster = tf.maximum(tf.minimum(lossy_s, dense_s), 1e-9)
    dense_n = tf.cast(tf.where(tf.equal(phase, PROBING_DENSE) & ~full_dense, count,
                               tf.constant(full, tf.int64)), tf.float64)
    bf16_n = tf.cast(tf.where(full_bf16, tf.constant(full, tf.int64), count), tf.float64)
    # Each probed twice where confirmed.
    compressed_n = tf.where(confirming, tf.constant(2.0 * full, tf.float64),
                            tf.constant(float(full), tf.float64))
    dense_n = tf.where(confirming, tf.constant(2.0 * full, tf.float64), dense_n)
    probes = (compressed_n * (compressed_s / faster - 1.0)
              + dense_n * (dense_s / faster - 1.0)
              + tf.where(bf16_probed, bf16_n * (bf16_s / faster - 1.0), 0.0))
    extra = tf.where(skipped,  # the scouts: each a fraction of a dense exchange
                     SETTLE * dense_s / SCOUT_FRACTION / faster, probes)
    new_recheck = tf.minimum(
        tf.maximum(new_recheck, tf.cast(tf.math.ceil(extra / PROBE_SHARE), tf.int64)),
        RECHECK_MAX)
    to_probe = tf.equal(phase, CHOSEN) & (count >= recheck)
    new_phase = tf.where(
        to_dense_probe & ~skipped, tf.constant(PROBING_DENSE, tf.int64),
        tf.where(to_bf16_probe, tf.constant(PROBING_BF16, tf.int64),
                 tf.where(to_confirm, tf.constant(CONFIRMING_COMPRESSED, tf.int64),
                          tf.where(to_confirm_dense, tf.constant(CONFIRMING_DENSE, tf.int64),
                                   tf.where(decided, tf.constant(CHOSEN, tf.int64),
                                            tf.where(to_probe,
                                                     tf.constant(PROBING_COMPRESSED,
                                                                 tf.int64),
                                                     phase))))))
    moved = (to_dense_probe | to_bf16_probe | to_confirm | to_confirm_dense | decided
             | to_probe)
    chosen = tf.where(decided, new_choice, chosen)
    updates = [
        self.periods.assign(periods[:2]),
        self.bf16_periods.assign(periods[2]),
        self.phase.assign(new_phase),
        self.count.assign(tf.where(moved, tf.constant(1, tf.int64), count + 1)),
        self.chosen.assign(chosen),
        self.recheck.assign(tf.where(decided, new_recheck, recheck)),
        self.medians.assign(tf.where(decided, measured[:2],
                                     tf.convert_to_tensor(self.medians))),
        self.bf16_median.assign(tf.where(decided, bf16_s,
                                         tf.convert_to_tensor(self.bf16_median))),
        self.last_time.assign(now),
    ]
    if scout_bytes:  # a compressed probe's settling exchanges scout the link
      new_count = tf.where(moved, tf.constant(1, tf.int64), count + 1)
      with tf.control_dependencies(updates):
        estimate = replica_steps.cond_on_every_replica(
            tf.equal(new_phase, PROBING_COMPRESSED) & tf.less_equal(new_count, SETTLE),
            lambda own: _scout([own], scout_bytes),
            lambda own: tf.constant(-1.0, tf.float64), now)
      updates.append(self._keep(estimate, new_count))
    with tf.control_dependencies(updates):
      return tf.identity(_kind(new_phase, chosen))


def _kind(phase, chosen):
  """The kind (an int32 ``KIND_*``) of an exchange in ``phase`` after the decision
  ``chosen``."""
  dense = (tf.equal(phase, PROBING_DENSE) | tf.equal(phase, CONFIRMING_DENSE)
           | (tf.equal(phase, CHOSEN) & tf.equal(chosen, DENSE)))
  bf16 = tf.equal(phase, PROBING_BF16) | (tf.equal(phase, CHOSEN) & tf.equal(chosen, BF16))
  return tf.where(dense, KIND_DENSE, tf.where(bf16, KIND_BF16, KIND_COMPRESSED))


def _dense_sums(ctx, values, bf16):
  """``values`` summed over the replicas (one all-reduce per dtype; with ``bf16`` the
  float32 ones cast to bfloat16 for it, and back) and the bytes each sent."""
  wire = [tf.cast(v, tf.bfloat16) if bf16 and v.dtype == tf.float32 else v for v in values]
  sums = engine_lib.all_reduce_joined(ctx, wire)
  return ([tf.cast(s, v.dtype) for s, v in zip(sums, values)],
          [base.dense_nbytes(w)[0] for w in wire])


class ChosenStep:
  """``dense_when_faster`` for a whole step (the update and the gradient exchange, one
  exchange per step): each step is either the mode's own, compressed, or Keras' dense
  step (or that step with bf16 sums), as ``choice``'s schedule says, in one
  cross-replica switch.

  Keras' dense step: the gradients summed over the replicas (one all-reduce per dtype;
  each replica's clipped to ``local_clipnorm`` first, where set; with bf16 the float32
  ones cast to bfloat16 for it) and one step of the inner optimizer on their sum,
  skipped where the sum is not finite. Under the update
  exchange each replica's inner optimizer state is its own (its own gradients stepped
  it); the first dense step after compressed ones sets every replica's to their mean
  first (one all-reduce per dtype), so that from there every replica takes the same
  step from the same state, as under Keras. The residues keep what the compressor held
  back for the next compressed step.

  Args:
    choice: the wrapper's ``Choice`` (its schedule, its scouts).
    guard: the wrapper's ``steps.guard.Guard`` (built without a choice of its own).
    inner: the inner optimizer adapter (``steps.inner``).
    step: the mode's step (``UpdateExchange`` or ``GradientExchange``).
    per_replica: whether each replica's inner optimizer state is its own (the update
      exchange).
  """

  def __init__(self, choice, guard, inner, step, per_replica):
    self.choice, self.guard, self.inner, self.step = choice, guard, inner, step
    self.per_replica = per_replica

  def __call__(self, grads, variables, indices, dense):
    choice, guard = self.choice, self.guard
    present = [k for k, g in enumerate(grads) if g is not None]
    if not present:  # nothing to exchange either way
      return self.step(grads, variables, indices, dense)
    plans = [guard.plans[indices[k]] for k in present]
    # Dense, with the plan's static shape (an Embedding's IndexedSlices summed into rows).
    dense_grads = [engine_lib.densified(grads[k], p) for k, p in zip(present, plans)]
    kind, scout, scout_bytes = choice._begin(dense_grads)  # pylint: disable=protected-access
    last_dense = tf.equal(tf.convert_to_tensor(choice.last_dense), 1)

    # Each replica's gradients (and the flags below) go through the arguments
    # (switch_on_every_replica).
    def run_compressed(own):
      self.step(list(own[0]), variables, indices, dense)
      return tf.constant(0)

    def run_dense(own):
      _, own_grads, sync, bf16 = own
      if self.per_replica:
        replica_steps.on_every_replica_if(
            sync, lambda _: _average_state(tf.distribute.get_replica_context(),
                                           self.inner.optimizer), ())
      # Each replica's own mean gradient clipped to local_clipnorm first, as both
      # exchanges clip it.
      ctx = tf.distribute.get_replica_context()
      own_grads = self.inner.clip(list(own_grads), ctx.num_replicas_in_sync)
      if choice.bf16:  # in every replica's own context (cond_on_every_replica)
        sums, nbytes = replica_steps.cond_on_every_replica(
            bf16, lambda g: _dense_sums(tf.distribute.get_replica_context(), g, True),
            lambda g: _dense_sums(tf.distribute.get_replica_context(), g, False), own_grads)
      else:
        sums, nbytes = _dense_sums(ctx, own_grads, False)
      finite = fused.all_finite(sums)  # the same sums, the same flag, on every replica
      stepping = [variables[k] for k in present]
      guard.on_every_replica_if(finite, lambda s: self.inner.step(list(s), stepping), sums)
      guard.record_bytes([indices[k] for k in present], nbytes)
      return tf.constant(0)

    # Two branches, compressed and dense: the state's averaging and bf16's cast are
    # conditions inside the dense one. A branch per variant of the dense step made the
    # chosen dense step measurably slower than Keras' on one host (docs/performance.md,
    # "The chosen dense step on one host").
    sync = tf.logical_not(last_dense) if self.per_replica else tf.constant(False)
    is_bf16 = tf.equal(kind, KIND_BF16)
    done = replica_steps.switch_on_every_replica(
        tf.cast(tf.not_equal(kind, KIND_COMPRESSED), tf.int32), [run_compressed, run_dense],
        (list(grads), dense_grads, sync, is_bf16))
    # The scout's bytes (it ran before the exchange) with the first gradient's.
    guard.bytes_sent.assign_add(
        tf.one_hot(indices[present[0]], len(guard.plans), dtype=tf.int64)
        * tf.where(scout, tf.constant(_scout_sent(scout_bytes), tf.int64),
                   tf.constant(0, tf.int64)))
    with tf.control_dependencies([done]):
      choice.last_dense.assign(tf.cast(tf.not_equal(kind, KIND_COMPRESSED), tf.int64))


def _average_state(ctx, optimizer):
  """Sets this replica's copy of ``optimizer``'s per-replica floating state (its slots,
  one value per replica) to the replicas' mean (one all-reduce per dtype)."""
  state = [x for x in optimizer.variables if tf.as_dtype(x.dtype).is_floating
           and getattr(getattr(x, "value", x), "synchronization", None)
           == tf.VariableSynchronization.ON_READ]
  if not state:
    return
  values = [tf.convert_to_tensor(x) for x in state]
  sums = engine_lib.all_reduce_joined(ctx, values)
  replicas = ctx.num_replicas_in_sync
  for x, total in zip(state, sums):
    x.assign(total / tf.cast(replicas, total.dtype))


def _scout_elements(nbytes):
  """The float32 zeros a scout of ``nbytes`` all-reduces (at least one)."""
  return max(nbytes // 4, 1)


def _scout_sent(nbytes):
  """The bytes a scout of ``nbytes`` sends: its scalar and its zeros, float32."""
  return 4 * (1 + _scout_elements(nbytes))


def _scout(ready, nbytes):
  """This replica's estimate of a dense exchange's seconds: a scalar all-reduce timed
  (the link's latency, and every replica past the exchange), then one of ``nbytes`` of
  zeros, ``1 / SCOUT_FRACTION`` of a dense exchange's bytes, whose transfer time beyond
  the latency is scaled up; 0 where the transfer is too short to tell the bandwidth
  (``SCOUT_MIN_SECONDS``). Both start once ``ready`` (this exchange's sums) are."""
  ctx = tf.distribute.get_replica_context()
  with tf.control_dependencies(ready):
    start = tf.timestamp()
  with tf.control_dependencies([start]):
    latency_done = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.zeros([1], tf.float32))
  with tf.control_dependencies([latency_done]):
    middle = tf.timestamp()
  with tf.control_dependencies([middle]):
    zeros_done = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                tf.zeros([_scout_elements(nbytes)], tf.float32))
  with tf.control_dependencies([zeros_done]):
    end = tf.timestamp()
  latency, transfer = middle - start, end - middle
  reliable = transfer > tf.maximum(2.0 * latency, SCOUT_MIN_SECONDS)
  return tf.where(reliable, latency + SCOUT_FRACTION * (transfer - latency), 0.0)


def _median(values):
  """The upper median of a vector (robust to a period with an evaluation in it)."""
  return tf.sort(values)[int(values.shape[0]) // 2]


def _mean_over_replicas(value):
  ctx = tf.distribute.get_replica_context()
  total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(value, tf.float32))
  return tf.cast(total, tf.float64) / ctx.num_replicas_in_sync


def describe(choice):
  """What ``choice`` is doing, as Python values (``CompressedOptimizer.exchange_choice``).

  Returns:
    ``{"exchange": "compressed" | "dense" | "bf16", "phase": "probing compressed" |
    "probing dense" | "probing bf16" | "confirming compressed" | "confirming dense" |
    "chosen", "compressed_step_seconds": ..., "dense_step_seconds": ...,
    "bf16_step_seconds": ..., "scouted_dense_seconds": ...}``: the last exchange's kind
    and phase, the replicas' median step times at the last decision (None before one,
    and bf16's where it was not probed; where a probe stopped early, its last period;
    dense's where the scouts skipped its probe, their estimate), and the replicas' mean
    of the last scouts' estimate of a dense exchange (None where they could not tell).
  """
  phase, chosen = int(choice.phase.numpy()), int(choice.chosen.numpy())
  medians = [float(m) for m in choice.medians.numpy()]
  scouted = float(choice.scouted.numpy())
  kind = int(_kind(tf.constant(phase, tf.int64), tf.constant(chosen, tf.int64)))
  return {"exchange": KIND_NAMES[kind],
          "phase": {PROBING_COMPRESSED: "probing compressed", PROBING_DENSE: "probing dense",
                    PROBING_BF16: "probing bf16",
                    CONFIRMING_COMPRESSED: "confirming compressed",
                    CONFIRMING_DENSE: "confirming dense", CHOSEN: "chosen"}[phase],
          "compressed_step_seconds": medians[0] or None,
          "dense_step_seconds": medians[1] or None,
          "bf16_step_seconds": float(choice.bf16_median.numpy()) or None,
          "scouted_dense_seconds": scouted or None}
