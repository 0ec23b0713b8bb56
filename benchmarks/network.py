"""AdaComp on a bandwidth-limited link: MultiWorkerMirroredStrategy across namespaces.

Each worker process runs in its own Linux network namespace; the namespaces are joined
by a bridge whose ports are limited with ``tc ... tbf`` to --rates
(benchmarks/netns.py), so the workers' gRPC collectives cross a 100 Mbit/s (or 1
Gbit/s) link as they would between machines. For each model (a wide MLP
784-2048-2048-10 of 5.8M parameters, communication-heavy; ResNet-20, 0.27M,
compute-heavy) and each compressor, the workers train Fashion-MNIST
(benchmarks/network_worker.py) and report step time, bytes per step and test accuracy
every --eval_every steps. Also measured, with the same processes' layout but no
exchange at all: the compute-only step (the floor). Reports per link: the step time,
the speed-up over the dense all-reduce, the ratio to the floor, and the time to
--target_accuracy.

    sudo python benchmarks/network.py                  # every model, link, compressor
    sudo python benchmarks/network.py --models mlp --rates 100mbit --compressors none,adacomp

Needs root (``ip netns``). Every namespace it made is deleted at the end, on error and
on SIGINT/SIGTERM; each training run is killed after --run_timeout seconds; the workers
can reach only each other's namespaces. Writes out/network.json and out/network.png.
"""

import argparse
import json
import os
import platform
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
TARGETS = {"speed_up_at_100mbit": 5.0, "ratio_to_compute_only": 1.2}
# Per model: steps, accuracy to reach (0: none) and learning rate of a run.
MODEL_SETTINGS = {
    "mlp": {"max_steps": 300, "target_accuracy": 0.80, "learning_rate": 0.05},
    "resnet20": {"max_steps": 30, "target_accuracy": 0.0, "learning_rate": 0.1},
}


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
  """``"adacomp+updates"`` -> ``("adacomp", "updates")``; ``"adacomp"`` -> ``("adacomp", None)``.

  The suffix picks ``CompressedOptimizer``'s exchange (None: the library's default), so
  that one run can time the old default (``+gradients``) beside the new (``+updates``).
  """
  compressor, _, exchange = variant.partition("+")
  if exchange not in ("", "gradients", "updates"):
    raise ValueError("a compressor's suffix is +gradients or +updates. "
                     f"Received: compressor={variant!r}")
  return compressor, exchange or None


def worker_argv(args, model, variant, out, alone=False, topk_density=None):
  """The command line of one network_worker.py process."""
  settings = MODEL_SETTINGS[model]
  compressor, exchange = split_variant(variant)
  argv = [sys.executable, os.path.join(HERE, "network_worker.py"), f"--model={model}",
          f"--compressor={compressor}", f"--batch_size={args.batch_size}",
          f"--width={args.width}", f"--learning_rate={settings['learning_rate']}",
          f"--max_steps={args.max_steps or settings['max_steps']}",
          f"--target_accuracy={target_accuracy(args, model)}",
          f"--eval_every={args.eval_every}", f"--threads={args.threads}", f"--out={out}"]
  if exchange:
    argv.append(f"--optimizer_exchange={exchange}")
  if topk_density:
    argv.append(f"--topk_density={topk_density:.6g}")
  if alone:
    argv.append("--alone")
  if args.synthetic:
    argv.append("--synthetic")
  return argv


def worker_env(tf_config=None):
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
  env.pop("TF_CONFIG", None)
  if tf_config:
    env["TF_CONFIG"] = tf_config
  return env


def compute_only(args, model, work):
  """The floor: ``--workers`` processes at once, each training alone (no exchange)."""
  outs = [os.path.join(work, f"{model}_alone_{i}.json") for i in range(args.workers)]
  codes = run_workers([(worker_argv(args, model, "none", out, alone=True), worker_env())
                       for out in outs], args.run_timeout)
  if any(codes):
    raise RuntimeError(f"compute-only run of {model} failed: return codes {codes}")
  runs = [_read_json(out) for out in outs]
  return {"median_step_seconds": statistics.mean(r["median_step_seconds"] for r in runs),
          "evaluations": runs[0]["evaluations"], "step_seconds": runs[0]["step_seconds"]}


def cluster_run(args, net, model, compressor, work, topk_density=None):
  """One MultiWorkerMirroredStrategy run across the namespaces; worker 0's figures."""
  from tf_adacomp import distribute  # pylint: disable=g-import-not-at-top
  addresses = [f"{net.address(i)}:{PORT}" for i in range(args.workers)]
  outs = [os.path.join(work, f"{model}_{compressor}_{net.rate}_{i}.json")
          for i in range(args.workers)]
  commands = [(net.command(i, worker_argv(args, model, compressor, outs[i],
                                          topk_density=topk_density)),
               worker_env(distribute.tf_config(addresses, i)))
              for i in range(args.workers)]
  start = time.perf_counter()
  codes = run_workers(commands, args.run_timeout)
  wall = time.perf_counter() - start
  if any(code != 0 for code in codes):
    return {"compressor": compressor, "failed": True, "return_codes": codes,
            "wall_seconds": wall}
  run = _read_json(outs[0])
  run.update(compressor=compressor, wall_seconds=wall, topk_density=topk_density)
  return run


def time_to_accuracy(run, target):
  """Seconds of training (evaluations not counted) until test accuracy >= target.

  The first step (XLA compilation, a one-off cost) is counted at the median step.
  None when the target was not reached.
  """
  if not target:
    return None
  for evaluation in run["evaluations"]:
    if evaluation["accuracy"] >= target:
      times = run["step_seconds"][:evaluation["step"]]
      return run["median_step_seconds"] + sum(times[1:])
  return None


def summarize(model, rate, run, dense, floor, target):
  if run.get("failed"):
    return {"model": model, "rate": rate, "compressor": run["compressor"], "failed": True}
  last = run["evaluations"][-1] if run["evaluations"] else {}
  return {"model": model, "rate": rate, "compressor": run["compressor"],
          "median_step_seconds": run["median_step_seconds"],
          "speed_up_over_dense": (dense["median_step_seconds"] / run["median_step_seconds"]
                                  if dense and not dense.get("failed") else None),
          "ratio_to_compute_only": run["median_step_seconds"] / floor["median_step_seconds"],
          "bytes_sent_per_step": run["bytes_sent_per_step"],
          "compression_ratio": run["dense_bytes_per_step"] / run["bytes_sent_per_step"],
          "steps": len(run["step_seconds"]), "final_accuracy": last.get("accuracy"),
          "target_accuracy": target or None,
          "time_to_accuracy_seconds": time_to_accuracy(run, target),
          "topk_density": run.get("topk_density")}


def print_rows(rows):
  print(f"\n{'model':<9}{'link':>8}{'compressor':>18}{'ms/step':>10}{'speed-up':>10}"
        f"{'/floor':>8}{'bytes/step':>13}{'steps':>7}{'accuracy':>10}{'to target s':>13}")
  for r in rows:
    if r.get("failed"):
      print(f"{r['model']:<9}{r['rate']:>8}{r['compressor']:>18}   FAILED")
      continue
    speed = f"{r['speed_up_over_dense']:.2f}x" if r["speed_up_over_dense"] else "-"
    tta = r["time_to_accuracy_seconds"]
    print(f"{r['model']:<9}{r['rate']:>8}{r['compressor']:>18}"
          f"{1e3 * r['median_step_seconds']:>10.1f}{speed:>10}"
          f"{r['ratio_to_compute_only']:>7.2f}x{r['bytes_sent_per_step']:>13,.0f}"
          f"{r['steps']:>7}{r['final_accuracy'] or 0:>10.4f}"
          f"{(f'{tta:.1f}' if tta is not None else '-'):>13}")


def plot(rows, runs, floors, path):
  """Step time per link and compressor (floor dashed); accuracy against training time."""
  plt = report.pyplot()

  models = sorted({r["model"] for r in rows})
  fig, axes = plt.subplots(1, len(models) + 1, figsize=(5 * (len(models) + 1), 4))
  for ax, model in zip(axes, models):
    mine = [r for r in rows if r["model"] == model and not r.get("failed")]
    labels = [f"{r['rate']}\n{r['compressor']}" for r in mine]
    ax.bar(range(len(mine)), [1e3 * r["median_step_seconds"] for r in mine])
    ax.axhline(1e3 * floors[model]["median_step_seconds"], color="k", linestyle="--",
               label="compute only")
    ax.set_xticks(range(len(mine)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms per step")
    ax.set_title(f"{model}: step time")
    ax.legend()
  ax = axes[-1]
  for (model, rate, compressor), run in runs.items():
    if model != models[0] or run.get("failed") or not run["evaluations"]:
      continue
    median = run["median_step_seconds"]
    seconds = [median + sum(run["step_seconds"][1:e["step"]]) for e in run["evaluations"]]
    ax.plot(seconds, [e["accuracy"] for e in run["evaluations"]],
            label=f"{rate} {compressor}")
  ax.set_xscale("log")
  ax.set_xlabel("training seconds")
  ax.set_ylabel("test accuracy")
  ax.set_title(f"{models[0]}: accuracy against time")
  ax.legend(fontsize=7)
  report.save_figure(fig, path)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="mlp,resnet20")
  parser.add_argument("--rates", default="100mbit,1gbit", help="tc rates, comma-separated")
  parser.add_argument("--compressors", default="none,bf16,adacomp,topk,fft,fp16",
                      help="topk runs at AdaComp's measured density (adacomp before it); "
                      "a suffix +gradients or +updates picks CompressedOptimizer's exchange "
                      "(e.g. adacomp+gradients,adacomp+updates)")
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--batch_size", type=int, default=64, help="per worker")
  parser.add_argument("--width", type=int, default=2048, help="the MLP's hidden width")
  parser.add_argument("--max_steps", type=int, default=None,
                      help="per run (default: mlp 300, resnet20 30)")
  parser.add_argument("--target_accuracy", type=float, default=None,
                      help="test accuracy to time (default: mlp 0.80, resnet20 none)")
  parser.add_argument("--eval_every", type=int, default=10)
  parser.add_argument("--threads", type=int, default=None,
                      help="TensorFlow threads per worker (default: cores / workers)")
  parser.add_argument("--run_timeout", type=float, default=900, help="seconds per run")
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
  if args.workers < 2:
    parser.error(f"--workers must be >= 2. Received: workers={args.workers}")
  args.threads = args.threads or max(1, (os.cpu_count() or 2) // args.workers)
  if not netns.available():
    sys.exit("network.py needs root and iproute2 (`ip netns`, `tc`) to build its "
             "namespaces; run it with sudo.")

  work = tempfile.mkdtemp(prefix="tf_adacomp_network_")
  rows, runs, floors, links = [], {}, {}, {}
  for model in models:
    target = target_accuracy(args, model)
    floors[model] = compute_only(args, model, work)
    print(f"{model}: compute-only step {1e3 * floors[model]['median_step_seconds']:.1f} ms",
          flush=True)
    for rate in rates:
      with netns.LimitedNetwork(args.workers, rate) as net:
        links[rate] = net.throughput(0, 1)
        print(f"{model} {rate}: measured link {links[rate] / 1e6:.0f} Mbit/s", flush=True)
        for compressor in compressors:
          density = None
          if compressor == "topk":
            adacomp = runs.get((model, rate, "adacomp"), {})
            if adacomp.get("failed") or not adacomp:
              print(f"{model} {rate}: topk skipped (it runs at AdaComp's density, and "
                    "the AdaComp run failed)", flush=True)
              continue
            density = (report.adacomp_elements_sent(adacomp["variables"])
                       / adacomp["parameters"])
          run = cluster_run(args, net, model, compressor, work, density)
          runs[(model, rate, compressor)] = run
          dense = runs.get((model, rate, "none"))
          rows.append(summarize(model, rate, run, dense, floors[model], target))
          print_rows(rows[-1:])
  print_rows(rows)
  report.write_json(args.json, {
      "benchmark": "network", "workers": args.workers, "threads_per_worker": args.threads,
      "batch_size_per_worker": args.batch_size, "machine": platform.platform(),
      "cpus": os.cpu_count(), "measured_link_bits_per_second": links,
      "targets": TARGETS, "compute_only": floors, "rows": rows,
      "runs": {"/".join(key): run for key, run in runs.items()}})
  if args.plot:
    plot(rows, runs, floors, args.plot)


if __name__ == "__main__":
  main()
