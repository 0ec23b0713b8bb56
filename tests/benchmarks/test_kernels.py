"""benchmarks/kernels.py times the kernels that training runs: the compressor's bucket
calls, which the exchange makes by default (``AdaComp(fuse=True)``), so its payload is a
bucket payload (docs/wire_format.md#buckets), not a per-tensor one."""

import json
import math
import os
import subprocess
import sys

import pytest

import benchmark_scripts

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")


@pytest.mark.slow  # a benchmark's run (tests/conftest.py)
def test_a_row_times_the_bucket_kernels_that_the_exchange_uses(tmp_path):
  result = subprocess.run(
      [sys.executable, os.path.join(benchmark_scripts.BENCHMARKS_DIR, "kernels.py"),
       "--sizes=4K", "--bin_sizes=50", "--max_densities=0.25", "--repeats=1",
       f"--json={tmp_path / 'k.json'}"],
      capture_output=True, text=True, env=ENV, timeout=600, check=False)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  (row,) = json.loads((tmp_path / "k.json").read_text())["rows"]
  n = 4096
  assert (row["elements"], row["bin_size"], row["max_density"]) == (n, 50, 0.25)
  assert 0 < row["selected"] <= math.ceil(0.25 * n)
  # The default's Elias-Fano positions (docs/wire_format.md#positions-elias-fano), in a
  # bucket of one tensor: 4 * (4 + T + S + the body's words) with T = S = 1 (a
  # per-tensor payload would have a 3-word header); the body's low bits take the fewest
  # words among those whose unary counts fit bins + capacity bits.
  assert row["positions"] == "elias_fano"
  count = row["selected"]

  def words(low):
    return math.ceil(count * (low + 1) / 32) + math.ceil((math.ceil(n / 2**low) + count) / 32)

  longest = math.ceil(n / 50) + math.ceil(0.25 * n)
  low_bits = min((low for low in range((n - 1).bit_length() + 1)
                  if math.ceil(n / 2**low) + count <= longest), key=lambda low: (words(low), low))
  assert row["payload_bytes"] == 4 * (4 + 1 + 1 + words(low_bits))
  assert row["compression_ratio"] == 4 * n / row["payload_bytes"]
  assert all(row[key] > 0 for key in ("fused_pass_s", "compress_s", "decode_s",
                                      "decode_4_replicas_s"))
  # The first call compiles: it takes longer than the median of the calls after it.
  assert row["first_compress_s"] > row["compress_s"]
  assert row["first_decode_4_replicas_s"] > row["decode_4_replicas_s"]
