"""Simulated learners: exact with no compression, close to it with AdaComp, on real data."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adacomp
from tf_adacomp import cli
from tf_adacomp import simulate

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _mlp(seed=0):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([keras.Input([8, 8, 1]), keras.layers.Flatten(),
                           keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])


def test_no_compression_equals_full_batch_sgd():
  (x, y), _ = cli._digits(0)
  x, y = tf.constant(x[:64]), tf.constant(y[:64])
  model, reference = _mlp(), _mlp()
  trainer = simulate.SimulatedLearners(model, keras.optimizers.SGD(0.1), LOSS, "none", 4)
  optimizer = keras.optimizers.SGD(0.1)
  for _ in range(3):
    trainer.train_step(x, y)
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(LOSS(y, reference(x, training=True)))
    optimizer.apply_gradients(
        zip(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables))
  for a, b in zip(model.trainable_variables, reference.trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


def test_adacomp_keeps_dense_accuracy_on_digits():
  summaries = {name: cli.run_demo(name, steps=150, learners=4, batch_size=128)
               for name in ("none", "adacomp")}
  dense, adacomp = summaries["none"], summaries["adacomp"]
  assert dense["test_accuracy"] > 0.9
  assert adacomp["test_accuracy"] >= dense["test_accuracy"] - 0.03
  ratio = adacomp["compression"]
  assert ratio["total"]["ratio"] > 50
  assert ratio["conv"]["ratio"] > 10 and ratio["dense"]["ratio"] > 50
  assert dense["compression"]["total"]["ratio"] == 1.0


def test_cli_demo_prints_and_writes_both_summaries(tmp_path, capsys):
  out = tmp_path / "demo.json"
  assert cli.main(["demo", "--steps", "3", "--compressors", "none,topk",
                   "--json", str(out)]) == 0
  summaries = json.loads(out.read_text())
  assert [s["compressor"] for s in summaries] == ["none", "topk"]
  for s in summaries:
    assert {"test_accuracy", "wall_seconds", "compression"} <= set(s)
  assert "compression ratio (total)" in capsys.readouterr().out


def test_cli_rejects_a_batch_that_does_not_split():
  with pytest.raises(SystemExit):
    cli.main(["demo", "--batch_size", "10", "--learners", "4"])


def test_learners_must_be_positive():
  with pytest.raises(ValueError, match="learners=0"):
    simulate.SimulatedLearners(_mlp(), keras.optimizers.SGD(), LOSS, "none", 0)
