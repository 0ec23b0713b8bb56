"""How the compressed all-gather scales with the number of workers: measured, then modelled.

The compressed exchange all-gathers every sender's payload to every sender, and every
sender decodes one row per sender: what each receives and decodes grows with the number
of senders N, where a dense ring all-reduce receives 2 (N - 1) / N times the gradient.
This benchmark measures what it can on one host and models the rest from it:

1. Decode cost (in this process): the wide MLP (network_worker.build_mlp) and the
   Fashion-MNIST CNN (examples/fashion_mnist.py) of benchmarks/network.py train a few
   steps on Fashion-MNIST with AdaComp and error feedback (``Exchange.compress``, one
   replica; by default the update exchange of SGD with momentum, CompressedOptimizer's
   default); the last --rows payloads are kept. ``Exchange.decode`` of R of them (the
   exchange's own decode in a ``tf.function``, whose bucket kernels are XLA-compiled as
   in training) is timed for each R of --rows, and ``c0 + c_row * R`` fitted (least
   squares). Their bytes (``stats.exchange_nbytes``: what one sender sends per step,
   length words included) give the payload; 4 bytes per parameter the dense gradient.
2. Real processes: --workers processes (2, 4, 8) of benchmarks/network_worker.py on
   127.0.0.1, MultiWorkerMirroredStrategy over gRPC, one CPU device and one thread each,
   CompressedOptimizer with AdaComp (flat: every worker is a sender), --process_steps
   steps of batch 64 per worker. Bytes received per worker per step: (N - 1) x the
   bytes each sends, counted from the lengths really exchanged (padded to the longest,
   as the gather does). The host has few cores: 8 processes time-slice them, so step
   times are not network figures.
3. The model, N = 2..1,024 workers of --devices_per_worker devices, from 1.'s payload
   and decode fit, with tf_adacomp.scaling's formulas: bytes received per worker per
   step for the flat all-gather (N x devices senders; its ring enters each worker
   once), the hierarchical exchange (N senders, one payload per worker, assumed as
   large as one device's), the dense float32 ring all-reduce and the bfloat16 one
   (across the N workers); decode per step c0 + c_row x rows; the crossover in bytes
   (``scaling.crossover_senders``) and, at each --rates link, the N from which the
   all-gather's bytes / rate + decode exceed the ring's bytes / rate.

Prints the tables, writes JSON (--json) and the plot (--plot).

    python benchmarks/scaling.py                                  # everything, ~10 min
    python benchmarks/scaling.py --workers= --models=cnn          # no processes
    python benchmarks/scaling.py --measurements=out/scaling.json  # the model only, again
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

import report  # benchmarks/report.py, beside this script

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("mlp", "cnn")
MODEL_NAMES = {"mlp": "wide MLP", "cnn": "Fashion-MNIST CNN"}
RATES = {"1gbit": 1e9, "10gbit": 10e9, "25gbit": 25e9, "100gbit": 100e9,
         "400gbit": 400e9}
EXCHANGES = ("flat", "hierarchical", "dense_ring", "bf16_ring")
EXCHANGE_NAMES = {"flat": "flat all-gather", "hierarchical": "hierarchical all-gather",
                  "dense_ring": "dense ring all-reduce",
                  "bf16_ring": "bf16 ring all-reduce"}
LEARNING_RATE, MOMENTUM, BATCH = 0.05, 0.9, 64  # network.py's settings


def _ints(text, name):
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise SystemExit(f"--{name} must be integers separated by commas. Received: "
                     f"{name}={text!r}") from None
  if any(v < 1 for v in values):
    raise SystemExit(f"--{name} must be >= 1. Received: {name}={text!r}")
  return values


# --- 1. Decode cost and payloads, in this process ------------------------------------------


def _model_and_data(model, width):
  """A model of network.py and Fashion-MNIST's training arrays (float32 images)."""
  import types  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, HERE)
  import network_worker  # pylint: disable=g-import-not-at-top
  from tf_adacomp.examples import fashion_mnist  # pylint: disable=g-import-not-at-top

  keras_model = (network_worker.build_mlp(width) if model == "mlp"
                 else fashion_mnist.build_model(None, None))
  images, labels = fashion_mnist.load_arrays(types.SimpleNamespace(data_dir=None))["train"]
  return keras_model, (images[..., None] / 255.0).astype("float32"), labels.astype("int32")


def measure_decode(model, rows, repeats, warmup_steps, exchange_kind="updates", width=2048,
                   seed=0):
  """Trains ``model`` a few steps with AdaComp, keeps the payloads, times their decode.

  Returns:
    A dict: parameters, dense bytes, per-step payload bytes (mean, min, max), the
    padded bytes per sender for each R of ``rows``, decode seconds per R, and the fit.
  """
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import tf_adacomp  # pylint: disable=g-import-not-at-top
  from tf_adacomp import exchange as exchange_lib  # pylint: disable=g-import-not-at-top
  from tf_adacomp import stats  # pylint: disable=g-import-not-at-top

  keras.utils.set_random_seed(seed)
  net, images, labels = _model_and_data(model, width)
  variables = net.trainable_variables
  compressor = tf_adacomp.AdaComp()
  engine = exchange_lib.Exchange(compressor)
  plans = [compressor.plan(v.shape, v.dtype, v.path) for v in variables]
  if any(plan.summable for plan in plans):
    raise RuntimeError("every tensor is expected in the all-gather (AdaComp, min_size=0)")
  states = [tuple(tf.Variable(t, trainable=False) for t in compressor.init(plan))
            for plan in plans]
  velocity = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  @tf.function
  def step(x, y):
    """One compressed step of one replica: SGD with momentum, the update exchanged
    (or the gradient), with error feedback; returns what this sender would send."""
    with tf.GradientTape() as tape:
      loss = loss_fn(y, net(x, training=True))
    grads = tape.gradient(loss, variables)
    if exchange_kind == "updates":
      for v, g in zip(velocity, grads):
        v.assign(MOMENTUM * v - LEARNING_RATE * g)
      sent = [tf.identity(v) for v in velocity]
    else:
      sent = grads
    out = engine.compress(plans, sent, [tuple(s.read_value() for s in state)
                                        for state in states])
    incoming = exchange_lib.Incoming(1, data=out.buffer(), lengths=out.lengths()[None])
    decoded = engine.decode(plans, out, incoming)
    for state, new in zip(states, out.states):
      for var, value in zip(state, new):
        var.assign(value)
    for var, v, d in zip(variables, velocity, decoded):
      if exchange_kind == "updates":
        var.assign_add(d)
      else:
        v.assign(MOMENTUM * v - LEARNING_RATE * d)
        var.assign_add(v)
    return out.buffer(), out.lengths(), loss

  keep = max(rows)
  rng = np.random.default_rng(seed)
  buffers, lengths, losses = [], [], []
  start = time.perf_counter()
  for _ in range(warmup_steps + keep):
    batch = rng.integers(0, len(labels), BATCH)
    buffer, length, loss = step(images[batch], labels[batch])
    buffers.append(buffer.numpy())
    lengths.append(length.numpy())
    losses.append(float(loss))
  train_seconds = time.perf_counter() - start
  buffers, lengths = buffers[-keep:], np.stack(lengths[-keep:])
  per_step = [int(stats.exchange_nbytes(length[None]).numpy().sum()) for length in lengths]

  # The static structure of the exchange (payload widths), as every replica has it.
  template = engine.compress(plans, [tf.zeros(p.shape, p.dtype) for p in plans],
                             [compressor.init(p) for p in plans])
  decode_seconds, padded = {}, {}
  for r in rows:
    data = tf.constant(np.concatenate(buffers[-r:]))
    rows_lengths = tf.constant(lengths[-r:])
    decode = tf.function(lambda d, l, r=r: engine.decode(
        plans, template, exchange_lib.Incoming(r, data=d, lengths=l)))
    times = []
    for k in range(repeats + 1):  # the first call traces and compiles
      begin = time.perf_counter()
      tf.nest.map_structure(lambda t: t.numpy(), decode(data, rows_lengths))
      if k:
        times.append(time.perf_counter() - begin)
    decode_seconds[r] = statistics.median(times)
    padded[r] = stats.gather_nbytes(lengths[-r:])[1]
    print(f"  {model}: decode of {r:>3} rows {1e3 * decode_seconds[r]:9.2f} ms", flush=True)
  c_row, c0 = np.polyfit(np.array(rows, float), np.array([decode_seconds[r] for r in rows]), 1)
  parameters = sum(int(np.prod(v.shape)) for v in variables)
  return {"model": model, "exchange": exchange_kind, "parameters": parameters,
          "dense_bytes": 4 * parameters, "buckets": int(lengths.shape[1]),
          "warmup_steps": warmup_steps, "recorded_steps": keep,
          "train_seconds": train_seconds, "first_loss": losses[0], "last_loss": losses[-1],
          "payload_bytes_per_step": per_step,
          "payload_bytes": statistics.mean(per_step),
          "payload_bytes_min": min(per_step), "payload_bytes_max": max(per_step),
          "padded_payload_bytes": {str(r): padded[r] for r in rows},
          "decode_seconds": {str(r): decode_seconds[r] for r in rows},
          "decode_fit": {"c0_seconds": float(c0), "c_row_seconds": float(c_row)}}


# --- 2. Real processes -----------------------------------------------------------------


def _free_ports(count):
  import socket  # pylint: disable=g-import-not-at-top
  sockets = []
  try:
    for _ in range(count):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind(("127.0.0.1", 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def measure_processes(model, workers, steps, timeout, width=2048):
  """``workers`` network_worker.py processes on 127.0.0.1 training ``model`` with AdaComp.

  Returns:
    A dict: the bytes each worker sent and received per step (from the exchanged
    lengths: ``(workers - 1)`` x the padded bytes each sends), dense bytes, step times.
  """
  import network  # pylint: disable=g-import-not-at-top  (run_workers, worker_env)

  from tf_adacomp import distribute  # pylint: disable=g-import-not-at-top
  from tf_adacomp import scaling  # pylint: disable=g-import-not-at-top

  addresses = [f"127.0.0.1:{port}" for port in _free_ports(workers)]
  with tempfile.TemporaryDirectory(prefix="scaling-") as work:
    outs = [os.path.join(work, f"worker{i}.json") for i in range(workers)]
    argv = [sys.executable, os.path.join(HERE, "network_worker.py"), f"--model={model}",
            "--compressor=adacomp", f"--batch_size={BATCH}", f"--width={width}",
            f"--learning_rate={LEARNING_RATE}", f"--max_steps={steps}",
            "--target_accuracy=0", f"--eval_every={steps}", "--eval_size=500",
            "--threads=1"]
    commands = [(argv + [f"--out={out}"], network.worker_env(distribute.tf_config(addresses, i)))
                for i, out in enumerate(outs)]
    start = time.perf_counter()
    codes = network.run_workers(commands, timeout)
    wall = time.perf_counter() - start
    if any(codes):
      raise RuntimeError(f"{workers} workers of {model} failed: return codes {codes}")
    runs = []
    for out in outs:
      with open(out) as f:
        runs.append(json.load(f))
  skip = steps // 2  # the first steps compile, and send more (residues start at zero)
  sent = [b for run in runs for b in run["step_bytes_sent"][skip:]]
  sent_per_step = statistics.mean(sent)
  dense = runs[0]["dense_bytes_per_step"]
  return {"model": model, "workers": workers, "devices_per_worker": 1, "steps": steps,
          "steps_counted": steps - skip, "wall_seconds": wall,
          "sent_bytes_per_step": sent_per_step,
          "received_bytes_per_step": scaling.allgather_bytes_received(workers, sent_per_step),
          "dense_bytes": dense,
          "dense_ring_received_bytes_per_step":
              scaling.ring_allreduce_bytes_received(workers, dense),
          "median_step_seconds": statistics.median(
              t for run in runs for t in run["step_seconds"][skip:]),
          "cpus": os.cpu_count()}


# --- 3. The model ------------------------------------------------------------------------


def exchange_bytes(workers, devices, payload_bytes, dense_bytes):
  """Bytes received per worker per step by each exchange (``EXCHANGES``)."""
  from tf_adacomp import scaling  # pylint: disable=g-import-not-at-top
  return {"flat": scaling.allgather_bytes_received(workers * devices, payload_bytes),
          "hierarchical": scaling.allgather_bytes_received(workers, payload_bytes),
          "dense_ring": scaling.ring_allreduce_bytes_received(workers, dense_bytes),
          "bf16_ring": scaling.ring_allreduce_bytes_received(workers, dense_bytes / 2)}


def decode_rows(workers, devices):
  """Rows each all-gather decodes per step: one per sender."""
  return {"flat": workers * devices, "hierarchical": workers}


def _first_loss(loses, limit):
  """The smallest N in [2, limit] with ``loses(N)``; None when none does."""
  for n in range(2, limit + 1):
    if loses(n):
      return n
  return None


def crossovers(payload_bytes, dense_bytes, c0, c_row, devices, rates):
  """Workers from which each all-gather loses to the rings, in bytes and in time.

  Bytes: the hierarchical exchange's senders are the workers, so its crossover with the
  dense ring is ``scaling.crossover_senders`` itself; the flat one's is the first N whose
  N x devices senders receive more than the ring across the N workers. Time, per link
  rate: all-gather bytes / rate + decode (c0 + c_row x rows) against ring bytes / rate.
  """
  from tf_adacomp import scaling  # pylint: disable=g-import-not-at-top
  bound = scaling.crossover_senders(dense_bytes, payload_bytes)  # no later than this

  def gather_loses(kind, ring="dense_ring", rate=None):
    def loses(n):
      b = exchange_bytes(n, devices, payload_bytes, dense_bytes)
      if rate is None:
        return b[kind] > b[ring]
      decode = c0 + c_row * decode_rows(n, devices)[kind]
      return 8 * b[kind] / rate + decode > 8 * b[ring] / rate
    return loses

  result = {
      "bytes": {
          "hierarchical_vs_dense": scaling.crossover_senders(dense_bytes, payload_bytes),
          "flat_vs_dense": _first_loss(gather_loses("flat"), bound),
          "hierarchical_vs_bf16": scaling.crossover_senders(dense_bytes / 2, payload_bytes),
          "flat_vs_bf16": _first_loss(gather_loses("flat", "bf16_ring"), bound)},
      "time": {}}
  for name in rates:
    result["time"][name] = {
        kind + "_vs_dense": _first_loss(gather_loses(kind, rate=RATES[name]), bound)
        for kind in ("flat", "hierarchical")}
  return result


def model_rows(payload_bytes, dense_bytes, c0, c_row, devices, workers_grid):
  """One row per N of ``workers_grid``: bytes and decode per step of each exchange, and
  whether ``scaling.check_allgather`` warns for each all-gather's senders."""
  from tf_adacomp import scaling  # pylint: disable=g-import-not-at-top
  rows = []
  for n in workers_grid:
    decode = {kind: c0 + c_row * r for kind, r in decode_rows(n, devices).items()}
    rows.append({
        "workers": n, "bytes": exchange_bytes(n, devices, payload_bytes, dense_bytes),
        "decode_seconds": decode,
        "warns": {"flat": scaling.check_allgather(n * devices, payload_bytes, dense_bytes,
                                                  warn=False),
                  "hierarchical": scaling.check_allgather(n, payload_bytes, dense_bytes,
                                                          warn=False)}})
  return rows


def build_model(measured, devices, workers_grid, rates):
  """The model of each measured network: ``{model: {"rows", "crossovers", ...}}``."""
  out = {}
  for name, m in measured.items():
    fit = m["decode_fit"]
    out[name] = {
        "payload_bytes": m["payload_bytes"], "dense_bytes": m["dense_bytes"],
        "compression": m["dense_bytes"] / m["payload_bytes"],
        "devices_per_worker": devices, "decode_fit": fit,
        "rows": model_rows(m["payload_bytes"], m["dense_bytes"], fit["c0_seconds"],
                           fit["c_row_seconds"], devices, workers_grid),
        "crossovers": crossovers(m["payload_bytes"], m["dense_bytes"], fit["c0_seconds"],
                                 fit["c_row_seconds"], devices, rates)}
  return out


# --- Output ------------------------------------------------------------------------------


def _mb(nbytes):
  return f"{nbytes / 1e6:,.3f}"


def print_measured(measured, processes):
  for name, m in measured.items():
    fit = m["decode_fit"]
    print(f"\n{MODEL_NAMES[name]} ({m['parameters']:,} parameters, dense "
          f"{m['dense_bytes']:,} bytes): payload {m['payload_bytes']:,.0f} bytes per step "
          f"(min {m['payload_bytes_min']:,}, max {m['payload_bytes_max']:,}; "
          f"{m['dense_bytes'] / m['payload_bytes']:.0f}x); decode c0 "
          f"{1e3 * fit['c0_seconds']:.2f} ms + {1e3 * fit['c_row_seconds']:.3f} ms per row")
    print(f"{'rows':>5} {'decode ms':>10} {'fit ms':>8} {'padded bytes/sender':>20}")
    for r, seconds in m["decode_seconds"].items():
      print(f"{r:>5} {1e3 * seconds:>10.2f} "
            f"{1e3 * (fit['c0_seconds'] + fit['c_row_seconds'] * int(r)):>8.2f} "
            f"{m['padded_payload_bytes'][r]:>20,.0f}")
  if processes:
    print(f"\nprocesses on 127.0.0.1 ({os.cpu_count()} CPUs: they time-slice):")
    print(f"{'model':>6} {'workers':>7} {'sent B/step':>12} {'received B/step':>16} "
          f"{'dense ring B/step':>18} {'median step ms':>15}")
    for p in processes:
      print(f"{p['model']:>6} {p['workers']:>7} {p['sent_bytes_per_step']:>12,.0f} "
            f"{p['received_bytes_per_step']:>16,.0f} "
            f"{p['dense_ring_received_bytes_per_step']:>18,.0f} "
            f"{1e3 * p['median_step_seconds']:>15.1f}")


def print_model(model):
  for name, m in model.items():
    c = m["crossovers"]
    print(f"\nmodel, {MODEL_NAMES[name]}: MB received per worker per step, decode ms "
          f"({m['devices_per_worker']} devices per worker; flat = workers x devices "
          f"senders)")
    print(f"{'workers':>7} " + " ".join(f"{k:>13}" for k in EXCHANGES)
          + f" {'flat dec ms':>11} {'hier dec ms':>11} {'warns':>11}")
    for row in m["rows"]:
      warns = "/".join(k[:4] for k, v in row["warns"].items() if v) or "-"
      print(f"{row['workers']:>7} " + " ".join(f"{_mb(row['bytes'][k]):>13}" for k in EXCHANGES)
            + f" {1e3 * row['decode_seconds']['flat']:>11.1f}"
            + f" {1e3 * row['decode_seconds']['hierarchical']:>11.1f} {warns:>11}")
    print(f"crossover in bytes: hierarchical (senders = workers) from N = "
          f"{c['bytes']['hierarchical_vs_dense']} (vs bf16: {c['bytes']['hierarchical_vs_bf16']}),"
          f" flat from N = {c['bytes']['flat_vs_dense']} workers "
          f"(vs bf16: {c['bytes']['flat_vs_bf16']})")
    for rate, t in c["time"].items():
      print(f"with decode, at {rate}: flat loses from N = {t['flat_vs_dense']}, "
            f"hierarchical from N = {t['hierarchical_vs_dense']}")


def plot(model, processes, path):
  plt = report.pyplot()
  fig, axes = plt.subplots(1, len(model), figsize=(6.2 * len(model), 4.6), squeeze=False)
  styles = {"flat": ("C3", "-"), "hierarchical": ("C0", "-"), "dense_ring": ("k", "--"),
            "bf16_ring": ("0.5", ":")}
  for ax, (name, m) in zip(axes[0], model.items()):
    n = [row["workers"] for row in m["rows"]]
    for kind in EXCHANGES:
      label = EXCHANGE_NAMES[kind]
      if kind == "flat":
        label += f" ({m['devices_per_worker']} devices/worker)"
      color, style = styles[kind]
      ax.plot(n, [row["bytes"][kind] for row in m["rows"]], style, color=color, label=label)
    measured = [p for p in processes if p["model"] == name]
    if measured:
      ax.plot([p["workers"] for p in measured],
              [p["received_bytes_per_step"] for p in measured], "o", color="C2",
              label="measured, processes on one host (1 device each)")
    c = m["crossovers"]["bytes"]
    for kind, key, color in (("hierarchical", "hierarchical_vs_dense", "C0"),
                             ("flat", "flat_vs_dense", "C3")):
      if c[key]:
        ax.axvline(c[key], color=color, alpha=0.5, linewidth=1,
                   label=f"crossover with the dense ring, {kind}: N = {c[key]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers N")
    ax.set_ylabel("bytes received per worker per step")
    ax.set_title(f"{MODEL_NAMES[name]}: AdaComp payload {m['payload_bytes']:,.0f} B, "
                 f"dense {m['dense_bytes'] / 1e6:.1f} MB", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
  report.save_figure(fig, path)
  plt.close(fig)


def parse(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="mlp,cnn", help="of " + ",".join(MODELS))
  parser.add_argument("--rows", default="1,2,4,8,16,32,64",
                      help="payload rows decoded at once (senders), for the fit")
  parser.add_argument("--repeats", type=int, default=5, help="timed decodes per row count")
  parser.add_argument("--warmup_steps", type=int, default=100,
                      help="compressed training steps before payloads are kept")
  parser.add_argument("--exchange", default="updates", choices=("updates", "gradients"),
                      help="what is compressed: the SGD-momentum update "
                      "(CompressedOptimizer's default) or the gradient")
  parser.add_argument("--width", type=int, default=2048, help="the MLP's hidden width")
  parser.add_argument("--workers", default="2,4,8",
                      help="worker processes to run (empty: none)")
  parser.add_argument("--process_models", default=None,
                      help="models the processes train (default: --models)")
  parser.add_argument("--process_steps", type=int, default=30)
  parser.add_argument("--run_timeout", type=float, default=900, help="seconds per run")
  parser.add_argument("--devices_per_worker", type=int, default=8,
                      help="devices per worker in the model (flat senders = N x this)")
  parser.add_argument("--max_workers", type=int, default=1024)
  parser.add_argument("--rates", default="1gbit,10gbit,100gbit", help="of " + ",".join(RATES))
  parser.add_argument("--measurements", default=None,
                      help="a JSON this script wrote: reuse its measurements, run the "
                      "model only (no TensorFlow work, no processes)")
  parser.add_argument("--json", default="out/scaling.json")
  parser.add_argument("--plot", default="docs/images/scaling.png", help="empty: none")
  args = parser.parse_args(argv)
  args.models = [m for m in args.models.split(",") if m]
  bad = [m for m in args.models if m not in MODELS]
  if bad or not args.models:
    parser.error(f"--models must name some of {MODELS}. Received: models={args.models!r}")
  args.rows = _ints(args.rows, "rows")
  args.workers = _ints(args.workers, "workers")
  args.rates = [r for r in args.rates.split(",") if r]
  if any(r not in RATES for r in args.rates):
    parser.error(f"--rates must be some of {tuple(RATES)}. Received: rates={args.rates!r}")
  args.process_models = ([m for m in args.process_models.split(",") if m]
                         if args.process_models is not None else args.models)
  for name in ("repeats", "devices_per_worker", "process_steps"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1. Received: {name}={getattr(args, name)}")
  if args.warmup_steps < 0 or args.max_workers < 2:
    parser.error(f"--warmup_steps must be >= 0 and --max_workers >= 2. Received: "
                 f"warmup_steps={args.warmup_steps}, max_workers={args.max_workers}")
  return args


def main(argv=None):
  args = parse(argv)
  grid = [2 ** k for k in range(1, int(math.log2(args.max_workers)) + 1)]
  if args.measurements:
    with open(args.measurements) as f:
      previous = json.load(f)
    measured = {m: previous["measured"][m] for m in args.models if m in previous["measured"]}
    processes, machine = previous.get("processes", []), previous.get("machine")
  else:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    machine = {"platform": platform.platform(), "processor": platform.processor(),
               "cpus": os.cpu_count(), "python": platform.python_version(),
               "tensorflow": tf.__version__}
    measured = {}
    for model in args.models:
      print(f"measuring decode of {model} ...", flush=True)
      measured[model] = measure_decode(model, args.rows, args.repeats, args.warmup_steps,
                                       args.exchange, args.width)
    processes = []
    for model in args.process_models:
      for workers in args.workers:
        print(f"running {workers} processes of {model} ...", flush=True)
        processes.append(measure_processes(model, workers, args.process_steps,
                                           args.run_timeout, args.width))
  model = build_model(measured, args.devices_per_worker, grid, args.rates)
  print_measured(measured, processes)
  print_model(model)
  result = {"machine": machine, "command": " ".join(["benchmarks/scaling.py", *(argv or sys.argv[1:])]),
            "settings": {"devices_per_worker": args.devices_per_worker,
                         "rates": {r: RATES[r] for r in args.rates},
                         "exchange": measured[args.models[0]].get("exchange")},
            "measured": measured, "processes": processes, "model": model}
  report.write_json(args.json, result)
  if args.plot:
    plot(model, processes, args.plot)
  return result


if __name__ == "__main__":
  main()
