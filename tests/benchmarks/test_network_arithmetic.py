"""benchmarks/network.py's arithmetic, on made-up runs: the variants of --compressors,
the time and bytes to the target, and the estimates of runs stopped early. (No
namespaces, no training: fast tier.)"""

import statistics

import pytest

import benchmark_scripts  # noqa: F401  (benchmarks/ on sys.path)
import network

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
  assert parsed == expected
  assert parsed[:2] == expected[:2]  # the old (compressor, exchange) pair


@pytest.mark.parametrize("variant", [
    "adacomp+fast", "adacomp+H0", "adacomp+Hx", "adacomp+H", "adacomp+h8", "adacomp+H-1",
    "adacomp+H8+H8", "adacomp+H8+H16", "adacomp+updates+gradients", "adacomp+nesterov",
    "adacomp+H8+gradients", "+H8", "adacomp+"])
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
  assert adacomp["ratio_to_floor_time_to_target"] == pytest.approx(8.0 / 2.5)
  assert adacomp["speed_up_to_target_over_dense"] == pytest.approx(640 / 8.0)
  assert adacomp["speed_up_to_target_over_bf16"] == pytest.approx(300 / 8.0)
  assert adacomp["bytes_to_target_fewer_than_dense"] == pytest.approx(128000 / 80)
  assert adacomp["ratios_from_estimates"] == ["bf16", "none"]
  assert adacomp["compression_ratio"] == pytest.approx(400.0 / 2.0)
  assert adacomp["speed_up_over_dense"] == pytest.approx(20.0 / 0.2)
  assert adacomp["ratio_to_compute_only"] == pytest.approx(0.2 / 0.08)
  # Which ratios are estimates: those with an estimated row on either side.
  assert not network.ratio_is_estimated(adacomp, "ratio_to_floor_time_to_target")
  assert network.ratio_is_estimated(adacomp, "speed_up_to_target_over_dense")
  assert network.ratio_is_estimated(adacomp, "speed_up_to_target_over_bf16")
  assert network.ratio_is_estimated(adacomp, "bytes_to_target_fewer_than_dense")
  assert network.ratio_is_estimated(dense, "ratio_to_floor_time_to_target")

  measured = rows["100mbit", "adacomp"]
  assert measured["ratios_from_estimates"] == []
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
  assert "time_to_target_speed_up_over_dense_at_10mbit (>= 50): adacomp@10mbit ~80" in out
  assert "time_to_target_within_floor_at_100mbit (<= 1.3): none" in out
