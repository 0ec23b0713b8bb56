"""The differential oracle for ``tf_adacomp.CompressedAllReduce("none")``.

A ``MirroredStrategy(devices, cross_device_ops=CompressedAllReduce("none"))`` training a
tiny model with a plain Keras optimizer under ``model.fit`` must train as the same
strategy with TensorFlow's default all-reduce: the "none" compressor sends every
gradient whole (an Embedding's IndexedSlices are reduced exactly, as the module
docstring says). Compared on 2 and 4 replicas, ``tf.distribute`` and
``tf.compat.v1.distribute`` strategies, with a ``tf.train.Checkpoint`` (holding
``CompressedAllReduce.of(strategy)``) or a ``.keras`` file restored onto another replica
count (2 -> 4, 4 -> 2) and training continued.

Tolerance ``oracle.FLOAT`` (rtol 1e-5, atol 2e-6): the two all-reduces sum the replicas'
float32 gradients in different orders (a few ulp per step over 6 steps); a gradient
dropped, counted twice or scaled wrongly moves weights by 1e-3 or more. The reference is
plain Keras under the same events (for a restore onto another count: the same restore,
a plain optimizer's mirrored state restores exactly). Configurations: pairwise over the
axes below (all of them with ``--full``; the first ``FAST_ROWS`` on 2 replicas in the fast tier).
"""

import dataclasses
import itertools

import pytest

import oracle

AXES = {
    "inner": ("sgd", "adam", "adamw"),
    "replicas": (2, 4),
    "v1": (False, True),
    "model": ("dense", "embedding"),
    "event": ("none", "checkpoint", "checkpoint_other", "keras_other"),
}
FAST_ROWS = 1  # the fast tier: the first row (an embedding's checkpoint with --full)
CONFIGS = [oracle.Config(cross_device_ops=True, **row) for row in oracle.pairwise(AXES)]
FAST = set(oracle.fast_rows(CONFIGS, FAST_ROWS))


@pytest.mark.parametrize("config", [
    pytest.param(c, id=",".join(p for p in c.id.split(",") if p != "cross_device_ops"),
                 marks=oracle.marks(c) + ([] if i in FAST else [pytest.mark.slow]))
    for i, c in enumerate(CONFIGS)])
def test_trains_as_the_default_all_reduce(config, tmp_path):
  ours = oracle.train(config, True, str(tmp_path / "ours"))
  reference = oracle.train(config, False, str(tmp_path / "reference"))
  oracle.compare(config, ours, reference, how=oracle.MIXED if config.mixed else oracle.FLOAT)
  oracle.check_at_cut(config, ours)


def test_the_configurations_cover_every_pair():
  """The covering array holds every pair of values of two axes."""
  for (a, values_a), (b, values_b) in itertools.combinations(AXES.items(), 2):
    held = {(getattr(c, a), getattr(c, b)) for c in CONFIGS}
    assert held == {(x, y) for x in values_a for y in values_b}, (a, b)
  assert all(dataclasses.replace(c, cross_device_ops=True) == c for c in CONFIGS)
