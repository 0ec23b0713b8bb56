"""Training over slow links, to the limit: time and bytes to a target accuracy.

Each worker process runs in its own Linux network namespace; the namespaces are joined
by a bridge whose ports are limited with ``tc ... tbf`` to --rates
(benchmarks/netns.py), so the workers' gRPC collectives cross a 10 Mbit/s, 100 Mbit/s
or 1 Gbit/s link as they would between machines. For each model (a wide MLP
784-2048-2048-10 of 5.8M parameters, communication-heavy; the Fashion-MNIST CNN of
examples/fashion_mnist.py, 0.42M; ResNet-20, 0.27M, compute-heavy) and each variant of
--compressors, the workers train Fashion-MNIST (benchmarks/network_worker.py) until
the model's target accuracy, recording every step's time and bytes sent and the test
accuracy every --eval_every steps.

Variants: a compressor name (none: the dense float32 all-reduce; bf16; adacomp, the
library's default) with optional suffixes: ``+gradients`` or ``+updates`` pick
CompressedOptimizer's exchange; ``+H8`` runs rounds of 8 local steps whose
pseudo-updates are compressed, exchanged and averaged (local_steps=8,
outer_optimizer="average"); ``+H8+nesterov`` steps them with DiLoCo's outer Nesterov
SGD instead. With local steps the workers evaluate (and stop) only at round ends.
``+flat`` gives CompressedOptimizer ``hierarchical=False`` (below). ``+steplog`` (with
``+H``) averages the logs across workers on every step, as the library did before it
averaged them at round ends only (``tf_adacomp.step_logs``). ``+perlog`` averages
the logs across workers with one all-reduce per logged value, as the library did before
it packed them into one (a baseline: network_worker.py). ``+auto`` gives
CompressedOptimizer ``dense_when_faster=True``: the fastest of the compressed exchange
and the dense all-reduces, float32 and bf16, as it measures them in the run
(``exchange_choice`` in the JSON says which it chose); ``+auto32`` gives
``dense_when_faster="float32"``, the float32 all-reduce the only dense candidate.

Several devices per worker: --devices_per_worker 1,2 runs every variant with each
worker's strategy on 1, then 2 local replicas (logical CPUs; network_worker.py). The
worker's batch stays --batch_size (each replica trains on batch_size / D), so runs at
any D see the same samples per step. With D > 1 CompressedOptimizer by default sums a
worker's replicas locally and sends one payload per worker (the hierarchical
exchange); ``+flat`` makes every replica send its own (hierarchical=False); dense
(``none``) is Keras' own all-reduce over all the replicas.

Bytes over the link: each worker reads its link's counters (``ip -n NS -s -j link show
eth0``, benchmarks/netns.py) after its first step and at the end of training:
``link B/step`` is what a worker really sent over its link per step (TCP/IP headers,
gRPC, heartbeats and the stop-decision all-reduce included; the mean of the workers),
printed beside ``sent B/step``, the worker's own count (CompressedOptimizer's
``bytes_sent``; 4 bytes per parameter for dense). ``acc@S`` is the test accuracy at
the same step S (= the same samples) for every run of a model: the last evaluation
that every run which was not cut short by --max_run_seconds reached.

The compute-only run: the same model and per-worker batch trained by the same Keras
program (jit_compile=False) in one process with no exchange at all, --workers such
processes at once (so that they share the host's cores as the cluster's workers do).
It gives the compute-only step, and "alone", one worker training by itself to the
target (its own evaluations).

The strict floor, the physical limit of the cluster, is what it would take if
communication were free: dense's steps to the target on the same link times the
compute-only step (its mean). "Alone" is a weaker reference: the cluster trains on
--workers times its batch, so it needs fewer steps than one worker alone, and "1x
alone" means the workers together reached the target no sooner than one by itself.

Reports per model, link and variant: the time to the target (seconds of training,
evaluations not counted), its ratio to the strict floor (``/strict``) and to one worker
alone (``/alone``), the speed-up in time to target over dense float32 and over bf16 on
the same link, and the bytes each worker sent
until the target (the exact sum of its per-step bytes up to the step that reached
it; with local steps only round ends send anything) and how many times fewer that is
than dense float32's. Seconds of training count one-off steps as typical ones: step 1
(tracing) and, with local steps, the first round end (the compressor's XLA
compilation) are counted at the median of their kind (``step_times``). Step times
(``mean_step_seconds``, ``ratio_to_compute_only``, ``speed_up_over_dense``) are means
over every step so counted: with local steps the median is a step that sends nothing,
and would hide the round ends' exchange.

Slow links make dense runs very long (the MLP's 23 MB per step take ~20 s at 10
Mbit/s), so each run stops after --max_run_seconds of training (at the next round
end; not a failure). A run that stopped so before its target gets an ESTIMATE, marked
``"estimated": true`` in the JSON, ``~`` in the table and hatched in the plot:

    steps to target = the same variant's, measured on the fastest link where it
                      reached the target in this invocation (the link changes how
                      long a step takes, not what it computes: same seeds, same data;
                      still, two runs of one variant can differ by an evaluation or
                      two: runs are not bit for bit deterministic, e.g. the input
                      pipeline's random flips run in parallel)
    time to target  = those steps x this run's mean step time (the mean, not the
                      median, for the reason above)
    bytes to target = those steps x this run's mean bytes per step

A ratio with an estimate on either side is marked ``~`` as well
(``ratios_from_estimates`` names the estimated rows it used). Nothing estimated is
reported as measured, and a run gets no estimate when the variant reached the target
on no link, when the run ran all its steps, or when it had already passed the
borrowed step count without reaching the target.

    sudo python benchmarks/network.py                  # mlp and cnn, 3 links, 6 variants
    sudo python benchmarks/network.py --models mlp --rates 100mbit \\
        --compressors none,adacomp,adacomp+H8
    sudo python benchmarks/network.py --models mlp --rates 100mbit \\
        --compressors none,bf16,adacomp,adacomp+flat --devices_per_worker 1,2

Needs root (``ip netns``). Every namespace it made is deleted at the end, on error and
on SIGINT/SIGTERM; a run still going --run_timeout seconds after it started is killed
(a failure); the workers can reach only each other's namespaces. Writes
out/network.json and out/network.png.
"""

import argparse
import collections
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import netns
import report  # benchmarks/report.py, beside this script

HERE = os.path.dirname(os.path.abspath(__file__))
PORT = 2222
# The targets (2 workers, MLP and CNN to 80%): (field of a row, link or None for
# every link, "<=" or ">=", bound). network.py prints which variants meet them.
TARGET_CHECKS = {
    "time_to_target_within_strict_floor_at_100mbit":
        ("ratio_to_strict_floor_time_to_target", "100mbit", "<=", 1.3),
    "time_to_target_speed_up_over_dense_at_10mbit":
        ("speed_up_to_target_over_dense", "10mbit", ">=", 50.0),
    "time_to_target_speed_up_over_bf16_at_10mbit":
        ("speed_up_to_target_over_bf16", "10mbit", ">=", 25.0),
    "bytes_to_target_fewer_than_dense": ("bytes_to_target_fewer_than_dense", None, ">=",
                                         2000.0),
    # Several devices per worker (rows with D > 1): against the same variant at D = 1,
    # and against the same variant's +flat at the same D.
    "time_to_target_with_devices_no_worse_than_one_at_100mbit":
        ("time_to_target_over_one_device", "100mbit", "<=", 1.0),
    "accuracy_at_equal_samples_at_least_flat":
        ("accuracy_at_equal_step_over_flat", None, ">=", 0.0),
}
TARGETS = {name: check[3] for name, check in TARGET_CHECKS.items()}
# Per model: steps, accuracy to reach (0: none) and learning rate of a run. The steps
# are multiples of 32, so that the last step ends a round of H = 8 or 32 local steps,
# and leave room past the steps to 0.80 measured on 1 Gbit/s (one worker alone: 130 to 150;
# MLP variants: 64 to 128; CNN variants: 130 to 288, adacomp+H32+nesterov the most).
MODEL_SETTINGS = {
    "mlp": {"max_steps": 320, "target_accuracy": 0.80, "learning_rate": 0.05},
    "cnn": {"max_steps": 640, "target_accuracy": 0.80, "learning_rate": 0.05},
    "resnet20": {"max_steps": 30, "target_accuracy": 0.0, "learning_rate": 0.1},
}
DENSE, BF16 = "none", "bf16"  # the variants the speed-ups are measured against
# The rows, besides a row itself, that each ratio of a row reads: the ratio is an
# estimate when one of them is.
RATIO_INPUTS = {"ratio_to_alone_time_to_target": (),  # never estimated
                "ratio_to_strict_floor_time_to_target": (DENSE,),  # dense's steps
                "speed_up_to_target_over_dense": (DENSE,),
                "speed_up_to_target_over_bf16": (BF16,),
                "bytes_to_target_fewer_than_dense": (DENSE,),
                # Rows of other D: the row's own "estimated_<field>" says (device_ratios).
                "time_to_target_over_one_device": (),
                "accuracy_at_equal_step_over_flat": ()}

# A variant of --compressors, parsed: exchange is None (the library's), "gradients" or
# "updates"; local_steps None (1) or H; outer_optimizer None, "average" or "nesterov";
# hierarchical None (the library's) or False (+flat).
Variant = collections.namedtuple(
    "Variant", "compressor exchange local_steps outer_optimizer hierarchical "
    "log_reduction auto", defaults=(None, None, None))
VARIANT_SYNTAX = ("a compressor's suffixes are +gradients or +updates (the exchange), "
                  "+H<steps> (local steps, an integer >= 1), +nesterov (with +H: "
                  "DiLoCo's outer Nesterov SGD), +flat (hierarchical=False), +auto "
                  "(dense_when_faster=True), +auto32 (dense_when_faster='float32'), "
                  "+perlog (the logs averaged with one all-reduce per value, the old "
                  "way) and +steplog (with +H: the logs averaged on every step, not at "
                  "round ends only), each at most once")


def _read_json(path):
  with open(path) as f:
    return json.load(f)


def _kill(processes):
  for process in processes:
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)  # the worker's own session: only ours
  for process in processes:
    process.wait()


def run_workers(commands, timeout):
  """Starts each ``(argv, env)``; waits for all (kills all at ``timeout`` or a failure).

  Returns:
    The return codes, in order (None for a process that was killed).
  """
  logs = [tempfile.TemporaryFile(mode="w+") for _ in commands]
  processes = [subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
               for (argv, env), log in zip(commands, logs)]
  deadline = time.monotonic() + timeout
  try:
    while any(p.poll() is None for p in processes):
      if time.monotonic() > deadline or any(p.poll() for p in processes):
        break  # past the deadline, or one failed: its peers would wait forever
      time.sleep(0.2)
  finally:
    _kill(processes)
  codes = [p.returncode for p in processes]
  if any(codes):
    for i, log in enumerate(logs):
      log.seek(0)
      print(f"--- worker {i} (rc {codes[i]}) ---\n{log.read()[-2000:]}", file=sys.stderr)
  return codes


def target_accuracy(args, model):
  """--target_accuracy, else the model's own (0: none)."""
  if args.target_accuracy is None:
    return MODEL_SETTINGS[model]["target_accuracy"]
  return args.target_accuracy


def split_variant(variant):
  """A variant of --compressors as a ``Variant``.

  ``"adacomp"`` -> ``Variant("adacomp", None, None, None, None)``; ``"adacomp+updates"`` ->
  ``Variant("adacomp", "updates", None, None)``; ``"adacomp+H8"`` -> ``Variant(
  "adacomp", None, 8, "average")``; ``"adacomp+H8+nesterov"`` -> ``Variant("adacomp",
  None, 8, "nesterov")``; ``"adacomp+flat"`` -> ``Variant("adacomp", None, None, None,
  False)`` (hierarchical=False). The first two fields are what the old ``(compressor,
  exchange)`` pair was. The exchange suffix lets one invocation time the old default
  (``+gradients``) beside the new (``+updates``); ``+H`` says "average" explicitly
  because the library's own default outer optimizer with local steps is DiLoCo's.

  Raises:
    ValueError: an unknown or repeated suffix, H < 1, +nesterov without +H, +H with
      +gradients (rounds exchange pseudo-updates), or +flat on none (Keras' own
      all-reduce: no CompressedOptimizer), naming ``compressor`` and the value.
  """
  compressor, *suffixes = variant.split("+")
  exchange = local_steps = outer = hierarchical = log_reduction = auto = None
  error = ValueError(f"{VARIANT_SYNTAX}. Received: compressor={variant!r}")
  if not compressor or len(set(suffixes)) != len(suffixes):
    raise error
  for suffix in suffixes:
    steps = re.fullmatch(r"H([0-9]+)", suffix)
    if suffix in ("gradients", "updates") and exchange is None:
      exchange = suffix
    elif steps and local_steps is None and int(steps.group(1)) >= 1:
      local_steps = int(steps.group(1))
    elif suffix == "nesterov":
      outer = "nesterov"
    elif suffix == "flat":
      hierarchical = False
    elif suffix == "perlog" and log_reduction is None:
      log_reduction = "per_value"
    elif suffix == "steplog" and log_reduction is None:
      log_reduction = "every_step"
    elif suffix in ("auto", "auto32") and auto is None:
      auto = True if suffix == "auto" else "float32"
    else:
      raise error
  if (hierarchical is False and compressor == DENSE and exchange in (None, "gradients")
      and not local_steps):
    raise ValueError(f"+flat is CompressedOptimizer's flat exchange (hierarchical=False); "
                     f"{DENSE} alone is Keras' own all-reduce, which has no other. "
                     f"Received: compressor={variant!r}")
  if local_steps is None and outer:
    raise ValueError(f"+nesterov is the outer optimizer of rounds of local steps: give "
                     f"+H<steps> too (e.g. adacomp+H8+nesterov). Received: "
                     f"compressor={variant!r}")
  if local_steps is not None and exchange == "gradients":
    raise ValueError(f"+H (local steps) exchanges pseudo-updates, not gradients: drop "
                     f"+gradients. Received: compressor={variant!r}")
  if log_reduction == "every_step" and not local_steps:
    raise ValueError(f"+steplog averages the logs on every step of rounds of local steps "
                     f"(without them they are anyway): give +H<steps> too (e.g. "
                     f"adacomp+H8+steplog). Received: compressor={variant!r}")
  if local_steps is not None:
    outer = outer or "average"
  if auto and compressor == DENSE and exchange in (None, "gradients") and not local_steps:
    raise ValueError(f"+auto is CompressedOptimizer's dense_when_faster; {DENSE} alone is "
                     f"Keras' own all-reduce. Received: compressor={variant!r}")
  return Variant(compressor, exchange, local_steps, outer, hierarchical, log_reduction, auto)


def worker_argv(args, model, variant, out, alone=False, topk_density=None, devices=1,
                namespace=None):
  """The command line of one network_worker.py process (``devices`` local replicas;
  ``namespace``: the one it runs in, whose link counters it reads)."""
  settings = MODEL_SETTINGS[model]
  parsed = split_variant(variant)
  argv = [sys.executable, os.path.join(HERE, "network_worker.py"), f"--model={model}",
          f"--compressor={parsed.compressor}", f"--batch_size={args.batch_size}",
          f"--width={args.width}", f"--learning_rate={settings['learning_rate']}",
          f"--max_steps={args.max_steps or settings['max_steps']}",
          f"--target_accuracy={target_accuracy(args, model)}",
          f"--eval_every={args.eval_every}", f"--threads={args.threads}", f"--out={out}"]
  if parsed.exchange:
    argv.append(f"--optimizer_exchange={parsed.exchange}")
  if parsed.local_steps:
    argv += [f"--local_steps={parsed.local_steps}",
             f"--outer_optimizer={parsed.outer_optimizer}"]
  if parsed.hierarchical is False:
    argv.append("--flat")
  if parsed.log_reduction:
    argv.append(f"--log_reduction={parsed.log_reduction}")
  if parsed.auto:
    argv.append("--auto" if parsed.auto is True else f"--auto={parsed.auto}")
  if topk_density:
    argv.append(f"--topk_density={topk_density:.6g}")
  if devices > 1 and not alone:
    argv.append(f"--devices_per_worker={devices}")
  if namespace and not alone:
    argv.append(f"--netns={namespace}")
  if alone:
    argv.append("--alone")
  elif args.max_run_seconds:  # the compute-only run is short: it runs to its target
    argv.append(f"--max_run_seconds={args.max_run_seconds}")
  if args.synthetic:
    argv.append("--synthetic")
  return argv


def parse_devices(text, batch_size):
  """--devices_per_worker as a list of ints (``"1,2"`` -> ``[1, 2]``).

  Raises:
    ValueError: not comma-separated integers >= 1, a repeat, or one that does not divide
      ``batch_size`` (the worker's batch is split evenly across its replicas).
  """
  try:
    devices = [int(part) for part in str(text).split(",")]
  except ValueError:
    devices = []
  if not devices or any(d < 1 for d in devices) or len(set(devices)) != len(devices):
    raise ValueError(f"--devices_per_worker takes distinct integers >= 1, comma-separated "
                     f"(e.g. 1,2). Received: devices_per_worker={text!r}")
  for d in devices:
    if batch_size % d:
      raise ValueError(f"--devices_per_worker must divide --batch_size (each replica "
                       f"trains on batch_size / D). Received: devices_per_worker={d}, "
                       f"batch_size={batch_size}")
  return devices


def worker_env(tf_config=None):
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
  env.pop("TF_CONFIG", None)
  if tf_config:
    env["TF_CONFIG"] = tf_config
  return env


def compute_only(args, model, work):
  """The compute-only run: ``--workers`` processes at once, each training alone (no
  exchange). Its mean step is the strict floor's step; its time to the target is one
  worker's alone."""
  outs = [os.path.join(work, f"{model}_alone_{i}.json") for i in range(args.workers)]
  codes = run_workers([(worker_argv(args, model, DENSE, out, alone=True), worker_env())
                       for out in outs], args.run_timeout)
  if any(codes):
    raise RuntimeError(f"compute-only run of {model} failed: return codes {codes}")
  runs = [_read_json(out) for out in outs]
  floor = {"median_step_seconds": statistics.mean(r["median_step_seconds"] for r in runs),
           "evaluations": runs[0]["evaluations"], "step_seconds": runs[0]["step_seconds"]}
  floor["time_to_target_seconds"] = time_to_accuracy(floor, target_accuracy(args, model))
  floor["steps_to_target"] = steps_to_accuracy(floor, target_accuracy(args, model))
  return floor


def cluster_run(args, net, model, compressor, work, topk_density=None, devices=1):
  """One MultiWorkerMirroredStrategy run across the namespaces, ``devices`` replicas per
  worker: worker 0's figures, with every worker's link counters (``link_*_workers``:
  per step as each worker measured them, and the whole run's as read from outside,
  start-up and the initial broadcast included)."""
  from tf_adacomp import distribute  # pylint: disable=g-import-not-at-top
  addresses = [f"{net.address(i)}:{PORT}" for i in range(args.workers)]
  outs = [os.path.join(work, f"{model}_{compressor}_{net.rate}_D{devices}_{i}.json")
          for i in range(args.workers)]
  commands = [(net.command(i, worker_argv(args, model, compressor, outs[i],
                                          topk_density=topk_density, devices=devices,
                                          namespace=net.namespaces[i])),
               worker_env(distribute.tf_config(addresses, i)))
              for i in range(args.workers)]
  before = [net.counters(i) for i in range(args.workers)]
  start = time.perf_counter()
  codes = run_workers(commands, args.run_timeout)
  wall = time.perf_counter() - start
  if any(code != 0 for code in codes):
    return {"compressor": compressor, "devices_per_worker": devices, "failed": True,
            "return_codes": codes, "wall_seconds": wall}
  workers = [_read_json(out) for out in outs]
  run = workers[0]
  run.update(compressor=compressor, wall_seconds=wall, topk_density=topk_density,
             devices_per_worker=devices,
             link_bytes_per_step_workers=[w.get("link_bytes_per_step") for w in workers],
             link_run_workers=[netns.counter_deltas(b, net.counters(i))
                               for i, b in enumerate(before)])
  return run


def link_bytes_per_step(run, direction="tx"):
  """Bytes a worker really sent (``tx``) or received (``rx``) over its link per step,
  the mean of the workers' own counts (None: not measured)."""
  counts = [w[f"{direction}_bytes"] for w in run.get("link_bytes_per_step_workers") or []
            if w]
  return statistics.mean(counts) if counts else None


# --- Time and bytes to the target ----------------------------------------------------


def steps_to_accuracy(run, target):
  """The step of the first evaluation with test accuracy >= target (None: not reached)."""
  if not target:
    return None
  for evaluation in run["evaluations"]:
    if evaluation["accuracy"] >= target:
      return evaluation["step"]
  return None


def step_times(run):
  """The run's step times in seconds, its one-off steps counted as typical ones.

  Step 1 traces the training function and, with local steps, the first round end (step
  H) compiles the compressor's XLA programs: one-off costs that a longer run would not
  pay again. Step 1 is counted at the median of the steps inside a round (every step
  after the first when H is 1: the worker's median), step H at the median of the later
  round ends; a run with one round end keeps it as measured (its compilation included).
  """
  times = list(run["step_seconds"])
  local_steps = run.get("local_steps") or 1
  if local_steps == 1:
    times[0] = run["median_step_seconds"]
    return times
  inside = [t for step, t in enumerate(times[1:], 2) if step % local_steps]
  later_ends = [t for step, t in enumerate(times, 1)
                if step % local_steps == 0 and step != local_steps]
  if inside:
    times[0] = statistics.median(inside)
  if later_ends:
    times[local_steps - 1] = statistics.median(later_ends)
  return times


def time_to_accuracy(run, target):
  """Seconds of training (evaluations not counted) until test accuracy >= target, the
  one-off steps counted as typical ones (``step_times``). None when not reached."""
  steps = steps_to_accuracy(run, target)
  if steps is None:
    return None
  return sum(step_times(run)[:steps])


def bytes_to_accuracy(run, target):
  """Bytes one worker sent until test accuracy >= target: its per-step bytes summed up
  to that step, exact (with local steps only round ends count). None: not reached."""
  steps = steps_to_accuracy(run, target)
  if steps is None:
    return None
  return sum(run["step_bytes_sent"][:steps])


def mean_step_seconds(run):
  """The mean of ``step_times``: what a step costs on average, round ends included (the
  median of a run with local steps is a step that sends nothing)."""
  return statistics.mean(step_times(run))


def to_target(run, target, borrowed_steps=None):
  """Steps, seconds and bytes to the target: measured when the run reached it.

  A run stopped by --max_run_seconds before ``borrowed_steps`` (the same variant's steps
  to the target on the fastest link that reached it) is estimated: those steps at this
  run's mean step time and mean bytes per step, ``estimated`` True. Anything else that
  did not reach the target (it ran all its steps, or got past the borrowed count
  without reaching the target) has None: it is no evidence of a time to target.
  """
  steps = steps_to_accuracy(run, target)
  if steps is not None:
    return {"steps_to_target": steps, "time_to_target_seconds": time_to_accuracy(run, target),
            "bytes_to_target": bytes_to_accuracy(run, target), "estimated": False}
  if (borrowed_steps and run.get("stopped") == "max_run_seconds"
      and len(run["step_seconds"]) < borrowed_steps):
    return {"steps_to_target": borrowed_steps,
            "time_to_target_seconds": borrowed_steps * mean_step_seconds(run),
            "bytes_to_target": borrowed_steps * run["bytes_sent_per_step"],
            "estimated": True}
  return {"steps_to_target": None, "time_to_target_seconds": None, "bytes_to_target": None,
          "estimated": False}


def borrowed_steps(model, rates, variant, runs, target):
  """``(rate, steps)``: the variant's steps to the target on the fastest of ``rates``
  where it reached it (measured), or None."""
  for rate in sorted(rates, key=netns.rate_bits, reverse=True):
    run = runs.get((model, rate, variant))
    steps = steps_to_accuracy(run, target) if run and not run.get("failed") else None
    if steps is not None:
      return rate, steps
  return None


def _ratio(numerator, denominator):
  return numerator / denominator if numerator and denominator else None


def run_row(model, rate, run, floor, target, borrowed=None):
  """The row of one run, without the ratios to other rows (``summarize`` adds them)."""
  if run.get("failed"):
    failed = {"model": model, "rate": rate, "compressor": run["compressor"], "failed": True}
    if run.get("devices_per_worker", 1) != 1:
      failed["devices_per_worker"] = run["devices_per_worker"]
    return failed
  last = run["evaluations"][-1] if run["evaluations"] else {}
  row = {"model": model, "rate": rate, "compressor": run["compressor"],
         "devices_per_worker": run.get("devices_per_worker", 1),
         "link_tx_bytes_per_step": link_bytes_per_step(run, "tx"),
         "link_rx_bytes_per_step": link_bytes_per_step(run, "rx"),
         "median_step_seconds": run["median_step_seconds"],
         "mean_step_seconds": mean_step_seconds(run),
         "ratio_to_compute_only": mean_step_seconds(run) / mean_step_seconds(floor),
         "bytes_sent_per_step": run["bytes_sent_per_step"],
         "compression_ratio": _ratio(run["dense_bytes_per_step"],
                                     run["bytes_sent_per_step"]),
         "steps": len(run["step_seconds"]), "stopped": run.get("stopped"),
         "final_accuracy": last.get("accuracy"), "target_accuracy": target or None,
         "alone_time_to_target_seconds": floor.get("time_to_target_seconds"),
         "topk_density": run.get("topk_density")}
  row.update(to_target(run, target, borrowed[1] if borrowed else None))
  if row["estimated"]:
    row["steps_to_target_from"] = borrowed[0]  # the link whose run gave the steps
  return row


def strict_floor(row, dense, floor):
  """``strict_floor_seconds`` (dense's steps to the target on the row's link, measured
  or estimated, times the compute-only run's mean step: the time if communication were
  free) and the row's ``ratio_to_strict_floor_time_to_target``; None where dense
  failed or has no steps to the target."""
  steps = dense.get("steps_to_target")
  seconds = steps * mean_step_seconds(floor) if steps else None
  return {"strict_floor_seconds": seconds,
          "ratio_to_strict_floor_time_to_target": _ratio(row["time_to_target_seconds"],
                                                         seconds)}


def summarize(model, rates, variants, runs, floor, target, fallback=None):
  """The rows of one model (every link and variant run): time and bytes to the target,
  measured or estimated, and their ratios to the strict floor, to one worker alone, to
  dense and to bf16 on the same link.

  ``ratios_from_estimates`` names the rows (this one, dense, bf16) whose estimates
  entered a ratio of this row. ``fallback``: ``(tag, runs)``, other runs of the model
  (the same variants at one device per worker) to borrow steps to the target from when
  the variant reached it on no link of ``runs``; the link named in
  ``steps_to_target_from`` then carries ``tag``.
  """
  rows = {}
  for rate in rates:
    for variant in variants:
      run = runs.get((model, rate, variant))
      if run is not None:  # (topk is skipped when AdaComp failed)
        borrowed = borrowed_steps(model, rates, variant, runs, target)
        if borrowed is None and fallback:
          other = borrowed_steps(model, rates, variant, fallback[1], target)
          borrowed = (f"{other[0]} {fallback[0]}", other[1]) if other else None
        rows[rate, variant] = run_row(model, rate, run, floor, target, borrowed)
  for (rate, variant), row in rows.items():
    if row.get("failed"):
      continue
    dense, bf16 = rows.get((rate, DENSE), {}), rows.get((rate, BF16), {})
    seconds, nbytes = row["time_to_target_seconds"], row["bytes_to_target"]
    # Over a dense run that failed, the per-step speed-up is unknown (None).
    row["speed_up_over_dense"] = _ratio(dense.get("mean_step_seconds"),
                                        row["mean_step_seconds"])
    row["ratio_to_alone_time_to_target"] = _ratio(seconds,
                                                  floor.get("time_to_target_seconds"))
    row.update(strict_floor(row, dense, floor))
    row["speed_up_to_target_over_dense"] = _ratio(dense.get("time_to_target_seconds"),
                                                  seconds)
    row["speed_up_to_target_over_bf16"] = _ratio(bf16.get("time_to_target_seconds"), seconds)
    row["bytes_to_target_fewer_than_dense"] = _ratio(dense.get("bytes_to_target"), nbytes)
    row["ratios_from_estimates"] = sorted({r["compressor"] for r in (row, dense, bf16)
                                           if r.get("estimated")})
  return list(rows.values())


# --- Several devices per worker: equal samples, D against 1, hierarchical against flat


def equal_step(runs):
  """The step S at which every run of ``runs`` (one model's) is compared at equal
  samples: the last evaluation step that each run not cut short by --max_run_seconds
  reached (every run's when all were cut short). None: no evaluations."""
  done = [r for r in runs if not r.get("failed") and r["evaluations"]]
  whole = [r for r in done if r.get("stopped") != "max_run_seconds"] or done
  return min((r["evaluations"][-1]["step"] for r in whole), default=None)


def accuracy_at_step(run, step):
  """``(accuracy, mean accuracy)``: the run's last evaluation at or before ``step`` and
  the mean of its evaluations up to ``step``; ``(None, None)`` when the run stopped
  before ``step`` or evaluated nothing until then."""
  if run.get("failed") or step is None or not run["evaluations"]:
    return None, None
  upto = [e["accuracy"] for e in run["evaluations"] if e["step"] <= step]
  if run["evaluations"][-1]["step"] < step or not upto:
    return None, None
  return upto[-1], statistics.mean(upto)


def row_key(row):
  """``(model, rate, variant, devices per worker)`` of a row, as ``runs`` keys it."""
  return row["model"], row["rate"], row["compressor"], row.get("devices_per_worker", 1)


def add_equal_step_accuracy(rows, runs):
  """Adds ``equal_step`` (S, per model), ``accuracy_at_equal_step`` and
  ``mean_accuracy_to_equal_step`` to every row that did not fail; ``runs`` keyed as
  ``measure`` keys them."""
  for model in {r["model"] for r in rows}:
    step = equal_step([run for key, run in runs.items() if key[0] == model])
    for row in rows:
      if row["model"] == model and not row.get("failed"):
        row["equal_step"] = step
        (row["accuracy_at_equal_step"],
         row["mean_accuracy_to_equal_step"]) = accuracy_at_step(runs[row_key(row)], step)


def flat_counterpart(variant):
  """The variant's ``+flat`` twin (hierarchical=False) as ``split_variant`` sees it, or
  None when the variant is flat already or has none (dense)."""
  parsed = split_variant(variant)
  if parsed.hierarchical is False or parsed.compressor == DENSE:
    return None
  return parsed._replace(hierarchical=False)


def device_ratios(rows):
  """Adds, to each row of D > 1 devices per worker, ``time_to_target_over_one_device``
  (its time to the target over the same variant's at D = 1 on the same link; with
  ``estimated_time_to_target_over_one_device`` when either is an estimate), and to each
  row with a ``+flat`` twin at the same D and link ``accuracy_at_equal_step_over_flat``
  (its accuracy at the equal step minus the twin's)."""
  by_key = {row_key(r): r for r in rows if not r.get("failed")}
  for row in by_key.values():
    model, rate, variant, devices = row_key(row)
    if devices != 1:
      one = by_key.get((model, rate, variant, 1), {})
      row["time_to_target_over_one_device"] = _ratio(row["time_to_target_seconds"],
                                                     one.get("time_to_target_seconds"))
      row["estimated_time_to_target_over_one_device"] = bool(row["estimated"]
                                                             or one.get("estimated"))
    twin = flat_counterpart(variant)
    flat = next((r for key, r in by_key.items() if key[:2] == (model, rate)
                 and key[3] == devices and split_variant(key[2]) == twin), None)
    if twin and flat is not None:
      mine, theirs = row.get("accuracy_at_equal_step"), flat.get("accuracy_at_equal_step")
      row["accuracy_at_equal_step_over_flat"] = (
          None if mine is None or theirs is None else mine - theirs)
      row["estimated_accuracy_at_equal_step_over_flat"] = False  # measured evaluations
      row["flat_variant"] = flat["compressor"]


# --- Output ---------------------------------------------------------------------------


def _fmt(value, spec, estimated=False, suffix=""):
  """``value`` formatted, ``~`` before an estimate, ``-`` for None."""
  if value is None:
    return "-"
  return ("~" if estimated else "") + format(value, spec) + suffix


def _bytes(value, estimated=False):
  if value is None:
    return "-"
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if value >= scale:
      return _fmt(value / scale, ".3g", estimated, f" {unit}")
  return _fmt(value, ".0f", estimated, " B")


def ratio_is_estimated(row, field):
  """Whether ratio ``field`` of ``row`` has an estimate on either side."""
  if f"estimated_{field}" in row:  # a ratio to a row of another D (device_ratios)
    return row[f"estimated_{field}"]
  used = row.get("ratios_from_estimates", [])
  return row.get("estimated", False) or any(r in used for r in RATIO_INPUTS[field])


def print_rows(rows):
  print(f"\n{'model':<9}{'link':>8}{'variant':>21}{'D':>3}{'ms/step':>9}{'steps':>6}"
        f"{'acc':>7}{'to tgt':>7}{'to target s':>12}{'/strict':>8}{'/alone':>8}"
        f"{'x dense':>9}"
        f"{'x bf16':>8}{'bytes to tgt':>14}{'/ dense':>9}{'link B/step':>13}"
        f"{'sent B/step':>13}{'acc@S':>7}{'S':>5}")
  for r in rows:
    devices = r.get("devices_per_worker", 1)
    if r.get("failed"):
      print(f"{r['model']:<9}{r['rate']:>8}{r['compressor']:>21}{devices:>3}   FAILED")
      continue
    est = r["estimated"]

    def ratio(field, spec, r=r):
      return _fmt(r.get(field), spec, ratio_is_estimated(r, field), "x")

    print(f"{r['model']:<9}{r['rate']:>8}{r['compressor']:>21}{devices:>3}"
          f"{1e3 * r['mean_step_seconds']:>9.1f}{r['steps']:>6}"
          f"{r['final_accuracy'] or 0:>7.3f}{_fmt(r['steps_to_target'], 'd', est):>7}"
          f"{_fmt(r['time_to_target_seconds'], '.1f', est):>12}"
          f"{ratio('ratio_to_strict_floor_time_to_target', '.2f'):>8}"
          f"{ratio('ratio_to_alone_time_to_target', '.2f'):>8}"
          f"{ratio('speed_up_to_target_over_dense', '.3g'):>9}"
          f"{ratio('speed_up_to_target_over_bf16', '.3g'):>8}"
          f"{_bytes(r['bytes_to_target'], est):>14}"
          f"{ratio('bytes_to_target_fewer_than_dense', '.4g'):>9}"
          f"{_bytes(r.get('link_tx_bytes_per_step')):>13}"
          f"{_bytes(r.get('bytes_sent_per_step')):>13}"
          f"{_fmt(r.get('accuracy_at_equal_step'), '.3f'):>7}"
          f"{_fmt(r.get('equal_step'), 'd'):>5}")
  print("ms/step: mean over every step, one-off steps counted as typical; ~: an estimate "
        "(the run stopped at --max_run_seconds; see network.py's docstring); /strict: "
        "time to target over the strict floor (dense's steps x the compute-only step); "
        "/alone: over one worker training alone; D: devices "
        "per worker; link B/step: what a worker really sent over its link per step "
        "(interface counters, after step 1); sent B/step: its own count (bytes_sent); "
        "acc@S: test accuracy at step S, the same samples for every run of the model")


def print_targets(rows):
  """For each of the issue's targets, the rows that meet it and those that do not (~:
  estimates involved)."""
  reference = {DENSE, BF16}
  for model in sorted({r["model"] for r in rows}):
    print(f"\ntargets, {model}:")
    for name, (field, rate, op, bound) in TARGET_CHECKS.items():
      met, missed = [], []
      for r in rows:
        value = r.get(field)
        if (r["model"] != model or value is None or r["compressor"] in reference
            or (rate and r["rate"] != rate)):
          continue
        mark = "~" if ratio_is_estimated(r, field) else ""
        devices = r.get("devices_per_worker", 1)
        where = f"{r['rate']} D{devices}" if devices != 1 else r["rate"]
        meets = (value <= bound) if op == "<=" else (value >= bound)
        (met if meets else missed).append(f"{r['compressor']}@{where} {mark}{value:.3g}")
      print(f"  {name} ({op} {bound:g}): {', '.join(met) if met else 'none'}"
            + (f"; not met: {', '.join(missed)}" if missed else ""))


def plot(rows, runs, floors, path):
  """Per model: time to target per link and variant (log scale, estimates hatched, the
  strict floor of each link dashed, one worker alone dotted); accuracy against training
  seconds (one worker alone's in black)."""
  plt = report.pyplot()
  from matplotlib.patches import Patch  # pylint: disable=g-import-not-at-top

  models = sorted({r["model"] for r in rows})
  variants = list(dict.fromkeys(row_label(r) for r in rows))
  colors = {v: plt.get_cmap("tab10")(i % 10) for i, v in enumerate(variants)}
  styles = ["-", "--", ":", "-."]
  fig, axes = plt.subplots(2, len(models), figsize=(7 * len(models), 9), squeeze=False)
  for column, model in enumerate(models):
    mine = [r for r in rows if r["model"] == model and not r.get("failed")]
    rates = list(dict.fromkeys(r["rate"] for r in mine))
    width = 0.8 / max(1, len(variants))
    ax = axes[0][column]
    for i, rate in enumerate(rates):
      for j, variant in enumerate(variants):
        row = next((r for r in mine if r["rate"] == rate and row_label(r) == variant),
                   None)
        if not row or row["time_to_target_seconds"] is None:
          continue
        ax.bar(i + (j - (len(variants) - 1) / 2) * width, row["time_to_target_seconds"],
               width, color=colors[variant], alpha=0.45 if row["estimated"] else 1.0,
               hatch="//" if row["estimated"] else None)
    for i, rate in enumerate(rates):
      strict = next((r["strict_floor_seconds"] for r in mine
                     if r["rate"] == rate and r.get("strict_floor_seconds")), None)
      if strict:
        ax.hlines(strict, i - 0.45, i + 0.45, color="k", linestyle="--")
    alone = floors[model].get("time_to_target_seconds")
    if alone:
      ax.axhline(alone, color="grey", linestyle=":")
    ax.set_xticks(range(len(rates)))
    ax.set_xticklabels(rates)
    ax.set_yscale("log")
    ax.set_ylabel("seconds of training to the target")
    target = next((r["target_accuracy"] for r in mine if r["target_accuracy"]), None)
    ax.set_title(f"{model}: time to {target} test accuracy" if target else model)
    handles = [Patch(color=colors[v], label=v) for v in variants]
    handles += [Patch(facecolor="white", edgecolor="k", hatch="//",
                      label="~ estimated (stopped early)"),
                plt.Line2D([], [], color="k", linestyle="--",
                           label="strict floor: dense's steps x compute-only step"),
                plt.Line2D([], [], color="grey", linestyle=":", label="one worker alone")]
    ax.legend(handles=handles, fontsize=7)

    ax = axes[1][column]
    for (run_model, rate, variant, devices), run in runs.items():
      if run_model != model or run.get("failed") or not run["evaluations"]:
        continue
      variant = row_label({"compressor": variant, "devices_per_worker": devices})
      ax.plot(_eval_seconds(run), [e["accuracy"] for e in run["evaluations"]],
              color=colors.get(variant, "grey"),
              linestyle=styles[rates.index(rate) % len(styles)] if rate in rates else "-",
              marker=".", label=f"{rate} {variant}")  # (a run stopped early: one point)
    if floors[model]["evaluations"]:
      ax.plot(_eval_seconds(floors[model]), [e["accuracy"] for e in floors[model]["evaluations"]],
              color="k", marker=".", label="one worker alone")
    if target:
      ax.axhline(target, color="grey", linestyle=":")
    ax.set_xscale("log")
    ax.set_xlabel("seconds of training (evaluations not counted)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{model}: accuracy against training time (line style: link)")
    ax.legend(fontsize=6, ncol=2)
  report.save_figure(fig, path)


def row_label(row):
  """A row's variant, with `` D<n>`` when it ran on n > 1 devices per worker."""
  devices = row.get("devices_per_worker", 1)
  return row["compressor"] + (f" D{devices}" if devices != 1 else "")


def json_key(key):
  """The JSON name of a run: ``model/rate/variant``, ``/D<n>`` after it for n > 1
  devices per worker."""
  model, rate, variant, devices = key
  return "/".join((model, rate, variant) + ((f"D{devices}",) if devices != 1 else ()))


def _eval_seconds(run):
  """Training seconds at each evaluation, counted as ``time_to_accuracy`` does."""
  times = step_times(run)
  return [sum(times[:e["step"]]) for e in run["evaluations"]]


def summarize_devices(model, rates, variants, devices_list, runs, floor, target):
  """The rows of one model at every number of devices per worker: ``summarize`` per D
  (a D > 1 borrows steps to the target from D = 1 when it reached it on no link), each
  row with its ``devices_per_worker``, then the accuracy at the equal step and the
  ratios across D and to +flat (``add_equal_step_accuracy``, ``device_ratios``).
  ``runs`` is keyed ``(model, rate, variant, devices)``."""
  def of(devices):
    return {key[:3]: run for key, run in runs.items()
            if key[0] == model and key[3] == devices}

  rows = []
  for devices in devices_list:
    fallback = ("D1", of(1)) if devices != 1 and 1 in devices_list else None
    for row in summarize(model, rates, variants, of(devices), floor, target, fallback):
      if devices != 1 or not row.get("failed"):
        row["devices_per_worker"] = devices
      rows.append(row)
  add_equal_step_accuracy(rows, {k: r for k, r in runs.items() if k[0] == model})
  device_ratios(rows)
  return rows


def measure(args, models, rates, compressors, work):
  """Every model's floor, then every link, number of devices per worker and variant:
  ``(rows, runs, floors, links)``; ``runs`` keyed ``(model, rate, variant, devices)``."""
  rows, runs, floors, links = [], {}, {}, {}
  for model in models:
    target = target_accuracy(args, model)
    floors[model] = compute_only(args, model, work)
    floor = floors[model]
    print(f"{model}: compute-only step {1e3 * floor['median_step_seconds']:.1f} ms, "
          f"to target {_fmt(floor['time_to_target_seconds'], '.1f', suffix=' s')} "
          f"({floor['steps_to_target'] or '-'} steps)", flush=True)
    for rate in rates:
      with netns.LimitedNetwork(args.workers, rate) as net:
        links[rate] = net.throughput(0, 1)
        print(f"{model} {rate}: measured link {links[rate] / 1e6:.0f} Mbit/s", flush=True)
        for devices, compressor in ((d, c) for d in args.devices for c in compressors):
          density = None
          name = f"{model} {rate} D{devices} {compressor}"
          if compressor == "topk":
            adacomp = runs.get((model, rate, "adacomp", devices), {})
            if adacomp.get("failed") or not adacomp:
              print(f"{model} {rate}: topk skipped (it runs at AdaComp's density, and "
                    "the AdaComp run failed)", flush=True)
              continue
            density = (report.adacomp_elements_sent(adacomp["variables"])
                       / adacomp["parameters"])
          run = cluster_run(args, net, model, compressor, work, density, devices)
          runs[(model, rate, compressor, devices)] = run
          if run.get("failed"):
            print(f"{name}: FAILED ({run['return_codes']})", flush=True)
          else:
            print(f"{name}: {len(run['step_seconds'])} steps, "
                  f"{1e3 * mean_step_seconds(run):.1f} ms/step, accuracy "
                  f"{run['evaluations'][-1]['accuracy'] if run['evaluations'] else '-'}, "
                  f"stopped: {run.get('stopped')}, to target "
                  f"{_fmt(time_to_accuracy(run, target), '.1f', suffix=' s')}, link "
                  f"{_bytes(link_bytes_per_step(run))}/step (sent "
                  f"{_bytes(run['bytes_sent_per_step'])}/step)", flush=True)
    # Estimates need the fastest link's steps to the target: rows come after every link.
    rows += summarize_devices(model, rates, compressors, args.devices, runs, floor, target)
  return rows, runs, floors, links


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="mlp,cnn",
                      help=f"comma-separated, from {','.join(MODEL_SETTINGS)}")
  parser.add_argument("--rates", default="10mbit,100mbit,1gbit",
                      help="tc rates, comma-separated")
  parser.add_argument("--compressors",
                      default="none,bf16,adacomp,adacomp+H8,adacomp+H32,adacomp+H8+nesterov",
                      help="variants, comma-separated: topk runs at AdaComp's measured "
                      "density (adacomp before it); a suffix +gradients or +updates picks "
                      "CompressedOptimizer's exchange, +H8 rounds of 8 local steps "
                      "(averaged), +H8+nesterov with DiLoCo's outer Nesterov SGD")
  parser.add_argument("--devices_per_worker", default="1",
                      help="local replicas per worker, comma-separated (e.g. 1,2): every "
                      "variant runs at each; the worker's batch stays --batch_size")
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--batch_size", type=int, default=64, help="per worker")
  parser.add_argument("--width", type=int, default=2048, help="the MLP's hidden width")
  parser.add_argument("--max_steps", type=int, default=None,
                      help="per run (default: mlp 320, cnn 640, resnet20 30)")
  parser.add_argument("--target_accuracy", type=float, default=None,
                      help="test accuracy to time (default: mlp and cnn 0.80, resnet20 "
                      "none)")
  parser.add_argument("--eval_every", type=int, default=10,
                      help="steps between evaluations (with +H: rounded up to a multiple "
                      "of H)")
  parser.add_argument("--threads", type=int, default=None,
                      help="TensorFlow threads per worker (default: cores / workers)")
  parser.add_argument("--max_run_seconds", type=float, default=600,
                      help="seconds of training after which a run stops (at its next "
                      "round end; not a failure: its time to target is estimated, see "
                      "above); 0: no limit")
  parser.add_argument("--run_timeout", type=float, default=1200,
                      help="seconds after which a run is killed (a failure); more than "
                      "--max_run_seconds: start-up, evaluations and the last round")
  parser.add_argument("--synthetic", action="store_true", help="random data (smoke runs)")
  parser.add_argument("--json", default="out/network.json")
  parser.add_argument("--plot", default="out/network.png", help="'' for none")
  args = parser.parse_args(argv)
  models = args.models.split(",")
  rates = args.rates.split(",")
  compressors = args.compressors.split(",")
  for model in models:
    if model not in MODEL_SETTINGS:
      parser.error(f"--models takes names from {','.join(MODEL_SETTINGS)}. "
                   f"Received: models={args.models!r}")
  for rate in rates:
    try:
      netns.rate_bits(rate)
    except ValueError as error:
      parser.error(str(error))
  order_error = report.topk_order_error(compressors)
  if order_error:
    parser.error(order_error)
  for variant in compressors:
    try:
      split_variant(variant)
    except ValueError as error:
      parser.error(str(error))
  try:
    args.devices = parse_devices(args.devices_per_worker, args.batch_size)
  except ValueError as error:
    parser.error(str(error))
  if args.workers < 2:
    parser.error(f"--workers must be >= 2. Received: workers={args.workers}")
  if args.eval_every < 1:
    parser.error(f"--eval_every must be >= 1. Received: eval_every={args.eval_every}")
  if args.max_steps is not None and args.max_steps < 1:
    parser.error(f"--max_steps must be >= 1. Received: max_steps={args.max_steps}")
  if args.max_run_seconds < 0:
    parser.error(f"--max_run_seconds must be >= 0 (0: no limit). "
                 f"Received: max_run_seconds={args.max_run_seconds}")
  if args.max_run_seconds and args.run_timeout <= args.max_run_seconds:
    parser.error("--run_timeout kills a run (a failure) and must exceed --max_run_seconds, "
                 f"which stops one. Received: run_timeout={args.run_timeout}, "
                 f"max_run_seconds={args.max_run_seconds}")
  args.threads = args.threads or max(1, (os.cpu_count() or 2) // args.workers)
  if not netns.available():
    sys.exit("network.py needs root and iproute2 (`ip netns`, `tc`) to build its "
             "namespaces; run it with sudo.")

  # The workers' JSON files: worker 0's go into --json; the folder goes at the end.
  work = tempfile.mkdtemp(prefix="tf_adacomp_network_")
  try:
    rows, runs, floors, links = measure(args, models, rates, compressors, work)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  print_rows(rows)
  print_targets(rows)
  report.write_json(args.json, {
      "benchmark": "network", "workers": args.workers, "threads_per_worker": args.threads,
      "batch_size_per_worker": args.batch_size, "devices_per_worker": args.devices,
      "machine": platform.platform(),
      "cpus": os.cpu_count(), "measured_link_bits_per_second": links,
      "max_run_seconds": args.max_run_seconds, "targets": TARGETS, "compute_only": floors,
      "rows": rows, "runs": {json_key(key): run for key, run in runs.items()}})
  if args.plot:
    plot(rows, runs, floors, args.plot)


if __name__ == "__main__":
  main()
