"""The weights' fingerprints of local steps, in their CPU and GPU forms, on one CPU.

Inside a round of local steps every replica takes, per step, up to two fingerprints of
the weights it trains (``tf_adacomp.local_steps.fingerprints``: one after its step, one
before the next, to tell weights set from outside). On a CPU they are computed by
TensorFlow's int32 matrix product (the CPU form), on a GPU by one XLA program (the GPU
form, which ``ops.variant.forced`` also builds on a CPU). This times both on the tensors
of a model, alternating calls of the two, against a float32 sum of the same tensors
(about the cost of reading them): the median of ``--repeats`` calls of each, after a
first untimed one, and each form's median over the read's.

    python benchmarks/fingerprints.py                      # the 5.8M MLP, one thread
    python benchmarks/fingerprints.py --model cnn --threads 2 --json out/fp.json
"""

import argparse
import os
import platform
import statistics
import time

import report  # benchmarks/, beside this

MODELS = ("cnn", "mlp")  # as paired_step.py builds them


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="mlp", choices=MODELS)
  parser.add_argument("--threads", type=int, default=1,
                      help="TensorFlow's intra-op threads (network.py's workers: 1)")
  parser.add_argument("--repeats", type=int, default=41)
  parser.add_argument("--json", default="out/fingerprints.json")
  args = parser.parse_args(argv)
  for name in ("threads", "repeats"):
    value = getattr(args, name)
    if value < 1:
      parser.error(f"--{name} must be at least 1. Received: {name}={value}")
  return args


def main(argv=None):
  args = parse_args(argv)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  tf.config.threading.set_intra_op_parallelism_threads(args.threads)
  tf.config.threading.set_inter_op_parallelism_threads(args.threads)
  from tf_adacomp import local_steps  # pylint: disable=import-outside-toplevel
  from tf_adacomp.examples import fashion_mnist  # pylint: disable=import-outside-toplevel
  from tf_adacomp.ops import variant  # pylint: disable=import-outside-toplevel
  import network_worker  # pylint: disable=import-outside-toplevel  (benchmarks/, beside this)

  # network.py's wide MLP or the Fashion-MNIST CNN: their trainable weights as built.
  model = (fashion_mnist.build_model(None, None) if args.model == "cnn"
           else network_worker.build_mlp(2048))
  weights = model.trainable_variables
  calls = {"read": tf.function(lambda: tf.stack([tf.reduce_sum(w) for w in weights]))}
  for form in variant.FORMS:
    with variant.forced(form):  # a tf.function keeps the form it was traced in
      calls[form] = tf.function(lambda: local_steps.fingerprints(weights))
      first = calls[form]().numpy()
    if form == variant.FORMS[0]:
      prints = first
    elif list(first) != list(prints):
      raise AssertionError(f"the forms' fingerprints differ: {list(prints)} and "
                           f"{list(first)}")
  calls["read"]().numpy()
  times = {name: [] for name in calls}
  for _ in range(args.repeats):
    for name, call in calls.items():
      start = time.perf_counter()
      call().numpy()
      times[name].append(time.perf_counter() - start)
  medians = {name: statistics.median(t) for name, t in times.items()}
  elements = sum(w.shape.num_elements() for w in weights)
  print(f"{args.model}: {elements:,} weights in {len(weights)} tensors, "
        f"{args.threads} thread(s), median of {args.repeats} calls")
  for name in calls:
    print(f"  {name:5s} {1e3 * medians[name]:7.2f} ms  "
          f"{medians[name] / medians['read']:5.2f}x the read")
  print(f"  GPU form (XLA) / CPU form: {medians['gpu'] / medians['cpu']:.2f}x")
  out = {"model": args.model, "elements": elements, "threads": args.threads,
         "repeats": args.repeats, "median_seconds": medians,
         "xla_over_cpu_form": medians["gpu"] / medians["cpu"], "seconds": times,
         "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                     "tensorflow": tf.__version__}}
  report.write_json(args.json, out)


if __name__ == "__main__":
  main()
