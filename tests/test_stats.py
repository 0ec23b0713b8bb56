"""The byte model (stats.exchange_nbytes) and the per-kind summary."""

import math

import numpy as np
import tensorflow as tf

from tf_adacomp import stats
from tf_adacomp.compressors import base


def _model(lengths):
  """NumPy: what one replica sends for a joined, padded all-gather plus a lengths gather."""
  lengths = np.asarray(lengths, np.int64)
  return 4 * lengths.shape[1] + 4 * lengths.sum(axis=1).max()


def test_one_replica_pays_its_own_bytes_plus_a_length_word():
  np.testing.assert_array_equal(stats.exchange_nbytes([[10, 0, 7]]).numpy(), [44, 4, 32])


def test_equal_lengths_give_each_payload_its_own_bytes():
  np.testing.assert_array_equal(stats.exchange_nbytes([[3, 5], [3, 5]]).numpy(), [16, 24])


def test_shares_add_up_to_what_crosses_the_wire():
  rng = np.random.default_rng(0)
  for _ in range(50):
    lengths = rng.integers(0, 1000, size=(rng.integers(1, 5), rng.integers(1, 6)))
    shares = stats.exchange_nbytes(tf.constant(lengths, tf.int32)).numpy()
    assert shares.sum() == _model(lengths)
    assert (shares >= 4).all()
  # The joined buffer is padded once: less than padding every payload to its longest.
  lengths = [[100, 0], [0, 100]]
  assert stats.exchange_nbytes(lengths).numpy().sum() == 8 + 400 < 2 * (4 + 400)


def test_nothing_sent_costs_the_length_words():
  np.testing.assert_array_equal(stats.exchange_nbytes([[0, 0], [0, 0]]).numpy(), [4, 4])


def test_summarize_per_kind_and_total():
  dense = base.TensorPlan("d", tf.TensorShape([10, 10]), tf.float32, "dense", False)
  bias = base.TensorPlan("b", tf.TensorShape([10]), tf.float32, "vector", True, dense=True)
  summary = stats.summarize([(dense, 40), (bias, 40)])
  assert summary["dense"] == {"dense_bytes": 400.0, "sent_bytes": 40.0, "ratio": 10.0}
  assert summary["total"]["ratio"] == 440 / 80
  assert math.isnan(stats.summarize([(dense, 0)])["total"]["ratio"])
