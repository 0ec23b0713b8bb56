"""Throughput of the AdaComp kernels against one fused XLA pass ``residue + grad``.

The kernels timed are those training runs: the compressor's bucket calls
(``AdaComp.compress``, ``decompress``, ``nbytes``, on a bucket of plans), which the
exchange makes for every bucket of a step; with the default ``fuse=True`` they are the
bucket kernels of ``ops.adacomp_bucket``. Each tensor is timed as a bucket of its own.

The fused pass is the floor: a compressor must at least read the gradient and the
residue and write the residue once. Every figure is a ratio to that pass, taken in the
same run on the same tensors (these machines are noisy); each time is the median of
``--repeats`` calls after one warm-up (compilation) call.

    python benchmarks/kernels.py                      # 1M..64M elements, prints a table
    python benchmarks/kernels.py --sizes 1M,4M --json out/kernels.json
"""

import argparse
import os
import platform
import statistics
import time

import numpy as np
import tensorflow as tf

import report  # benchmarks/report.py, beside this script
import tf_adacomp
from tf_adacomp import ops


@tf.function(jit_compile=True)
def _fused_pass(grad, residue):
  return residue + grad


def _median_seconds(fn, repeats):
  return _first_and_median_seconds(fn, repeats)[1]


def _first_and_median_seconds(fn, repeats):
  """The first call (compiling, then running) and the median of ``repeats`` after it."""
  start = time.perf_counter()
  out = fn()
  tf.nest.map_structure(lambda t: t.numpy(), out)
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    tf.nest.map_structure(lambda t: t.numpy(), out)  # wait for the result
    times.append(time.perf_counter() - start)
  return first, statistics.median(times)


def _parse_size(text):
  text = text.strip().upper()
  scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
  return int(float(text.rstrip("KM")) * scale)


def bench(n, bin_size, max_density, repeats, seed=0, positions=None):
  """One row: times and ratios for a flat float32 tensor of ``n`` elements."""
  rng = np.random.default_rng(seed)
  # A residue that has been accumulating (larger than one gradient), as in training.
  grad = tf.constant(rng.standard_normal(n, dtype=np.float32))
  residue = tf.constant(3 * rng.standard_normal(n, dtype=np.float32))
  # The compressor with the default settings but the bin size and capacity measured, and
  # the plan the exchange would make for this tensor.
  compressor = tf_adacomp.AdaComp(dense_bin_size=bin_size, max_density=max_density,
                                  positions=positions)
  plans = [compressor.plan([n], tf.float32, kind="dense")]
  fused = _median_seconds(lambda: _fused_pass(grad, residue), repeats)
  first_compress, compress = _first_and_median_seconds(
      lambda: compressor.compress([grad], [(residue,)], plans), repeats)
  payload, _ = compressor.compress([grad], [(residue,)], plans)
  # The exchange decodes [replicas, width] rows.
  rows, gathered = payload[None], tf.stack([payload] * 4)
  decode = _median_seconds(lambda: compressor.decompress(rows, plans), repeats)
  first_decode4, decode4 = _first_and_median_seconds(
      lambda: compressor.decompress(gathered, plans), repeats)
  nbytes = int(tf.reduce_sum(compressor.nbytes(payload, plans)))
  return {
      "elements": n, "bin_size": bin_size, "max_density": max_density,
      "positions": compressor.positions,
      "selected": int(payload[0]), "payload_bytes": nbytes,
      "compression_ratio": 4 * n / nbytes,
      "fused_pass_s": fused, "compress_s": compress, "decode_s": decode,
      "decode_4_replicas_s": decode4,
      # Compiling is most of a first call: the seconds a process pays once per kernel.
      "first_compress_s": first_compress, "first_decode_4_replicas_s": first_decode4,
      "compress_elements_per_s": n / compress, "decode_elements_per_s": n / decode,
      "compress_over_fused": compress / fused, "decode_over_fused": decode / fused,
  }


def _print_row(r):
  n = r["elements"]
  print(f"{n:>10} {r['bin_size']:>4} {r['max_density']:>5.3g} {r['positions']:>6} "
        f"{100 * r['selected'] / n:>6.2f} {r['compression_ratio']:>6.1f}x "
        f"{1e3 * r['fused_pass_s']:>9.2f} {1e3 * r['compress_s']:>8.2f} "
        f"{r['compress_over_fused']:>9.2f}x {r['compress_elements_per_s'] / 1e6:>8.1f} "
        f"{1e3 * r['decode_s']:>7.2f} {r['decode_over_fused']:>8.2f}x "
        f"{1e3 * r['decode_4_replicas_s']:>8.2f} {r['first_compress_s']:>10.2f} "
        f"{r['first_decode_4_replicas_s']:>10.2f}", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sizes", default="1M,4M,16M,64M")
  parser.add_argument("--bin_sizes", default="50,500")
  parser.add_argument("--max_densities", default=f"{tf_adacomp.AdaComp().max_density},1.0",
                      help="payload capacities to measure (the compressor default first)")
  parser.add_argument("--full_capacity_limit", default="16M",
                      help="skip max_density=1.0 above this many elements (memory: its "
                      "payload buffers are larger than the tensor)")
  parser.add_argument("--positions", default=tf_adacomp.AdaComp().positions,
                      help="AdaComp positions to measure: elias_fano (the default), bin, "
                      "tensor, or several (elias_fano,bin)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--json", default="out/kernels.json")
  args = parser.parse_args()

  rows = []
  header = (f"{'elements':>10} {'L_T':>4} {'cap':>5} {'pos':>6} {'sel%':>6} {'ratio':>7} "
            f"{'fused ms':>9} {'comp ms':>8} {'comp/fused':>10} {'Melem/s':>8} "
            f"{'dec ms':>7} {'dec/fused':>9} {'dec4 ms':>8} {'1st comp s':>10} "
            f"{'1st dec4 s':>10}")
  print(f"device: {tf.config.list_logical_devices()[0].name}, {os.cpu_count()} CPUs, "
        f"TensorFlow {tf.__version__}\n{header}")
  for size in args.sizes.split(","):
    n = _parse_size(size)
    for bin_size in map(int, args.bin_sizes.split(",")):
      for density in map(float, args.max_densities.split(",")):
        if density == 1.0 and n > _parse_size(args.full_capacity_limit):
          continue
        for positions in args.positions.split(","):
          r = bench(n, bin_size, density, args.repeats, positions=positions)
          rows.append(r)
          _print_row(r)
  result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "tensorflow": tf.__version__,
                        "devices": [d.name for d in tf.config.list_logical_devices()]},
            "rows": rows}
  report.write_json(args.json, result)


if __name__ == "__main__":
  main()
