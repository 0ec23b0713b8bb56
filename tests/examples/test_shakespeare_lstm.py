"""The Shakespeare LSTM example: windows, the tfds pipeline (mocked), an AdaComp run."""

import numpy as np
import pytest

import example_runs
from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import shakespeare_lstm
from tf_adacomp.examples import training


def test_windows_are_next_character_pairs():
  x, y = shakespeare_lstm.windows(np.arange(11), 3)
  np.testing.assert_array_equal(x, [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
  np.testing.assert_array_equal(y, [[1, 2, 3], [4, 5, 6], [7, 8, 9]])


def test_windows_need_enough_text():
  with pytest.raises(ValueError, match="seq_length=10"):
    shakespeare_lstm.windows(np.arange(10), 10)


def test_the_tfds_pipeline_gives_windows_shifted_by_one(tmp_path, monkeypatch):
  config = flags_and_config.make_config(shakespeare_lstm, seq_length=4,
                                        data_dir=str(tmp_path / "tfds"))
  with example_runs.mock_tfds(monkeypatch, num_examples=1):
    data = shakespeare_lstm.load_data(config)
  x, y = next(iter(data.train.batch(2)))
  assert x.shape == (2, 4) and y.shape == (2, 4)
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # shifted by one character


@pytest.mark.slow
def test_trains_with_adacomp_on_the_tfds_pipeline(tmp_path, monkeypatch):
  # One replica (one compile of each AdaComp program): the replicas' exchange is tested
  # on the other examples.
  config = example_runs.small_config(
      shakespeare_lstm, tmp_path, compressor="adacomp", seq_length=4, lstm_units=32,
      embedding_dim=8, replicas=1, eval_steps=1, data_dir=str(tmp_path / "tfds"))
  with example_runs.mock_tfds(monkeypatch, num_examples=1):
    summary = training.train(shakespeare_lstm, config)
  example_runs.check_summary(summary, tmp_path, kinds=("recurrent", "dense", "vector"))
  # The LSTM's kernel and recurrent kernel are "recurrent"; embedding and output "dense".
  assert summary["compression"]["recurrent"]["ratio"] > 5
  assert summary["config"]["options"]["lstm_units"] == 32  # the run can be repeated


def test_text_files_are_concatenated_and_split(tmp_path):
  (tmp_path / "b.txt").write_text("KING. Speak.\n" * 10)
  (tmp_path / "a.txt").write_text("A" * 70)
  train, test = shakespeare_lstm.read_text_files(f"{tmp_path}/*.txt")
  assert train + test == "A" * 70 + "KING. Speak.\n" * 10  # sorted by path
  assert len(test) == 200 - int(200 * 0.95)
  config = flags_and_config.make_config(shakespeare_lstm, text_files=f"{tmp_path}/*.txt",
                                        seq_length=4)
  data = shakespeare_lstm.load_data(config)
  assert data.info["vocabulary_size"] == len(set(train)) + 1


def test_text_files_that_match_nothing_are_named(tmp_path):
  with pytest.raises(ValueError, match="text_files="):
    shakespeare_lstm.read_text_files(f"{tmp_path}/none*.txt")
