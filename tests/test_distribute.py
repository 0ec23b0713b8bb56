"""Strategy helpers, and the harness that starts worker processes (tests/multi_worker.py).

The Keras multi-worker fix that ``multi_worker_strategy`` applies is tested with its
code, in tests/compat/test_keras_multi_worker.py.
"""

import json
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import tensorflow as tf

from multi_worker import PROJECT_ROOT, describe, run_workers
import tf_adacomp
from tf_adacomp import distribute
from tf_adacomp.compat import internals


# ---------------------------------------------------------------------------------------
# split_logical_devices

def test_split_logical_devices_already_configured_returns_names():
  # conftest.py split the CPU into 4 before TensorFlow initialised its devices.
  names = distribute.split_logical_devices(4)
  assert names == [f"/device:CPU:{i}" for i in range(4)]
  assert names == [d.name for d in tf.config.list_logical_devices("CPU")]
  assert distribute.split_logical_devices(4, device_type="cpu") == names
  assert tf.distribute.MirroredStrategy(names).num_replicas_in_sync == 4


def test_split_logical_devices_too_late_raises():
  with pytest.raises(RuntimeError, match=r"already initialised.*4 logical CPU.*count=2"):
    distribute.split_logical_devices(2)
  assert len(tf.config.list_logical_devices("CPU")) == 4  # unchanged


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(count=0), ValueError, r"Received: count=0"),
    (dict(count=-3), ValueError, r"Received: count=-3"),
    (dict(count=2.0), TypeError, r"Received: count=2\.0"),
    (dict(count=True), TypeError, r"Received: count=True"),
    (dict(count="4"), TypeError, r"Received: count='4'"),
    (dict(count=2, device_type="TPU"), ValueError, r"Received: device_type='TPU'"),
    (dict(count=2, device_type=None), TypeError, r"Received: device_type=None"),
    (dict(count=2, memory_limit=512), ValueError, r"Received: memory_limit=512"),
    (dict(count=2, device_type="GPU"), ValueError, r"Received: memory_limit=None"),
    (dict(count=2, device_type="GPU", memory_limit=0), ValueError, r"Received: memory_limit=0"),
    (dict(count=2, device_type="GPU", memory_limit="1G"), TypeError,
     r"Received: memory_limit='1G'"),
])
def test_split_logical_devices_bad_arguments(kwargs, error, message):
  with pytest.raises(error, match=message):
    distribute.split_logical_devices(**kwargs)


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")), reason="a GPU is present")
def test_split_logical_devices_without_gpu_raises():
  with pytest.raises(RuntimeError, match=r"No physical GPU"):
    distribute.split_logical_devices(2, device_type="GPU", memory_limit=1024)


@pytest.mark.slow
def test_split_logical_devices_in_a_fresh_process():
  """Before TensorFlow initialises: splits, and leaves the devices uninitialised."""
  code = textwrap.dedent("""
      import tensorflow as tf
      from tf_adacomp.distribute import split_logical_devices
      names = split_logical_devices(3)
      # Still configurable: split_logical_devices initialised nothing.
      assert split_logical_devices(2) == ["/device:CPU:0", "/device:CPU:1"]
      names = split_logical_devices(3)
      assert names == [d.name for d in tf.config.list_logical_devices("CPU")], names
      assert tf.distribute.MirroredStrategy(names).num_replicas_in_sync == 3
      assert split_logical_devices(3) == names  # already configured: fine
      try:
        split_logical_devices(5)
      except RuntimeError as e:
        assert "already initialised" in str(e)
      else:
        raise AssertionError("no RuntimeError")
      print("OK", names)
      """)
  result = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=120,
                          env={**_subprocess_env(), "CUDA_VISIBLE_DEVICES": ""})
  assert result.returncode == 0, result.stdout + result.stderr[-4000:]
  assert "OK ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2']" in result.stdout


def _subprocess_env():
  import os  # pylint: disable=g-import-not-at-top
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
  return env


# ---------------------------------------------------------------------------------------
# mirrored_strategy, multi_worker_strategy, tf_config

def _cpus():
  return [d.name for d in tf.config.list_logical_devices("CPU")]


def test_mirrored_strategy_without_compressor_is_plain():
  strategy = distribute.mirrored_strategy(devices=_cpus())
  assert type(strategy) is tf.distribute.MirroredStrategy  # pylint: disable=unidiomatic-typecheck
  assert strategy.num_replicas_in_sync == 4
  assert distribute.mirrored_strategy(devices=tuple(_cpus()[:2])).num_replicas_in_sync == 2
  assert tf.distribute.MirroredStrategy._collective_key_base == 0  # the class is untouched
  assert tf.compat.v1.distribute.MirroredStrategy._collective_key_base == 0  # and the v1 one


@pytest.mark.slow
def test_mirrored_strategies_made_after_the_import_have_collective_keys_of_their_own():
  """Plain MirroredStrategy objects share TensorFlow's collective keys until tf_adacomp is
  imported; those made afterwards have their own (README, limitations).

  Run in a fresh process: the collision aborts every collective of the process, so it
  comes last.
  """
  code = textwrap.dedent("""
      import numpy as np, tensorflow as tf, keras
      cpu = tf.config.list_physical_devices("CPU")[0]
      tf.config.set_logical_device_configuration(
          cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(2)])
      devices = ["/cpu:0", "/cpu:1"]

      def fit(strategy, width):
        x = np.random.rand(64, 8).astype("float32")
        y = np.random.randint(0, 3, 64).astype("int32")
        with strategy.scope():
          model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(width),
                                    keras.layers.Dense(3)])
          model.compile(keras.optimizers.SGD(0.1),
                        keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)

      before = [tf.distribute.MirroredStrategy(devices) for _ in range(2)]
      fit(before[0], 16)
      import tf_adacomp
      fit(tf.distribute.MirroredStrategy(devices), 4)  # another size: fine
      fit(tf_adacomp.distribute.mirrored_strategy(devices=devices), 8)
      print("OWN KEYS OK", flush=True)
      try:
        fit(before[1], 4)
      except tf.errors.InvalidArgumentError as e:
        print("PLAIN COLLIDES" if "Shape mismatch in the collective" in str(e) else e)
      """)
  result = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=120,
                          env={**_subprocess_env(), "CUDA_VISIBLE_DEVICES": ""})
  assert result.returncode == 0, result.stdout + result.stderr[-4000:]
  assert "OWN KEYS OK" in result.stdout, result.stdout + result.stderr[-4000:]
  # TensorFlow's behaviour, for strategies made before the import:
  assert "PLAIN COLLIDES" in result.stdout, result.stdout + result.stderr[-4000:]


def test_mirrored_strategy_with_compressor():
  cross_device_ops = pytest.importorskip("tf_adacomp.cross_device_ops")
  strategy = distribute.mirrored_strategy("adacomp", devices=_cpus(), dense_bin_size=100)
  assert isinstance(strategy, tf.distribute.MirroredStrategy)
  assert strategy.num_replicas_in_sync == 4
  ops = internals.cross_device_ops_of(strategy)
  assert isinstance(ops, cross_device_ops.CompressedAllReduce)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(devices="/device:CPU:0"), TypeError, r"Received: devices='/device:CPU:0'"),
    (dict(devices=[]), ValueError, r"Received: devices=\[\]"),
    (dict(devices=[0, 1]), TypeError, r"Received: devices=\[0, 1\]"),
    (dict(dense_bin_size=100), ValueError, r"Received: compressor=None, compressor_kwargs="),
    (dict(compressor="zip"), ValueError, r"Received: identifier='zip'"),
])
def test_mirrored_strategy_bad_arguments(kwargs, error, message):
  with pytest.raises(error, match=message):
    distribute.mirrored_strategy(**kwargs)


@pytest.mark.parametrize("value", ["{not json", "[1, 2]"])
def test_multi_worker_strategy_bad_tf_config(monkeypatch, value):
  monkeypatch.setenv("TF_CONFIG", value)
  with pytest.raises(ValueError, match=r"Received: TF_CONFIG="):
    distribute.multi_worker_strategy()


_GOOD_CLUSTER = {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]}


@pytest.mark.parametrize("config, message", [
    ({"task": {"type": "worker", "index": 0}},
     r'no "cluster".*Received: TF_CONFIG=\'\{"task"'),
    ({"cluster": ["h0:1"], "task": {}}, r'Received: TF_CONFIG\["cluster"\]=\[\'h0:1\'\]'),
    ({"cluster": {}, "task": {}}, r'Received: TF_CONFIG\["cluster"\]=\{\}'),
    ({"cluster": {"master": ["h0:1"]}, "task": {}},
     r'task types.*Received: TF_CONFIG\["cluster"\]\[\'master\'\]=\[\'h0:1\'\]'),
    ({"cluster": {"worker": "h0:1"}, "task": {}},
     r'Received: TF_CONFIG\["cluster"\]\[\'worker\'\]=\'h0:1\''),
    ({"cluster": {"worker": []}, "task": {}}, r'Received: TF_CONFIG\["cluster"\]\[\'worker\'\]=\[\]'),
    ({"cluster": {"chief": ["h0:1", "h1:1"]}, "task": {}}, r"at most one 'chief'.*h1:1"),
    ({"cluster": {"worker": ["h0:1", "h0"]}, "task": {}},
     r'port in 1\.\.65535\. Received: TF_CONFIG\["cluster"\]\[\'worker\'\]\[1\]=\'h0\''),
    ({"cluster": {"worker": ["h0:65536"]}, "task": {}}, r"\[0\]='h0:65536'"),
    ({"cluster": {"worker": ["h0:0"]}, "task": {}}, r"\[0\]='h0:0'"),
    ({"cluster": {"worker": [":1"]}, "task": {}}, r"\[0\]=':1'"),
    ({"cluster": {"worker": [2222]}, "task": {}}, r"\[0\]=2222"),
    ({"cluster": {"chief": ["h0:1"], "worker": ["h0:1"]}, "task": {}},
     r"repeat an address: 'h0:1' is both .*\['chief'\]\[0\] and .*\['worker'\]\[0\]"),
    ({"cluster": {"ps": ["h0:1"]}, "task": {}}, r'no "chief" or "worker" task'),
    ({"cluster": _GOOD_CLUSTER}, r'no "task".*Received: TF_CONFIG='),
    ({"cluster": _GOOD_CLUSTER, "task": "worker"}, r'Received: TF_CONFIG\["task"\]=\'worker\''),
    ({"cluster": _GOOD_CLUSTER, "task": {"type": "ps", "index": 0}},
     r"'chief', 'worker'\. Received: TF_CONFIG\[\"task\"\]=\{'type': 'ps'"),
    ({"cluster": _GOOD_CLUSTER, "task": {"index": 0}}, r"Received: TF_CONFIG\[\"task\"\]=\{'index': 0\}"),
    ({"cluster": _GOOD_CLUSTER, "task": {"type": "worker", "index": 2}},
     r"int in 0\.\.1 .*2 addresses\)\. Received: TF_CONFIG\[\"task\"\]=\{'type': 'worker', 'index': 2\}"),
    ({"cluster": _GOOD_CLUSTER, "task": {"type": "chief", "index": 1}}, r"int in 0\.\.0 "),
    ({"cluster": _GOOD_CLUSTER, "task": {"type": "worker", "index": "1"}}, r"'index': '1'"),
    ({"cluster": _GOOD_CLUSTER, "task": {"type": "worker", "index": True}}, r"'index': True"),
    ({"cluster": _GOOD_CLUSTER, "task": {"type": "worker", "index": -1}}, r"'index': -1"),
])
def test_multi_worker_strategy_malformed_tf_config(monkeypatch, config, message):
  """Checked before TensorFlow reads it: no strategy is made, TensorFlow is not touched."""
  monkeypatch.setenv("TF_CONFIG", json.dumps(config))
  with pytest.raises(ValueError, match=message):
    distribute.multi_worker_strategy()


@pytest.mark.parametrize("config, num_workers, message", [
    ({"cluster": _GOOD_CLUSTER, "task": {"type": "worker", "index": 0}}, 2,
     r"has 3 \(chief and worker tasks\)\. Received: num_workers=2, TF_CONFIG="),
    ({"cluster": {"worker": ["h0:1", "h1:1"], "evaluator": ["h2:1"]},
      "task": {"type": "evaluator", "index": 0}}, 3, r"has 2 .*Received: num_workers=3"),
    (None, 2, r"TF_CONFIG is not set, so the strategy would have 1\. "
              r"Received: num_workers=2, TF_CONFIG=None"),
])
def test_multi_worker_strategy_num_workers_mismatch(monkeypatch, config, num_workers, message):
  if config is None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
  else:
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
  with pytest.raises(ValueError, match=message):
    distribute.multi_worker_strategy(num_workers=num_workers)


@pytest.mark.parametrize("num_workers, error", [(0, ValueError), (2.0, TypeError),
                                                ("2", TypeError), (True, TypeError)])
def test_multi_worker_strategy_bad_num_workers(monkeypatch, num_workers, error):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  with pytest.raises(error, match=rf"Received: num_workers={num_workers!r}"):
    distribute.multi_worker_strategy(num_workers=num_workers)


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan"), "30", True])
def test_multi_worker_strategy_bad_collective_timeout(monkeypatch, timeout):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  with pytest.raises(ValueError, match=r"Received: collective_timeout="):
    distribute.multi_worker_strategy(collective_timeout=timeout)


@pytest.mark.parametrize("timeout", [0, 0.5, float("inf"), float("nan"), "30", True])
def test_multi_worker_strategy_bad_heartbeat_timeout(monkeypatch, timeout):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  with pytest.raises(ValueError, match=r"Received: heartbeat_timeout="):
    distribute.multi_worker_strategy(heartbeat_timeout=timeout)


def _worker_with_one_worker_more():
  """A worker of test_workers_whose_clusters_differ_fail_fast: worker 1's TF_CONFIG lists
  a third worker (at $EXTRA_WORKER, where nothing runs), worker 0's the two there are."""
  import os  # pylint: disable=g-import-not-at-top
  config = json.loads(os.environ["TF_CONFIG"])
  if config["task"]["index"] == 1:
    config["cluster"]["worker"].append(os.environ["EXTRA_WORKER"])
    os.environ["TF_CONFIG"] = json.dumps(config)
  try:
    distribute.multi_worker_strategy()
  except ValueError as error:
    print(f"REFUSED: {error}", flush=True)
    sys.exit(3)
  print("NOT REFUSED", flush=True)


@pytest.mark.slow
def test_workers_whose_clusters_differ_fail_fast(tmp_path):
  """Real processes: both workers fail at strategy creation naming their clusters.

  Without the check TensorFlow fails only at the first collective, with "joining a
  group with size3, but that group has size 2" (or 2 and 3). (The reverse, worker 0 listing the
  worker more, makes TensorFlow's start-up wait for it: see docs/distributed.md.)
  """
  from multi_worker import free_ports  # pylint: disable=g-import-not-at-top
  extra = f"127.0.0.1:{free_ports(1)[0]}"
  results = run_workers(_worker_with_one_worker_more, num_workers=2, timeout=90, grace=30,
                        out_dir=tmp_path, env={"EXTRA_WORKER": extra})
  assert [r.returncode for r in results] == [3, 3], describe(results)
  for result in results:
    assert "REFUSED: The workers could not compare their clusters" in result.stdout, \
        describe(results)
    # The group takes the size of whichever worker reaches the leader first.
    assert re.search(r"joining a group with size ?[23], but that group has size [23]",
                     result.stdout), describe(results)
  assert extra not in results[0].stdout and extra in results[1].stdout, describe(results)


def test_tf_config():
  config = json.loads(distribute.tf_config(["127.0.0.1:2222", "localhost:2223"], 1))
  assert config == {"cluster": {"worker": ["127.0.0.1:2222", "localhost:2223"]},
                    "task": {"type": "worker", "index": 1}}


@pytest.mark.parametrize("addresses, index, error, message", [
    ([], 0, ValueError, r"Received: worker_addresses=\[\]"),
    ("127.0.0.1:2222", 0, TypeError, r"Received: worker_addresses='127.0.0.1:2222'"),
    ([2222], 0, TypeError, r"Received: worker_addresses=\[2222\]"),
    (["127.0.0.1"], 0, ValueError, r"Received: worker_addresses=\['127.0.0.1'\]"),
    (["127.0.0.1:99999"], 0, ValueError, r"Received: worker_addresses="),
    (["h:1", "h:1"], 0, ValueError, r"must not repeat"),
    (["h:1", "h:2"], 2, ValueError, r"Received: index=2"),
    (["h:1", "h:2"], -1, ValueError, r"Received: index=-1"),
    (["h:1", "h:2"], "0", TypeError, r"Received: index='0'"),
])
def test_tf_config_bad_arguments(addresses, index, error, message):
  with pytest.raises(error, match=message):
    distribute.tf_config(addresses, index)


_TWO = ["127.0.0.1:20000", "127.0.0.1:20001"]  # nothing listens: no strategy is made


@pytest.mark.parametrize("config, warned", [
    (None, False),
    ({"cluster": {"worker": _TWO[:1]}, "task": {"type": "worker", "index": 0}}, False),
    ({"cluster": {"worker": _TWO}, "task": {"type": "worker", "index": 1}}, True),
    # A chief and a worker are two workers (TensorFlow's worker_count).
    ({"cluster": {"chief": _TWO[:1], "worker": _TWO[1:]},
      "task": {"type": "chief", "index": 0}}, True),
    # An evaluator runs alone by design, beside the workers.
    ({"cluster": {"worker": _TWO, "evaluator": ["127.0.0.1:20002"]},
      "task": {"type": "evaluator", "index": 0}}, False),
    # A TF_CONFIG that multi_worker_strategy refuses is left to its error.
    ({"cluster": {"worker": _TWO}}, False),
    ("{not json", False),
])
def test_a_worker_of_several_outside_a_multi_worker_strategy_is_warned(
    monkeypatch, config, warned):
  if config is None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
  else:
    monkeypatch.setenv("TF_CONFIG", config if isinstance(config, str) else json.dumps(config))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = distribute.warn_if_training_alone(tf.distribute.get_strategy(), "Wrapper")
  assert result is warned
  assert [w.category for w in caught] == [distribute.UnsynchronizedWorkersWarning] * warned
  if warned:
    assert "TF_CONFIG names 2 workers" in str(caught[0].message)
    assert "Wrapper is training under no tf.distribute strategy" in str(caught[0].message)
  # A job can make it an error (tf_adacomp exports the category).
  assert tf_adacomp.UnsynchronizedWorkersWarning is distribute.UnsynchronizedWorkersWarning
  with warnings.catch_warnings():
    warnings.simplefilter("error", tf_adacomp.UnsynchronizedWorkersWarning)
    if warned:
      with pytest.raises(tf_adacomp.UnsynchronizedWorkersWarning):
        distribute.warn_if_training_alone(tf.distribute.get_strategy(), "Wrapper")


# ---------------------------------------------------------------------------------------
# The harness itself (tests/multi_worker.py), with workers that do not load TensorFlow

@pytest.mark.slow
def test_run_workers_gives_each_worker_its_tf_config(tmp_path):
  from workers import probe  # pylint: disable=g-import-not-at-top
  for target in ("workers.probe:report", probe.report):
    results = run_workers(target, num_workers=3, timeout=60, env={"PROBE_EXTRA": "x"},
                          out_dir=tmp_path, args=["a", "b"])
    assert [r.returncode for r in results] == [0, 0, 0], describe(results)
    reports = [json.loads((tmp_path / f"probe{i}.json").read_text()) for i in range(3)]
    addresses = reports[0]["tf_config"]["cluster"]["worker"]
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)
    for i, report in enumerate(reports):
      assert report["index"] == i
      assert report["tf_config"] == {"cluster": {"worker": addresses},
                                     "task": {"type": "worker", "index": i}}
      assert report["argv"] == ["a", "b"]
      assert (report["cuda"], report["log_level"], report["extra"]) == ("", "2", "x")
      assert results[i].stdout == f"probe {i} done\n"


@pytest.mark.slow
def test_run_workers_kills_on_timeout_and_after_a_failure(tmp_path):
  results = run_workers("workers.probe:hang", num_workers=2, timeout=2, out_dir=tmp_path)
  assert all(r.returncode < 0 and "killed worker" in r.stderr for r in results)
  results = run_workers("workers.probe:first_fails", num_workers=2, timeout=120, grace=1,
                        out_dir=tmp_path)
  assert results[0].returncode == 3 and "worker 0 gives up" in results[0].stderr
  assert results[1].returncode < 0 and "killed worker 1" in results[1].stderr


def test_run_workers_bad_targets():
  with pytest.raises(ValueError, match=r"Received: target='nomodule'"):
    run_workers("nomodule")
  with pytest.raises(ValueError, match=r"Received: target="):
    run_workers(lambda: None)
  with pytest.raises(ValueError, match=r"Received: num_workers=0"):
    run_workers("workers.probe:report", num_workers=0)
