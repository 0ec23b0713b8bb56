"""The gathered lengths are untrusted: ``Exchange.decode`` checks them before reading.

Every replica's compact payloads arrive joined in one int32 buffer, with a second
gathered tensor of lengths (``[replicas, payloads]``) that says where each one is. Lengths
that do not describe the buffer (negative, beyond a payload's width, adding up to more or
less than the words that arrived, or with the hierarchical exchange's stride, more than
the stride) used to crash the step (``tf.gather`` out of range) or silently shift every
later replica's rows. Now nothing is read from them and every compact total is NaN, so
that ``CompressedOptimizer`` skips the step on every replica.

The property below fuzzes buffers and lengths together and compares ``Exchange.decode``
with a NumPy reading written here from the layout (docs/wire_format.md): a compressor whose
"decoded" tensor is its rows' words as float32 bits exposes exactly what was read.
"""

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp import exchange
from tf_adacomp import hierarchy as hierarchy_lib
from tf_adacomp.compressors import base
import tiers

REPLICAS = 3
WIDTHS = (5, 3)  # two compact payloads per replica


class _Rows(base.Compressor):
  """A compact compressor that decodes a payload's ``[replicas, width]`` rows to
  themselves (float32 bits): what the exchange read, word for word."""

  name = "rows_for_tests"

  def _width(self, plans):
    (plan,) = plans
    return int(plan.shape[1])

  def _compress(self, grads, states, plans):
    raise NotImplementedError

  def _decompress(self, payload, plans):
    return [tf.bitcast(payload, tf.float32)]

  def _nbytes(self, payload, plans):
    raise NotImplementedError


_COMPRESSOR = _Rows()
_PLANS = [base.TensorPlan(f"p{k}", tf.TensorShape([REPLICAS, w]), tf.float32, "matrix", False)
          for k, w in enumerate(WIDTHS)]
_OUT = exchange.Outgoing({}, {(k,): (tf.zeros([w], tf.int32), None)
                              for k, w in enumerate(WIDTHS)}, [], {})


def _numpy_reading(data, lengths, stride):
  """``(valid, rows)``: whether ``lengths`` describe ``data`` (every length in ``[0,
  width]``; their total the size of ``data``, or with a stride: a stride >= 0 and one per
  replica, each replica's total within it) and, if they do, each payload's rows."""
  data, lengths = np.asarray(data), np.asarray(lengths, np.int64)
  if (lengths < 0).any() or (lengths > np.array(WIDTHS)).any():
    return False, None
  if stride is None:
    if lengths.sum() != data.size:
      return False, None
    starts = np.concatenate([[0], np.cumsum(lengths.sum(axis=1))[:-1]])
  else:
    if stride < 0 or REPLICAS * stride != data.size or (lengths.sum(axis=1) > stride).any():
      return False, None
    starts = stride * np.arange(REPLICAS)
  rows = [np.zeros([REPLICAS, w], np.int32) for w in WIDTHS]
  for r in range(REPLICAS):
    at = starts[r]
    for k, w in enumerate(WIDTHS):
      rows[k][r, :lengths[r, k]] = data[at:at + lengths[r, k]]
      at += lengths[r, k]
  return True, rows


@st.composite
def _gathered(draw):
  """``(data, lengths, stride)`` as they might arrive: honest, or corrupted one way."""
  words = st.integers(-2**31, 2**31 - 1)
  lengths = np.array([[draw(st.integers(0, w)) for w in WIDTHS] for _ in range(REPLICAS)],
                     np.int64)
  strided = draw(st.booleans())
  stride = int(lengths.sum(axis=1).max()) + draw(st.integers(0, 2)) if strided else None
  if stride is None:
    data = draw(st.lists(words, min_size=int(lengths.sum()), max_size=int(lengths.sum())))
  else:
    data = draw(st.lists(words, min_size=REPLICAS * stride, max_size=REPLICAS * stride))
  kind = draw(st.sampled_from(["honest", "negative_same_total", "negative", "above_width",
                               "more_words", "fewer_words", "any_lengths", "stride"]))
  r, k = draw(st.integers(0, REPLICAS - 1)), draw(st.integers(0, len(WIDTHS) - 1))
  if kind == "negative_same_total":  # a later length grows by as much: totals still match
    change = lengths[r, k] + draw(st.integers(1, 2**31))
    lengths[r, k] -= change
    lengths[REPLICAS - 1, len(WIDTHS) - 1] += change
  elif kind == "negative":
    lengths[r, k] = draw(st.integers(-2**31, -1))
  elif kind == "above_width":
    lengths[r, k] = draw(st.integers(WIDTHS[k] + 1, 2**31 - 1))
  elif kind == "more_words":  # the lengths add up to more than arrived
    lengths[r, k] += draw(st.integers(1, 3))
  elif kind == "fewer_words":
    data = data[:max(0, len(data) - draw(st.integers(1, 3)))]
  elif kind == "any_lengths":
    lengths = np.array(draw(st.lists(st.integers(-4, 8), min_size=REPLICAS * len(WIDTHS),
                                     max_size=REPLICAS * len(WIDTHS)))).reshape(lengths.shape)
  elif kind == "stride" and stride is not None:
    stride = draw(st.sampled_from([stride - 1, -stride, stride + 1, -1]))
  lengths = np.clip(lengths, -2**31, 2**31 - 1).astype(np.int32)
  return np.array(data, np.int64).astype(np.int32), lengths, stride


@hypothesis.settings(max_examples=tiers.examples(200), deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(_gathered())
def test_decode_reads_what_valid_lengths_say_and_marks_every_total_otherwise(gathered):
  data, lengths, stride = gathered
  valid, rows = _numpy_reading(data, lengths, stride)
  incoming = exchange.Incoming(REPLICAS, data=tf.constant(data, tf.int32),
                               lengths=tf.constant(lengths))
  sums = exchange.Exchange(_COMPRESSOR).decode(
      _PLANS, _OUT, incoming, stride=None if stride is None else tf.constant(stride))
  checked, verdict = exchange.checked_lengths(incoming.data, incoming.lengths, WIDTHS,
                                              REPLICAS, stride)
  assert bool(verdict) == valid
  for k, total in enumerate(sums):
    if valid:
      np.testing.assert_array_equal(tf.bitcast(total, tf.int32).numpy(), rows[k])
      np.testing.assert_array_equal(checked, lengths)
    else:
      assert np.isnan(total.numpy()).all()
      assert not checked.numpy().any()
    # gathered_rows alone never raises either: what valid lengths say, else zeros.
    alone = exchange.gathered_rows(incoming.data, incoming.lengths, k, WIDTHS[k], REPLICAS,
                                   stride).numpy()
    if valid:
      np.testing.assert_array_equal(alone, rows[k])


def test_the_issues_negative_length_no_longer_shifts_the_next_replica():
  """lengths [[-3, 5], [5, 5]] over 20 words gave replica 1 the words 2..6, not 10..14."""
  data = tf.range(20, dtype=tf.int32)
  lengths = tf.constant([[-3, 5], [5, 5]])
  rows = exchange.gathered_rows(data, lengths, 0, 5, 2)
  np.testing.assert_array_equal(rows, np.zeros([2, 5]))
  np.testing.assert_array_equal(exchange.gathered_rows(data, [[5, 5], [5, 5]], 0, 5, 2),
                                [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]])
  _, valid = exchange.checked_lengths(data, lengths, [5, 5], 2)
  assert not bool(valid)


def test_the_check_compiles_with_xla():
  """The check runs beside XLA-compiled decoders: it has no dynamic shape of its own."""
  check = tf.function(lambda d, l, s: exchange.checked_lengths(d, l, [5, 5], 2, s),
                      jit_compile=True)
  data = tf.zeros([20], tf.int32)
  assert bool(check(data, tf.constant([[5, 5], [5, 5]]), tf.constant(10))[1])
  assert not bool(check(data, tf.constant([[5, 6], [5, 4]]), tf.constant(10))[1])
  assert not bool(check(data, tf.constant([[5, 5], [5, 5]]), tf.constant(9))[1])


# --- The hierarchical exchange's stride, with real collectives --------------------------

DEVICES = [f"/cpu:{i}" for i in range(4)]  # 2 workers x 2 devices (tests/conftest.py)
SHAPES = ([300], [40])


def _corrupt_lengths(lengths, kind):
  if kind == "negative_same_total":
    change = tf.tensor_scatter_nd_update(tf.zeros_like(lengths), [[0, 0]], [-3 - lengths[0, 0]])
    return lengths + change - tf.reverse(change, [0, 1])
  if kind == "negated":  # no row adds up to a word: the padded buffers must not be empty
    return -lengths
  assert kind == "above_width"
  return tf.tensor_scatter_nd_update(lengths, [[0, 0]], [2**30])


@pytest.mark.slow  # a 4-device strategy, traced and compiled: about 3 s
# In a warm-up step (dense) the zeros read from refused lengths decode to a finite zero:
# only the exchange's own mark makes them NaN (TopK's decoder marks a row of zeros).
@pytest.mark.parametrize("kind, dense", [("negative_same_total", None),
                                         ("above_width", None), ("negated", None),
                                         ("negative_same_total", True)])
def test_the_leaders_corrupt_lengths_mark_every_devices_totals(monkeypatch, kind, dense):
  strategy = tf_adacomp.distribute.mirrored_strategy(devices=DEVICES)
  hierarchy = hierarchy_lib.resolve(strategy, True, 2)
  compressor = tf_adacomp.TopK(density=0.1)
  plans = [compressor.plan(tf.TensorShape(s), tf.float32, f"v{k}") for k, s in enumerate(SHAPES)]
  engine = tf_adacomp.Exchange(compressor)
  original = hierarchy_lib.Hierarchy.leaders_gather

  def leaders_gather(self, position, tensor):
    gathered = original(self, position, tensor)
    if gathered.dtype == tf.int32 and gathered.shape.rank == 2:  # the lengths
      return _corrupt_lengths(gathered, kind)
    return gathered

  monkeypatch.setattr(hierarchy_lib.Hierarchy, "leaders_gather", leaders_gather)

  @tf.function
  def run():
    def step():
      replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group,
                        tf.float32)
      grads = [tf.fill(p.shape, replica + 1.0) for p in plans]
      states = [tuple(compressor.init(p)) for p in plans]
      return engine.replica_exchange(plans, grads, states,
                                     None if dense is None else tf.constant(dense),
                                     hierarchy=hierarchy).sums
    return strategy.run(step)

  for total in run():
    for local in strategy.experimental_local_results(total):
      assert np.isnan(local.numpy()).all()
