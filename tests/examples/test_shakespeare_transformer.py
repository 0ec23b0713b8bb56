"""The Shakespeare transformer example: the GPT model (causal, saved and loaded), its data
and flags, its AdamW with warm-up and cosine decay, an AdaComp run."""

from absl import flags
from absl.testing import flagsaver
import keras
import numpy as np
import pytest

import example_runs
import tf_adacomp
from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import optimizers
from tf_adacomp.examples import shakespeare_lstm
from tf_adacomp.examples import shakespeare_transformer
from tf_adacomp.examples import training

TINY = dict(seq_length=8, embed_dim=16, num_heads=2, num_layers=1)


def _tiny_gpt(**overrides):
  keras.utils.set_random_seed(0)
  return shakespeare_transformer.gpt(11, **dict(TINY, **overrides))


def test_each_position_sees_only_the_tokens_at_or_before_it():
  model = _tiny_gpt()
  tokens = np.random.default_rng(0).integers(0, 11, (2, 8)).astype("int32")
  logits = model(tokens).numpy()
  assert logits.shape == (2, 8, 11)
  for j in range(8):
    changed = tokens.copy()
    changed[:, j] = (changed[:, j] + 1) % 11
    other = model(changed).numpy()
    np.testing.assert_allclose(other[:, :j], logits[:, :j], rtol=1e-5, atol=1e-6,
                               err_msg=f"a change at position {j} reached an earlier one")
    # ... and it does reach position j and every later one (attention looks back).
    assert np.all(np.abs(other[:, j:] - logits[:, j:]).max(axis=-1) > 1e-6), j


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_model_round_trips_through_a_keras_file(tmp_path, dropout):
  model = _tiny_gpt(dropout=dropout)
  path = str(tmp_path / "gpt.keras")
  model.save(path)
  loaded = keras.saving.load_model(path)
  tokens = np.arange(16, dtype="int32").reshape(2, 8) % 11
  np.testing.assert_allclose(loaded(tokens).numpy(), model(tokens).numpy(), rtol=1e-6)
  assert [v.path for v in loaded.weights] == [v.path for v in model.weights]
  assert loaded.get_layer("position_embedding").sequence_length == 8


@pytest.mark.parametrize("settings,match", [
    (dict(embed_dim=10, num_heads=4), "embed_dim=10, num_heads=4"),
    (dict(num_layers=0), "num_layers=0"),
    (dict(dropout=1.0), "dropout=1.0"),
])
def test_bad_model_sizes_are_named(settings, match):
  with pytest.raises(ValueError, match=match):
    shakespeare_transformer.gpt(11, **dict(TINY, **settings))


def test_defaults_are_adamw_with_warmup_and_cosine_decay():
  config = flags_and_config.make_config(shakespeare_transformer, compressor="none")
  assert (config.optimizer, config.lr_schedule, config.batch_size) == ("adamw", "cosine", 64)
  assert config.learning_rate == 1e-3 and 0 < config.warmup_epochs < config.epochs
  assert config.options == dict(seq_length=128, embed_dim=128, num_heads=4, num_layers=2,
                                dropout=0.0, text_files=None)
  optimizer = optimizers.make_optimizer(config, steps_per_epoch=100)
  assert isinstance(optimizer, keras.optimizers.AdamW) and optimizer.weight_decay == 0.01
  rate = keras.saving.deserialize_keras_object(optimizer.get_config()["learning_rate"])
  assert isinstance(rate, tf_adacomp.schedules.WarmupDecay)
  assert (rate.decay, rate.warmup_steps, rate.total_steps) == ("cosine", 50, 500)


def test_adamw_spares_biases_layer_norms_and_embeddings():
  config = flags_and_config.make_config(shakespeare_transformer, compressor="adacomp",
                                        weight_decay=0.1)
  optimizer = optimizers.make_optimizer(config, steps_per_epoch=10)
  assert isinstance(optimizer, tf_adacomp.CompressedOptimizer)
  inner = optimizer.inner_optimizer
  assert isinstance(inner, keras.optimizers.AdamW) and inner.weight_decay == 0.1
  decayed = {v.path for v in _tiny_gpt().trainable_variables
             if inner._use_weight_decay(v)}  # pylint: disable=protected-access
  assert decayed == {"block_0_attention/query/kernel", "block_0_attention/key/kernel",
                     "block_0_attention/value/kernel",
                     "block_0_attention/attention_output/kernel",
                     "block_0_mlp_hidden/kernel", "block_0_mlp_output/kernel",
                     "logits/kernel"}


def test_data_are_shakespeare_lstm_windows(tmp_path):
  (tmp_path / "play.txt").write_text("KING. Speak, and be brief.\n" * 20)
  config = flags_and_config.make_config(shakespeare_transformer, seq_length=8,
                                        text_files=f"{tmp_path}/*.txt")
  data = shakespeare_transformer.load_data(config)
  train, _ = shakespeare_lstm.read_text_files(f"{tmp_path}/*.txt")
  assert data.info["vocabulary_size"] == len(set(train)) + 1
  x, y = next(iter(data.train.batch(4)))
  assert x.shape == (4, 8) and y.shape == (4, 8)
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # shifted by one character


def test_flags_reuse_shakespeare_lstm_ones_and_list_them_in_help():
  key = {f.name for f in flags.FLAGS.get_key_flags_for_module(shakespeare_transformer)}
  assert {"seq_length", "text_files", "embed_dim", "num_heads", "num_layers", "dropout",
          "compressor", "optimizer", "weight_decay"} <= key
  assert "lstm_units" not in key
  with flagsaver.as_parsed(embedding_dim="32"):
    with pytest.raises(SystemExit, match="--embedding_dim is shakespeare_lstm's"):
      shakespeare_transformer.refuse_other_examples_flags()
  with flagsaver.as_parsed(embed_dim="32"):
    shakespeare_transformer.refuse_other_examples_flags()  # its own: no complaint


@pytest.mark.slow  # the examples' training runs are the slow tier's (about 7 s here)
def test_trains_with_adacomp(tmp_path):
  """A few AdaComp steps on one replica (one compile of each AdaComp program: the
  replicas' exchange is tested on the other examples), AdamW with warm-up and cosine
  decay."""
  (tmp_path / "play.txt").write_text("ROMEO. But soft, what light through yonder window "
                                     "breaks?\n" * 40)
  config = example_runs.small_config(
      shakespeare_transformer, tmp_path, compressor="adacomp", replicas=1, eval_steps=1,
      text_files=f"{tmp_path}/*.txt", **TINY)
  summary = training.train(shakespeare_transformer, config)
  example_runs.check_summary(summary, tmp_path, kinds=("dense", "vector"))
  assert summary["steps"] == 3 and summary["config"]["optimizer"] == "adamw"
  assert summary["config"]["options"]["embed_dim"] == 16  # the run can be repeated
  # The attention's rank-3 kernels are dense matrices to AdaComp (L_T = 500), not convolutions.
  assert summary["variables"]["block_0_attention/query/kernel"]["kind"] == "dense"
  assert "conv" not in summary["compression"]
