"""benchmarks/network.py's arithmetic, on made-up runs: the variants of --compressors,
the time and bytes to the target, the estimates of runs stopped early, and several
devices per worker (--devices_per_worker, +flat, the link's counters, accuracy at equal
samples). (No namespaces, no training: fast tier.)"""

import json
import statistics

import pytest

import benchmark_scripts  # noqa: F401  (benchmarks/ on sys.path)
import netns
import network
import network_worker

TARGET = 0.8


def make_run(step_seconds, step_bytes, evaluations, local_steps=1, stopped="target",
             compressor="adacomp", dense_bytes=400.0):
  """A worker's JSON as network_worker.py writes it (only the fields network.py reads)."""
  return {"compressor": compressor, "local_steps": local_steps, "stopped": stopped,
          "step_seconds": list(step_seconds),
          "median_step_seconds": statistics.median(step_seconds[1:]),
          "step_bytes_sent": list(step_bytes),
          "bytes_sent_per_step": sum(step_bytes) / len(step_bytes),
          "dense_bytes_per_step": dense_bytes,
          "evaluations": [{"step": s, "accuracy": a, "seconds": 0.0} for s, a in evaluations]}


# --- Variants ----------------------------------------------------------------------------


@pytest.mark.parametrize("variant,expected", [
    ("adacomp", ("adacomp", None, None, None)),
    ("adacomp+updates", ("adacomp", "updates", None, None)),
    ("adacomp+gradients", ("adacomp", "gradients", None, None)),
    ("none", ("none", None, None, None)),
    ("adacomp+H8", ("adacomp", None, 8, "average")),
    ("adacomp+H32+nesterov", ("adacomp", None, 32, "nesterov")),
    ("adacomp+nesterov+H8", ("adacomp", None, 8, "nesterov")),
    ("adacomp+H1", ("adacomp", None, 1, "average")),
    ("adacomp+updates+H8", ("adacomp", "updates", 8, "average")),
])
def test_split_variant(variant, expected):
  parsed = network.split_variant(variant)
  assert parsed[:4] == expected and parsed.hierarchical is None  # the library's exchange
  assert parsed[:2] == expected[:2]  # the old (compressor, exchange) pair


@pytest.mark.parametrize("variant,expected", [
    ("adacomp+flat", ("adacomp", None, None, None, False)),
    ("bf16+flat", ("bf16", None, None, None, False)),
    ("adacomp+updates+flat", ("adacomp", "updates", None, None, False)),
    ("adacomp+flat+H8", ("adacomp", None, 8, "average", False)),
    ("none+updates+flat", ("none", "updates", None, None, False)),  # CompressedOptimizer's
])
def test_split_variant_flat(variant, expected):
  assert network.split_variant(variant)[:5] == expected


@pytest.mark.parametrize("variant,auto,worker", [
    ("adacomp", None, None), ("adacomp+auto", True, "true"), ("bf16+auto", True, "true"),
    ("adacomp+H8+auto", True, "true"), ("none+updates+auto", True, "true"),
    ("adacomp+auto32", "float32", "float32")])
def test_split_variant_auto_reaches_the_worker(variant, auto, worker):
  assert network.split_variant(variant).auto == auto
  class Args:  # network.py's parsed arguments, as far as worker_argv reads them
    batch_size, width, max_steps, target_accuracy, eval_every = 64, 256, 64, None, 10
    threads, max_run_seconds, synthetic = 1, 30.0, False

  argv = network.worker_argv(Args, "cnn", variant, "/tmp/o.json")
  assert network_worker.parse(argv[2:]).auto == worker


@pytest.mark.parametrize("variant,logs", [
    ("adacomp", None), ("adacomp+H8+perlog", "per_value"), ("none+perlog", "per_value"),
    ("adacomp+H8+steplog", "every_step")])
def test_split_variant_log_reduction_reaches_the_worker(variant, logs):
  assert network.split_variant(variant).log_reduction == logs
  class Args:  # network.py's parsed arguments, as far as worker_argv reads them
    batch_size, width, max_steps, target_accuracy, eval_every = 64, 256, 64, None, 10
    threads, max_run_seconds, synthetic = 1, 30.0, False

  argv = network.worker_argv(Args, "cnn", variant, "/tmp/o.json")
  assert network_worker.parse(argv[2:]).log_reduction == (logs or "packed")


@pytest.mark.parametrize("eval_every,local_steps,interval", [
    (10, 1, 10), (10, 8, 8), (16, 8, 16), (20, 8, 16), (10, 32, 32), (7, 8, 8)])
def test_local_steps_are_evaluated_at_round_ends_at_least_as_often_as_asked(
    eval_every, local_steps, interval):
  assert network_worker.eval_interval(eval_every, local_steps) == interval


@pytest.mark.parametrize("variant", [
    "adacomp+fast", "adacomp+H0", "adacomp+Hx", "adacomp+H", "adacomp+h8", "adacomp+H-1",
    "adacomp+H8+H8", "adacomp+H8+H16", "adacomp+updates+gradients", "adacomp+nesterov",
    "adacomp+H8+gradients", "+H8", "adacomp+", "adacomp+flat+flat", "adacomp+Flat",
    "none+flat", "none+gradients+flat", "adacomp+perlog+perlog", "adacomp+Perlog", "none+auto", "adacomp+auto+auto",
    "adacomp+auto+auto32", "none+auto32",
    "adacomp+steplog", "adacomp+H8+steplog+perlog"])
def test_split_variant_names_the_bad_variant(variant):
  with pytest.raises(ValueError, match="Received: compressor=") as error:
    network.split_variant(variant)
  assert f"compressor={variant!r}" in str(error.value)


def test_worker_argv_passes_local_steps_and_the_outer_optimizer():
  class Args:  # network.py's parsed arguments, as far as worker_argv reads them
    batch_size, width, max_steps, target_accuracy, eval_every = 64, 256, 64, None, 10
    threads, max_run_seconds, synthetic = 1, 30.0, False

  argv = network.worker_argv(Args, "cnn", "adacomp+H8+nesterov", "/tmp/o.json")
  assert "--compressor=adacomp" in argv and "--local_steps=8" in argv
  assert "--outer_optimizer=nesterov" in argv and "--max_run_seconds=30.0" in argv
  assert "--target_accuracy=0.8" in argv  # the CNN's own target
  alone = network.worker_argv(Args, "cnn", "none", "/tmp/o.json", alone=True)
  assert "--alone" in alone and not any(a.startswith("--max_run_seconds") for a in alone)
  plain = network.worker_argv(Args, "mlp", "adacomp+updates", "/tmp/o.json")
  assert "--optimizer_exchange=updates" in plain
  assert not any(a.startswith(("--local_steps", "--outer_optimizer")) for a in plain)
  # One device per worker and no namespace: the command line as before.
  assert not any(a.startswith(("--devices_per_worker", "--flat", "--netns")) for a in plain)


def test_worker_argv_passes_devices_flat_and_the_namespace():
  class Args:
    batch_size, width, max_steps, target_accuracy, eval_every = 64, 256, 64, None, 10
    threads, max_run_seconds, synthetic = 1, 30.0, False

  argv = network.worker_argv(Args, "mlp", "adacomp+flat", "/tmp/o.json", devices=2,
                             namespace="tfac1h0")
  assert "--devices_per_worker=2" in argv and "--flat" in argv
  assert "--netns=tfac1h0" in argv and "--compressor=adacomp" in argv
  assert "--batch_size=64" in argv  # the worker's batch, whatever D
  hierarchical = network.worker_argv(Args, "mlp", "adacomp", "/tmp/o.json", devices=2)
  assert "--devices_per_worker=2" in hierarchical and "--flat" not in hierarchical
  # The floor trains alone: no devices, no namespace.
  alone = network.worker_argv(Args, "mlp", "none", "/tmp/o.json", alone=True, devices=2,
                              namespace="tfac1h0")
  assert not any(a.startswith(("--devices_per_worker", "--netns")) for a in alone)


@pytest.mark.parametrize("text,expected", [("1", [1]), ("1,2", [1, 2]), ("2,1,4", [2, 1, 4])])
def test_parse_devices(text, expected):
  assert network.parse_devices(text, 64) == expected


@pytest.mark.parametrize("text,match", [
    ("0", "devices_per_worker='0'"), ("1,1", "devices_per_worker='1,1'"),
    ("two", "devices_per_worker='two'"), ("", "devices_per_worker=''"),
    ("1,3", "devices_per_worker=3, batch_size=64")])
def test_parse_devices_names_the_bad_value(text, match):
  with pytest.raises(ValueError, match=match):
    network.parse_devices(text, 64)


def test_main_rejects_bad_devices_and_flat_dense_before_any_namespace(capsys):
  for argv in (["--devices_per_worker", "1,3"], ["--compressors", "none+flat"]):
    with pytest.raises(SystemExit):
      network.main(argv)
  err = capsys.readouterr().err
  assert "devices_per_worker=3, batch_size=64" in err and "compressor='none+flat'" in err


def test_worker_parse_devices_and_flat():
  args = network_worker.parse(["--out=/tmp/o.json", "--devices_per_worker=2", "--flat",
                               "--netns=tfac1h0"])
  assert args.devices_per_worker == 2 and args.flat and args.netns == "tfac1h0"
  assert args.link_device == "eth0"
  with pytest.raises(SystemExit):
    network_worker.parse(["--out=/tmp/o.json", "--devices_per_worker=3"])  # 64 / 3


def test_with_options_forces_the_arguments_for_the_call_only():
  class Optimizer:
    def __init__(self, inner, hierarchical=None, dense_when_faster=False):
      self.inner, self.hierarchical = inner, hierarchical
      self.dense_when_faster = dense_when_faster

  class Package:
    CompressedOptimizer = Optimizer

  made = network_worker.with_options(
      Package, {"hierarchical": False, "dense_when_faster": True},
      lambda: Package.CompressedOptimizer("sgd", hierarchical=None))
  assert made.hierarchical is False and made.dense_when_faster is True
  assert Package.CompressedOptimizer is Optimizer
  plain = network_worker.with_options(Package, {}, lambda: Package.CompressedOptimizer("sgd"))
  assert plain.hierarchical is None and plain.dense_when_faster is False


# --- The link's counters -------------------------------------------------------------------


def _ip_json(device, tx, rx, key="stats64"):
  return json.dumps([{"ifname": "lo", key: {"tx": {"bytes": 1, "packets": 1},
                                            "rx": {"bytes": 1, "packets": 1}}},
                     {"ifname": device, key: {"tx": {"bytes": tx, "packets": tx // 1000},
                                              "rx": {"bytes": rx, "packets": rx // 1000}}}])


def test_parse_link_counters():
  assert netns.parse_link_counters(_ip_json("eth0", 5000, 7000), "eth0") == {
      "tx_bytes": 5000, "rx_bytes": 7000, "tx_packets": 5, "rx_packets": 7}
  old = netns.parse_link_counters(_ip_json("eth0", 2000, 1000, key="stats"), "eth0")
  assert old["tx_bytes"] == 2000  # iproute2 without 64-bit counters
  with pytest.raises(ValueError, match="'eth1'"):
    netns.parse_link_counters(_ip_json("eth0", 1, 1), "eth1")


def test_link_per_step_leaves_the_first_step_out():
  def counters(tx, rx):
    return {"tx_bytes": tx, "rx_bytes": rx, "tx_packets": tx // 100, "rx_packets": rx // 100}

  begin, first, end = counters(1000, 500), counters(51000, 40500), counters(91000, 80500)
  per_step = network_worker.link_per_step(begin, first, end, steps=5)
  assert per_step["tx_bytes"] == pytest.approx(40000 / 4)  # steps 2 to 5
  assert per_step["rx_bytes"] == pytest.approx(40000 / 4)
  # One step: the whole run's.
  assert network_worker.link_per_step(begin, first, first, 1)["tx_bytes"] == 50000
  assert netns.counter_deltas(begin, end) == {"tx_bytes": 90000, "rx_bytes": 80000,
                                              "tx_packets": 900, "rx_packets": 800}


def test_link_bytes_per_step_is_the_mean_of_the_workers():
  run = {"link_bytes_per_step_workers": [{"tx_bytes": 100.0, "rx_bytes": 300.0},
                                         {"tx_bytes": 200.0, "rx_bytes": 100.0}]}
  assert network.link_bytes_per_step(run) == pytest.approx(150.0)
  assert network.link_bytes_per_step(run, "rx") == pytest.approx(200.0)
  assert network.link_bytes_per_step({}) is None  # not measured (an older JSON)
  assert network.link_bytes_per_step({"link_bytes_per_step_workers": [None, None]}) is None


# --- Time and bytes to the target --------------------------------------------------------


def test_one_step_a_round_counts_the_first_step_at_the_median():
  run = make_run([5.0, 1.0, 2.0, 1.0, 1.0, 1.0], [10, 10, 10, 10, 10, 10],
                 [(2, 0.5), (4, 0.85), (6, 0.9)])
  assert network.steps_to_accuracy(run, TARGET) == 4
  assert network.step_times(run) == [1.0, 1.0, 2.0, 1.0, 1.0, 1.0]
  assert network.time_to_accuracy(run, TARGET) == pytest.approx(1.0 + 1.0 + 2.0 + 1.0)
  assert network.bytes_to_accuracy(run, TARGET) == 40
  assert network.mean_step_seconds(run) == pytest.approx(7.0 / 6)
  assert network.steps_to_accuracy(run, 0.95) is None
  assert network.time_to_accuracy(run, 0.95) is None
  assert network.bytes_to_accuracy(run, 0.95) is None
  assert network.steps_to_accuracy(run, 0.0) is None  # no target


def test_local_steps_count_the_first_round_end_at_the_median_round_end():
  # H = 4: step 1 traces (3 s), step 4 compiles the compressor (7 s); local steps take
  # 0.1 s and send nothing, later round ends 0.5 s and send their bytes.
  h = 4
  seconds, nbytes = [], []
  for step in range(1, 13):
    end = step % h == 0
    seconds.append(3.0 if step == 1 else 7.0 if step == h else 0.5 if end else 0.1)
    nbytes.append((100 + step) if end else 0)
  run = make_run(seconds, nbytes, [(4, 0.5), (8, 0.81), (12, 0.9)], local_steps=h)
  times = network.step_times(run)
  assert times[0] == pytest.approx(0.1) and times[h - 1] == pytest.approx(0.5)
  assert network.time_to_accuracy(run, TARGET) == pytest.approx(6 * 0.1 + 2 * 0.5)
  assert network.bytes_to_accuracy(run, TARGET) == 104 + 108  # round ends only
  assert network.mean_step_seconds(run) == pytest.approx((9 * 0.1 + 3 * 0.5) / 12)
  # The median step is a local one, which sends nothing: the mean is not.
  assert run["median_step_seconds"] == pytest.approx(0.1)


def test_a_single_round_end_keeps_its_compilation():
  run = make_run([3.0, 0.1, 0.1, 7.0], [0, 0, 0, 50], [(4, 0.9)], local_steps=4)
  assert network.step_times(run) == pytest.approx([0.1, 0.1, 0.1, 7.0])


def test_a_run_stopped_at_the_time_limit_is_estimated_from_borrowed_steps():
  capped = make_run([9.0, 2.0, 3.0, 2.0], [400] * 4, [(4, 0.6)], stopped="max_run_seconds",
                    compressor="none")
  result = network.to_target(capped, TARGET, borrowed_steps=40)
  assert result == {"steps_to_target": 40, "estimated": True,
                    "time_to_target_seconds": pytest.approx(40 * (2 + 2 + 3 + 2) / 4),
                    "bytes_to_target": pytest.approx(40 * 400)}
  # No estimate without borrowed steps, for a run that ran all its steps, or for one
  # already past the borrowed count without reaching the target.
  nothing = {"steps_to_target": None, "time_to_target_seconds": None,
             "bytes_to_target": None, "estimated": False}
  assert network.to_target(capped, TARGET) == nothing
  assert network.to_target(dict(capped, stopped="max_steps"), TARGET, 40) == nothing
  assert network.to_target(capped, TARGET, borrowed_steps=4) == nothing
  # A run that reached the target is measured, whatever was borrowed.
  reached = make_run([9.0, 2.0, 2.0, 2.0], [400] * 4, [(2, 0.6), (4, 0.85)])
  assert network.to_target(reached, TARGET, borrowed_steps=40) == {
      "steps_to_target": 4, "time_to_target_seconds": pytest.approx(8.0),
      "bytes_to_target": 1600, "estimated": False}


def _runs():
  """mlp on three links: dense and bf16 stop at the time limit on 10mbit; adacomp
  reaches the target everywhere (at step 30 on 1gbit, 40 on 100mbit)."""
  def reached(seconds, nbytes, steps, compressor):
    return make_run([seconds] * steps, [nbytes] * steps, [(steps, 0.85)],
                    compressor=compressor)

  def capped(seconds, nbytes, steps, compressor):
    return make_run([seconds] * steps, [nbytes] * steps, [(steps, 0.5)],
                    stopped="max_run_seconds", compressor=compressor)

  return {("mlp", "10mbit", "none"): capped(20.0, 4000.0, 3, "none"),
          ("mlp", "10mbit", "bf16"): capped(10.0, 2000.0, 6, "bf16"),
          ("mlp", "10mbit", "adacomp"): reached(0.2, 2.0, 40, "adacomp"),
          ("mlp", "100mbit", "none"): reached(2.0, 4000.0, 30, "none"),
          ("mlp", "100mbit", "bf16"): reached(1.0, 2000.0, 30, "bf16"),
          ("mlp", "100mbit", "adacomp"): reached(0.1, 2.0, 40, "adacomp"),
          ("mlp", "1gbit", "none"): reached(0.3, 4000.0, 32, "none"),
          ("mlp", "1gbit", "bf16"): {"compressor": "bf16", "failed": True},
          ("mlp", "1gbit", "adacomp"): reached(0.1, 2.0, 30, "adacomp")}


def test_summarize_estimates_from_the_fastest_link_and_marks_every_ratio_it_enters():
  runs = _runs()
  rates, variants = ["10mbit", "100mbit", "1gbit"], ["none", "bf16", "adacomp"]
  assert network.borrowed_steps("mlp", rates, "none", runs, TARGET) == ("1gbit", 32)
  # bf16 failed on 1gbit: its steps come from the fastest link where it reached the target.
  assert network.borrowed_steps("mlp", rates, "bf16", runs, TARGET) == ("100mbit", 30)
  assert network.borrowed_steps("mlp", rates, "topk", runs, TARGET) is None
  floor = {"time_to_target_seconds": 2.5, "median_step_seconds": 0.08,
           "step_seconds": [0.08] * 30, "evaluations": []}
  rows = {(r["rate"], r["compressor"]): r
          for r in network.summarize("mlp", rates, variants, runs, floor, TARGET)}
  assert rows["1gbit", "bf16"] == {"model": "mlp", "rate": "1gbit", "compressor": "bf16",
                                   "failed": True}

  dense, bf16, adacomp = (rows["10mbit", v] for v in variants)
  assert dense["estimated"] and dense["steps_to_target_from"] == "1gbit"
  assert dense["steps_to_target"] == 32
  assert dense["time_to_target_seconds"] == pytest.approx(32 * 20.0)
  assert dense["bytes_to_target"] == pytest.approx(32 * 4000.0)
  assert bf16["estimated"] and bf16["steps_to_target_from"] == "100mbit"
  assert bf16["time_to_target_seconds"] == pytest.approx(30 * 10.0)
  assert not adacomp["estimated"] and "steps_to_target_from" not in adacomp
  assert adacomp["time_to_target_seconds"] == pytest.approx(40 * 0.2)
  assert adacomp["bytes_to_target"] == pytest.approx(80.0)
  assert adacomp["ratio_to_alone_time_to_target"] == pytest.approx(8.0 / 2.5)
  # The strict floor: dense's steps to the target on the same link (here estimated: 32)
  # times the compute-only run's mean step (0.08 s).
  assert adacomp["strict_floor_seconds"] == pytest.approx(32 * 0.08)
  assert adacomp["ratio_to_strict_floor_time_to_target"] == pytest.approx(8.0 / 2.56)
  assert adacomp["speed_up_to_target_over_dense"] == pytest.approx(640 / 8.0)
  assert adacomp["speed_up_to_target_over_bf16"] == pytest.approx(300 / 8.0)
  assert adacomp["bytes_to_target_fewer_than_dense"] == pytest.approx(128000 / 80)
  assert adacomp["ratios_from_estimates"] == ["bf16", "none"]
  assert adacomp["compression_ratio"] == pytest.approx(400.0 / 2.0)
  assert adacomp["speed_up_over_dense"] == pytest.approx(20.0 / 0.2)
  assert adacomp["ratio_to_compute_only"] == pytest.approx(0.2 / 0.08)
  # Which ratios are estimates: those with an estimated row on either side.
  assert not network.ratio_is_estimated(adacomp, "ratio_to_alone_time_to_target")
  assert network.ratio_is_estimated(adacomp, "ratio_to_strict_floor_time_to_target")
  assert network.ratio_is_estimated(adacomp, "speed_up_to_target_over_dense")
  assert network.ratio_is_estimated(adacomp, "speed_up_to_target_over_bf16")
  assert network.ratio_is_estimated(adacomp, "bytes_to_target_fewer_than_dense")
  assert network.ratio_is_estimated(dense, "ratio_to_alone_time_to_target")

  measured = rows["100mbit", "adacomp"]
  assert measured["ratios_from_estimates"] == []
  assert measured["ratio_to_strict_floor_time_to_target"] == pytest.approx(4.0 / (30 * 0.08))
  assert not network.ratio_is_estimated(measured, "ratio_to_strict_floor_time_to_target")
  # Where dense failed, or never reached the target, there is no strict floor.
  assert network.strict_floor(measured, {"failed": True}, floor) == {
      "strict_floor_seconds": None, "ratio_to_strict_floor_time_to_target": None}
  assert measured["speed_up_to_target_over_dense"] == pytest.approx(60.0 / 4.0)
  assert rows["1gbit", "adacomp"]["speed_up_to_target_over_bf16"] is None  # bf16 failed
  assert rows["100mbit", "none"]["speed_up_to_target_over_dense"] == pytest.approx(1.0)


def test_the_table_and_the_targets_mark_estimates(capsys):
  runs = _runs()
  floor = {"time_to_target_seconds": 2.5, "median_step_seconds": 0.08,
           "step_seconds": [0.08] * 30, "evaluations": []}
  rows = network.summarize("mlp", ["10mbit", "100mbit", "1gbit"],
                           ["none", "bf16", "adacomp"], runs, floor, TARGET)
  network.print_rows(rows)
  network.print_targets(rows)
  out = capsys.readouterr().out
  dense_10 = next(line for line in out.splitlines()
                  if line.split()[:3] == ["mlp", "10mbit", "none"])
  assert "~32" in dense_10 and "~640.0" in dense_10
  ada_10 = next(line for line in out.splitlines()
                if line.split()[:3] == ["mlp", "10mbit", "adacomp"])
  assert "~80x" in ada_10 and "~37.5x" in ada_10 and "3.20x" in ada_10
  assert "~3.13x" in ada_10  # over the strict floor: dense's steps there are estimated
  ada_100 = next(line for line in out.splitlines()
                 if line.split()[:3] == ["mlp", "100mbit", "adacomp"])
  assert "1.67x" in ada_100 and "1.60x" in ada_100  # /strict (4.0 / 2.4), /alone
  assert "time_to_target_speed_up_over_dense_at_10mbit (>= 50): adacomp@10mbit ~80" in out
  assert ("time_to_target_within_strict_floor_at_100mbit (<= 1.3): none; not met: "
          "adacomp@100mbit 1.67") in out


# --- Several devices per worker -------------------------------------------------------------


def _device_runs():
  """mlp on 100mbit at D = 1 and 2 (keyed as measure keys them): dense D2 stops at the time
  limit before the target; adacomp D2 (hierarchical) reaches it at step 30 like D1, its
  +flat twin at step 40."""
  def run(seconds, nbytes, evaluations, stopped="target", compressor="adacomp", devices=1,
          link=None):
    steps = evaluations[-1][0]
    made = make_run([seconds] * steps, [nbytes] * steps, evaluations, stopped=stopped,
                    compressor=compressor)
    made["devices_per_worker"] = devices
    made["link_bytes_per_step_workers"] = [{"tx_bytes": link, "rx_bytes": link}] * 2
    return made

  curve = [(10, 0.6), (20, 0.75), (30, 0.81)]
  return {
      ("mlp", "100mbit", "none", 1): run(2.0, 400.0, [(10, 0.6), (20, 0.8)], compressor="none",
                                         link=420.0),
      ("mlp", "100mbit", "adacomp", 1): run(0.1, 4.0, curve, link=9.0),
      ("mlp", "100mbit", "adacomp+flat", 1): run(0.1, 4.0, curve, compressor="adacomp+flat",
                                                 link=9.0),
      ("mlp", "100mbit", "none", 2): run(3.0, 400.0, [(10, 0.6)], stopped="max_run_seconds",
                                         compressor="none", devices=2, link=630.0),
      ("mlp", "100mbit", "adacomp", 2): run(0.08, 4.0, curve, devices=2, link=9.5),
      ("mlp", "100mbit", "adacomp+flat", 2): run(
          0.2, 8.0, [(10, 0.55), (20, 0.7), (30, 0.78), (40, 0.82)],
          compressor="adacomp+flat", devices=2, link=30.0),
  }


def _device_rows():
  floor = {"time_to_target_seconds": 2.5, "median_step_seconds": 0.08,
           "step_seconds": [0.08] * 30, "evaluations": []}
  rows = network.summarize_devices("mlp", ["100mbit"], ["none", "adacomp", "adacomp+flat"],
                                   [1, 2], _device_runs(), floor, TARGET)
  return {(r["compressor"], r["devices_per_worker"]): r for r in rows}


def test_equal_step_leaves_out_runs_cut_short():
  runs = _device_runs()
  # Dense D2 stopped at step 10 (the time limit): S is the last step every other run
  # evaluated, 20 (dense D1 stopped there, at its target).
  assert network.equal_step(list(runs.values())) == 20
  assert network.equal_step([runs["mlp", "100mbit", "none", 2]]) == 10  # all cut short
  assert network.equal_step([]) is None
  flat = runs["mlp", "100mbit", "adacomp+flat", 2]
  assert network.accuracy_at_step(flat, 20) == (0.7, pytest.approx(0.625))
  assert network.accuracy_at_step(flat, 25) == (0.7, pytest.approx(0.625))  # last at or before
  assert network.accuracy_at_step(runs["mlp", "100mbit", "none", 2], 20) == (None, None)
  assert network.accuracy_at_step({"failed": True}, 20) == (None, None)


def test_summarize_devices_compares_d_against_one_and_hierarchical_against_flat():
  rows = _device_rows()
  assert {r["devices_per_worker"] for r in rows.values()} == {1, 2}
  ada1, ada2, flat2 = rows["adacomp", 1], rows["adacomp", 2], rows["adacomp+flat", 2]
  assert ada2["time_to_target_seconds"] == pytest.approx(30 * 0.08)
  assert ada2["time_to_target_over_one_device"] == pytest.approx(0.08 / 0.1)
  assert not network.ratio_is_estimated(ada2, "time_to_target_over_one_device")
  assert "time_to_target_over_one_device" not in ada1  # D = 1: nothing to compare with
  # Equal samples: step 20 for every row; hierarchical 0.75 against flat 0.70.
  assert {r["equal_step"] for r in rows.values()} == {20}
  assert ada2["accuracy_at_equal_step"] == pytest.approx(0.75)
  assert ada2["mean_accuracy_to_equal_step"] == pytest.approx(0.675)
  assert ada2["accuracy_at_equal_step_over_flat"] == pytest.approx(0.05)
  assert ada2["flat_variant"] == "adacomp+flat"
  assert ada1["accuracy_at_equal_step_over_flat"] == pytest.approx(0.0)
  assert "accuracy_at_equal_step_over_flat" not in flat2  # flat has no flat twin
  assert "accuracy_at_equal_step_over_flat" not in rows["none", 2]  # nor dense
  assert rows["none", 2]["accuracy_at_equal_step"] is None  # stopped before step 20
  # The link's bytes per step beside the worker's own count.
  assert flat2["link_tx_bytes_per_step"] == pytest.approx(30.0)
  assert flat2["bytes_sent_per_step"] == pytest.approx(8.0)
  # Dense D2 reached the target on no link at D = 2: its steps come from D = 1's.
  dense2 = rows["none", 2]
  assert dense2["estimated"] and dense2["steps_to_target_from"] == "100mbit D1"
  assert dense2["steps_to_target"] == 20
  assert dense2["time_to_target_seconds"] == pytest.approx(20 * 3.0)
  assert dense2["time_to_target_over_one_device"] == pytest.approx(60.0 / 40.0)
  assert network.ratio_is_estimated(dense2, "time_to_target_over_one_device")
  # Ratios to dense stay within one D: adacomp D2 against dense D2 (an estimate).
  assert ada2["speed_up_to_target_over_dense"] == pytest.approx(60.0 / 2.4)
  assert ada2["ratios_from_estimates"] == ["none"]


def test_the_table_and_the_targets_show_devices(capsys):
  rows = list(_device_rows().values())
  network.print_rows(rows)
  network.print_targets(rows)
  out = capsys.readouterr().out
  ada2 = next(line for line in out.splitlines()
              if line.split()[:4] == ["mlp", "100mbit", "adacomp", "2"])
  assert "10 B" in ada2 and "4 B" in ada2 and "0.750" in ada2  # link 9.5, sent 4
  assert ("time_to_target_with_devices_no_worse_than_one_at_100mbit (<= 1): "
          "adacomp@100mbit D2 0.8; not met: adacomp+flat@100mbit D2 2.67") in out
  assert ("accuracy_at_equal_samples_at_least_flat (>= 0): adacomp@100mbit 0, "
          "adacomp@100mbit D2 0.05") in out


def test_json_keys_and_labels():
  assert network.json_key(("mlp", "100mbit", "adacomp", 1)) == "mlp/100mbit/adacomp"
  assert network.json_key(("mlp", "100mbit", "adacomp+flat", 2)) == "mlp/100mbit/adacomp+flat/D2"
  assert network.row_label({"compressor": "bf16", "devices_per_worker": 2}) == "bf16 D2"
  assert network.row_label({"compressor": "bf16"}) == "bf16"
