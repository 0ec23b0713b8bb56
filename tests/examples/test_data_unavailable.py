"""The examples without their data, as a user's machine may be: no network, no prepared
``--data_dir``, no ImageNet archives, no ``--text_files``.

tfds' real download path must be installed (``pip install -e .[examples]``) and fail on
the network, and every example must then stop with one message naming the ways out.
(The other example tests replace tfds' builders with ``tfds.testing.mock_data``.)
"""

import os
import pathlib
import subprocess
import sys

import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import example_runs
from example_runs import no_network  # pylint: disable=unused-import  (a fixture)
from tf_adacomp.examples import cifar10_resist
from tf_adacomp.examples import cifar10_resnet
from tf_adacomp.examples import distribution
from tf_adacomp.examples import fashion_mnist
from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import imagenet_resnet50
from tf_adacomp.examples import input_data
from tf_adacomp.examples import shakespeare_lstm
from tf_adacomp.examples import shakespeare_transformer
from tf_adacomp.examples import training


@pytest.mark.usefixtures("no_network")
def test_tfds_download_reaches_the_network_without_import_errors(tmp_path):
  """tfds' own cifar10 builder and downloader, up to the connection: the package's
  extras install everything on the way (tfds 4.9.10 needs importlib_resources there)."""
  from tensorflow_datasets.core.download import downloader  # pylint: disable=g-import-not-at-top

  builder = tfds.builder("cifar10", data_dir=str(tmp_path))
  # requests' ConnectionError, as tfds' downloader raises it (not an ImportError).
  with pytest.raises(downloader.requests.exceptions.ConnectionError,
                     match=example_runs.NETWORK_BLOCKED):
    builder.download_and_prepare()


# (example, its settings, what the message must name besides --data_dir and --synthetic)
NO_DATA = [
    (cifar10_resnet, {}, ["No cifar10 data", "--dataset=fashion_mnist"]),
    (cifar10_resist, {}, ["No cifar10 data", "--dataset=fashion_mnist"]),
    # Fashion-MNIST's IDX files missing too: its own ways out.
    (cifar10_resnet, {"dataset": "fashion_mnist"},
     ["No fashion_mnist data", "apt-get install dataset-fashion-mnist",
      "train-images-idx3-ubyte.gz"]),
    (fashion_mnist, {}, ["No fashion_mnist data", "apt-get install dataset-fashion-mnist",
                         "train-images-idx3-ubyte.gz"]),
    (shakespeare_lstm, {}, ["No tiny_shakespeare data", "--text_files=PATTERNS"]),
    (shakespeare_transformer, {}, ["No tiny_shakespeare data", "--text_files=PATTERNS"]),
    (imagenet_resnet50, {}, ["No imagenet2012 data", "--manual_dir=DIR",
                             "ILSVRC2012_img_train.tar", "manual_dir=None"]),
]


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("example,settings,names", NO_DATA,
                         ids=[f"{e.NAME}-{'-'.join(s.values()) or 'default'}"
                              for e, s, _ in NO_DATA])
def test_an_example_without_data_names_the_ways_out(example, settings, names, tmp_path,
                                                    monkeypatch):
  monkeypatch.setattr(fashion_mnist, "DEBIAN_DIR", str(tmp_path / "absent"))
  data_dir = str(tmp_path / "tfds")
  config = flags_and_config.make_config(example, data_dir=data_dir, **settings)
  with pytest.raises(input_data.DataUnavailable) as raised:
    example.load_data(config)
  message = str(raised.value)
  # At once, from the examples' probe of the download hosts (tfds' downloader would
  # retry for minutes); ImageNet downloads nothing: tfds' own manual_dir error.
  for name in names + ["no connection to" if example is not imagenet_resnet50 else
                       "AssertionError", "--data_dir=DIR", "--synthetic",
                       f"Received: data_dir={data_dir!r}"]:
    assert name in message, (name, message)
  assert "\n" not in message and len(message) < 1000, message  # one line, short


@pytest.mark.usefixtures("no_network")
def test_the_main_exits_with_the_message_alone(tmp_path, monkeypatch):
  """training.run, every example's main: no data is a message and a non-zero exit
  (SystemExit with a string: Python prints it, no traceback), not an exception."""
  config = flags_and_config.make_config(cifar10_resnet, data_dir=str(tmp_path),
                                        xla_cache=False)
  monkeypatch.setattr(flags_and_config, "config_from_flags", lambda example: config)
  # The default strategy: splitting this process's CPU again (--replicas) would fail
  # once TensorFlow has started here.
  monkeypatch.setattr(distribution, "make_strategy", lambda config: tf.distribute.get_strategy())
  with pytest.raises(SystemExit) as raised:
    training.run(cifar10_resnet, ["cifar10_resnet.py"])
  assert isinstance(raised.value.code, str)  # exit status 1, the string on stderr
  assert raised.value.code.startswith("cifar10_resnet: No cifar10 data: ")


@pytest.mark.slow
def test_the_command_without_data_prints_one_message_and_fails(tmp_path):
  """`tf-adacomp train cifar10_resnet` as a user runs it, on a machine without network."""
  script = pathlib.Path(sys.executable).parent / "tf-adacomp"
  env = example_runs.env_without_network(tmp_path / "site", {
      k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"})
  result = subprocess.run([script, "train", "cifar10_resnet", "--epochs=1",
                           f"--data_dir={tmp_path / 'tfds'}"], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
  output = result.stdout + result.stderr
  assert result.returncode == 1, output[-3000:]
  assert "Traceback" not in output, output[-3000:]
  lines = [line for line in result.stderr.splitlines() if "cifar10_resnet:" in line]
  assert len(lines) == 1 and lines[0].startswith("cifar10_resnet: No cifar10 data: "), output
  for way in ("--data_dir=DIR", "--dataset=fashion_mnist", "--synthetic"):
    assert way in lines[0]


@pytest.mark.usefixtures("no_network")
def test_the_probe_names_the_host_and_leaves_proxies_to_tfds(tmp_path, monkeypatch):
  builder = tfds.builder("cifar10", data_dir=str(tmp_path))
  assert input_data.unreachable_download_host(builder) == "www.cs.toronto.edu"
  monkeypatch.setenv("https_proxy", "http://proxy.invalid:3128")  # only tfds' requests
  assert input_data.unreachable_download_host(builder) is None      # go through it
