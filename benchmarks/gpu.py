"""AdaComp's kernels and training steps on whatever device TensorFlow finds (a GPU first).

One command measures:

1. Kernels, for 1M to 64M elements in float32 and bfloat16: the device's copy bandwidth
   (``-x``, n elements read and n written), one fused ``residue + grad`` pass, AdaComp's
   compress and its decode of 1 and 8 gathered rows (the compressor's bucket calls, as
   the exchange makes them for a tensor alone in its bucket). Each is its floor bytes per
   second as a fraction of the copy bandwidth at the same size and dtype.
2. Steps of the Fashion-MNIST CNN, ResNet-50 at 224 px and the Shakespeare transformer
   (the examples' models, synthetic data): one replica's step with the gradient
   compressed and its payload decoded as 2 gathered rows inside the step, against the
   dense step (the gradient applied as it is): the step time ratio, the first call's
   time (tracing and XLA compilation) and the peak device memory.

No collective runs: this measures what compression costs in compute on the device, the
other half of the trade that benchmarks/network.py measures on a link.

    python benchmarks/gpu.py                 # on TensorFlow's first GPU (else its CPU)
    python benchmarks/gpu.py --smoke         # toy sizes on CPU, under a minute (the suite)
    python benchmarks/gpu.py --export DIR    # the same programs as XLA HLO, not timed

``--export`` is for a device whose machine has no TensorFlow: it writes each program as
TensorFlow hands it to XLA (serialized HLO, lzma-compressed), with its input specs and,
at the smallest size, digests of TensorFlow's outputs; ``benchmarks/gpu_xla.py DIR``
then compiles and times them there with JAX's XLA and writes the same tables
(docs/gpu.md). ``--forms cpu,gpu`` measures both forms of the kernels
(``tf_adacomp.ops.variant``) side by side. Writes out/gpu.json and out/gpu.md.
"""

import argparse
import contextlib
import json
import lzma
import os
import platform
import time

import numpy as np
import tensorflow as tf

import gpu_report  # benchmarks/gpu_report.py, beside this script
import tf_adacomp
from tf_adacomp.compressors import base
from tf_adacomp.ops import variant

FULL = dict(sizes="1M,4M,16M,64M", models="cnn,resnet50,transformer", repeats=10,
            batch_scale=1.0)
SMOKE = dict(sizes="64K,256K", models="cnn,transformer", repeats=3, batch_scale=0.125)
MODELS = ("cnn", "resnet50", "transformer")
DTYPES = ("float32", "bfloat16")


def parse_size(text):
  """``"16M"`` -> 16777216; ``"64K"`` -> 65536; a plain number as it is."""
  text = text.strip().upper()
  scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
  try:
    value = int(float(text.rstrip("KM")) * scale)
  except ValueError:
    value = 0
  if value < 1:
    raise ValueError(f"`--sizes` takes positive sizes such as 1M or 64K. Received: {text!r}")
  return value


def _spec(shape, dtype, seed, **init):
  """An input: ``init="normal"`` (``mean``, ``std``) or ``"integers"`` below ``high``."""
  if init.get("init", "normal") == "normal":
    init = dict(dict(init="normal", mean=0.0, std=1.0), **init)
  return dict(shape=[int(d) for d in shape], dtype=dtype, seed=seed, **init)


class Program:
  """One XLA program to time: a jit-compiled function and the inputs it takes.

  ``info["form"]`` is the kernels' form (``tf_adacomp.ops.variant``): ``"auto"`` for
  the device's own, else the one forced while the program is traced.
  """

  def __init__(self, info, fn, specs):
    self.info, self.fn, self.specs = info, fn, specs

  @property
  def name(self):
    return self.info["name"]

  def form(self):
    """The context its traces must be made in."""
    form = self.info.get("form", "auto")
    return contextlib.nullcontext() if form == "auto" else variant.forced(form)


def _jit(fn):
  return tf.function(fn, jit_compile=True, autograph=False)


def _suffix(form):
  return "" if form == "auto" else f"-{form}"


def kernel_programs(n, dtype_name, forms):
  """The copy and fused pass for ``n`` elements, and compress and decode in each form."""
  dtype = tf.as_dtype(dtype_name)
  compressor = tf_adacomp.AdaComp()
  plans = [compressor.plan([n], dtype, kind="dense")]
  res_dtype = base.residue_dtype(dtype)
  g_size, r_size = dtype.size, res_dtype.size
  tag = f"{n}-{dtype_name}"
  grad = _spec([n], dtype_name, 0)
  residue = _spec([n], res_dtype.name, 1, std=3.0)  # one that has accumulated
  info = dict(group="kernel", elements=n, dtype=dtype_name, form="auto")
  programs = [
      Program(dict(info, name=f"kernel-copy-{tag}", kernel="copy",
                   floor_bytes=2 * n * g_size), _jit(lambda x: -x), [grad]),
      Program(dict(info, name=f"kernel-fused-{tag}", kernel="fused",
                   floor_bytes=n * (g_size + 2 * r_size)),
              _jit(lambda g, r: r + tf.cast(g, r.dtype)), [grad, residue]),
  ]
  width = compressor.width(plans)
  for form in forms:
    info = dict(info, form=form)
    compress_name = f"kernel-compress-{tag}{_suffix(form)}"
    programs.append(Program(
        dict(info, name=compress_name, kernel="compress", floor_bytes=n * (g_size + 2 * r_size)),
        _jit(lambda g, r: compressor.compress([g], [(r,)], plans)), [grad, residue]))
    for rows in (1, 8):
      # The decode's input is the compress program's payload, stacked: a gathered exchange.
      payload = dict(init="output", of=compress_name, index=0, rows=rows,
                     shape=[rows, width], dtype="int32", seed=0)
      programs.append(Program(
          dict(info, name=f"kernel-decode_{rows}-{tag}{_suffix(form)}",
               kernel=f"decode_{rows}", floor_bytes=n * g_size + rows * width * 4),
          _jit(lambda p: compressor.decompress(p, plans)), [payload]))
  return programs


def build_model(name, batch_scale):
  """(model, batch, input spec, classes): an example's model at this benchmark's size."""
  import keras  # pylint: disable=g-import-not-at-top

  from tf_adacomp.examples import fashion_mnist  # pylint: disable=g-import-not-at-top
  from tf_adacomp.examples import shakespeare_transformer  # pylint: disable=g-import-not-at-top

  keras.utils.set_random_seed(0)
  smoke = batch_scale < 1
  if name == "cnn":
    batch = max(2, int(128 * batch_scale))
    return fashion_mnist.build_model(None, None), batch, ([28, 28, 1], "float32"), 10
  if name == "resnet50":
    size, batch = (32, 2) if smoke else (224, 64)
    model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3),
                                        classes=1000, classifier_activation=None)
    return model, batch, ([size, size, 3], "float32"), 1000
  if name == "transformer":
    seq, embed, heads, layers = (16, 32, 2, 1) if smoke else (128, 128, 4, 2)
    batch = max(2, int(64 * batch_scale))
    model = shakespeare_transformer.gpt(65, seq, embed, heads, layers)
    return model, batch, ([seq], "int32"), 65
  raise ValueError(f"`--models` takes {', '.join(MODELS)}. Received: {name!r}")


def step_programs(name, batch_scale, forms, learning_rate=0.01, replicas=2):
  """A model's dense step and its AdaComp step in each form, as pure functions."""
  import keras  # pylint: disable=g-import-not-at-top

  model, batch, (shape, x_dtype), classes = build_model(name, batch_scale)
  trainable = [tf.convert_to_tensor(v) for v in model.trainable_variables]
  others = [tf.convert_to_tensor(v) for v in model.non_trainable_variables]
  compressor = tf_adacomp.AdaComp()
  plans = [compressor.plan(v.shape, v.dtype, name=v.path) for v in model.trainable_variables]
  buckets = compressor.buckets(plans)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  x_spec = (_spec([batch] + shape, x_dtype, 10, init="integers", high=classes)
            if x_dtype == "int32" else _spec([batch] + shape, x_dtype, 10))
  y_shape = [batch, shape[0]] if name == "transformer" else [batch]
  y_spec = _spec(y_shape, "int32", 11, init="integers", high=classes)

  def weight_specs(tensors, seed):
    # Each weight as the model's initialiser made it, in distribution: its mean and std.
    return [_spec(t.shape, t.dtype.name, seed + i, mean=float(tf.reduce_mean(t)),
                  std=float(tf.math.reduce_std(t))) for i, t in enumerate(tensors)]

  def gradients(x, y, weights, non_trainable):
    with tf.GradientTape() as tape:
      tape.watch(weights)
      logits, non_trainable = model.stateless_call(weights, non_trainable, x, training=True)
      loss = loss_fn(y, logits)
    # An Embedding's gradient comes as IndexedSlices: dense, as the exchange sends it.
    grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, weights)]
    return grads, non_trainable, loss

  def dense(x, y, weights, non_trainable):
    grads, non_trainable, loss = gradients(x, y, weights, non_trainable)
    return [w - learning_rate * g for w, g in zip(weights, grads)], non_trainable, loss

  def adacomp(x, y, weights, non_trainable, residues):
    grads, non_trainable, loss = gradients(x, y, weights, non_trainable)
    totals, new_residues = list(grads), list(residues)
    for i, plan in enumerate(plans):
      if plan.summable:  # sent as a plain sum: every replica's the same here
        totals[i] = grads[i] * replicas
    for bucket in buckets:
      bucket_plans = [plans[i] for i in bucket]
      payload, states = compressor.compress(
          [grads[i] for i in bucket], [(residues[i],) for i in bucket], bucket_plans)
      # Decoded as the exchange decodes an all-gather of `replicas` payloads.
      decoded = compressor.decompress(tf.stack([payload] * replicas), bucket_plans)
      for i, state, total in zip(bucket, states, decoded):
        new_residues[i], totals[i] = state[0], total
    weights = [w - learning_rate * t / replicas for w, t in zip(weights, totals)]
    return weights, non_trainable, new_residues, loss

  info = dict(group="step", model=name, batch=batch, form="auto",
              parameters=int(sum(np.prod(t.shape) for t in trainable)))
  specs = [x_spec, y_spec, weight_specs(trainable, 100), weight_specs(others, 5000)]
  residue_specs = [_spec(t.shape, t.dtype.name, 9000 + i, std=0.0)
                   for i, t in enumerate(trainable)]
  return [Program(dict(info, name=f"step-{name}-dense", variant="dense"), _jit(dense), specs)
          ] + [Program(dict(info, name=f"step-{name}-adacomp{_suffix(form)}",
                            variant="adacomp", form=form), _jit(adacomp),
                       specs + [residue_specs]) for form in forms]


def _inputs(program, outputs):
  """The program's arguments as tensors: generated from specs, or an earlier output."""

  def one(spec):
    if isinstance(spec, list):
      return [one(s) for s in spec]
    if spec["init"] == "output":
      payload = tf.nest.flatten(outputs[spec["of"]])[spec["index"]]
      return tf.stack([payload] * spec["rows"])
    return tf.cast(tf.constant(gpu_report.make_array(spec)), spec["dtype"])

  return [one(s) for s in program.specs]


def _sync(result):
  # One program's outputs are ready together: bring its smallest to the host (not the
  # weights of a step), after which every call before it has finished.
  min(tf.nest.flatten(result), key=lambda t: t.shape.num_elements()).numpy()


def time_program(program, args, repeats, device):
  """First call (tracing + compile) seconds, median seconds per call, peak bytes."""
  gpu = "GPU" in device
  if gpu:
    tf.config.experimental.reset_memory_stats(device.split("device:")[-1])
  start = time.perf_counter()
  with program.form():  # the first call traces
    result = program.fn(*args)
  _sync(result)
  compile_s = time.perf_counter() - start
  seconds, calls = gpu_report.time_calls(lambda: program.fn(*args), _sync, repeats)
  timing = {"seconds": seconds, "compile_s": compile_s, "calls": calls}
  if gpu:
    timing["peak_bytes"] = tf.config.experimental.get_memory_info(
        device.split("device:")[-1])["peak"]
  return result, timing


def all_programs(args):
  """Every program the arguments ask for: the steps first, then the kernels by size.

  Raises:
    ValueError: a form, dtype, size or model that is not known, named.
  """
  forms = args.forms.split(",")
  for form in forms:
    if form not in ("auto",) + variant.FORMS:
      raise ValueError(f"`--forms` takes auto, {', '.join(variant.FORMS)}. Received: {form!r}")
  programs = []
  for model in filter(None, args.models.split(",")):  # first: the figures that matter most
    programs += step_programs(model, args.batch_scale, forms)
  for size in args.sizes.split(","):
    for dtype in args.dtypes.split(","):
      if dtype not in DTYPES:
        raise ValueError(f"`--dtypes` takes {', '.join(DTYPES)}. Received: {dtype!r}")
      programs += kernel_programs(parse_size(size), dtype, forms)
  return programs


def export(programs, directory, reference_elements):
  """Writes each program's HLO, the manifest and TensorFlow's reference outputs."""
  os.makedirs(directory, exist_ok=True)
  outputs, manifest = {}, []
  for program in programs:
    args = _inputs(program, outputs)
    with program.form():
      hlo = program.fn.experimental_get_compiler_ir(*args)(stage="hlo_serialized")
    with open(os.path.join(directory, program.name + ".hlo.xz"), "wb") as f:
      f.write(lzma.compress(hlo, preset=1))
    entry = dict(program.info, specs=program.specs)
    if program.info["group"] == "kernel":
      # Run on the exporting machine: decode programs take this payload, and at the
      # smallest size AdaComp's outputs are the reference the other device is compared
      # with (which also checks that both made the same inputs).
      with program.form():
        outputs[program.name] = program.fn(*args)
      if (program.info["elements"] == reference_elements
          and program.info["kernel"] not in ("copy", "fused")):
        entry["reference"] = [gpu_report.digest(t.numpy())
                              for t in tf.nest.flatten(outputs[program.name])]
    manifest.append(entry)
    print(f"exported {program.name}", flush=True)
  with open(os.path.join(directory, "manifest.json"), "w") as f:
    json.dump({"tensorflow": tf.__version__, "programs": manifest}, f, indent=1)
  print(f"wrote {len(manifest)} programs to {directory}")


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sizes", help=f"elements per kernel (default {FULL['sizes']})")
  parser.add_argument("--dtypes", default=",".join(DTYPES))
  parser.add_argument("--models", help=f"of {', '.join(MODELS)} (default all)")
  parser.add_argument("--forms", default="auto",
                      help="the kernels' forms to time: auto (the device's own), cpu, gpu "
                      "(tf_adacomp.ops.variant); e.g. cpu,gpu to compare them")
  parser.add_argument("--repeats", type=int, help="timed rounds per program (default 10)")
  parser.add_argument("--batch_scale", type=float,
                      help="batch sizes times this (default 1: the examples' batches)")
  parser.add_argument("--smoke", action="store_true",
                      help=f"toy sizes on CPU: {SMOKE}")
  parser.add_argument("--export", metavar="DIR",
                      help="write the programs' HLO for gpu_xla.py instead of timing")
  parser.add_argument("--json", default="out/gpu.json")
  parser.add_argument("--markdown", default="out/gpu.md")
  args = parser.parse_args()
  for key, value in (SMOKE if args.smoke else FULL).items():
    if getattr(args, key) is None:  # what the command line leaves out
      setattr(args, key, value)
  if args.repeats < 1:
    parser.error(f"`--repeats` must be >= 1. Received: {args.repeats}")
  if args.batch_scale <= 0:
    parser.error(f"`--batch_scale` must be > 0. Received: {args.batch_scale}")
  try:
    programs = all_programs(args)
  except ValueError as e:
    parser.error(str(e))
  smallest = min(p.info["elements"] for p in programs if p.info["group"] == "kernel") \
      if any(p.info["group"] == "kernel" for p in programs) else None
  if args.export:
    export(programs, args.export, smallest)
    return
  gpus = tf.config.list_logical_devices("GPU")
  device = (gpus or tf.config.list_logical_devices("CPU"))[0].name
  timings, outputs = {}, {}
  with tf.device(device):
    for program in programs:
      outputs[program.name], timings[program.name] = time_program(
          program, _inputs(program, outputs), args.repeats, device)
      print(f"{program.name}: {1e3 * timings[program.name]['seconds']:.3f} ms", flush=True)
  details = tf.config.experimental.get_device_details(tf.config.list_physical_devices(
      "GPU")[0]) if gpus else {}
  machine = {"device": details.get("device_name", device) if gpus else
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
             "runtime": f"TensorFlow {tf.__version__} on {device}",
             "platform": platform.platform(), "tensorflow": tf.__version__}
  gpu_report.write(gpu_report.summarise([p.info for p in programs], timings, machine),
                   args.json, args.markdown)


if __name__ == "__main__":
  main()
