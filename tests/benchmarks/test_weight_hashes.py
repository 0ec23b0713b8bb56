"""benchmarks/weight_hashes.py: two runs of the same code give the same hashes, and
``--compare`` finds a hash that differs."""

import json
import os
import subprocess
import sys

import pytest

import benchmark_scripts

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
# Two of the quickest: one replica without compression, and 2 replicas through FP16
# (a compressor, the update exchange, the strategy's collectives).
ONLY = "one_replica_none,fp16"


def _run(*flags):
  return subprocess.run([sys.executable,
                         os.path.join(benchmark_scripts.BENCHMARKS_DIR, "weight_hashes.py"),
                         "--only", ONLY, *flags],
                        capture_output=True, text=True, env=ENV, timeout=600, check=False)


@pytest.mark.slow  # two processes that each start TensorFlow and train: about 25 s
def test_two_runs_hash_the_same_and_compare_finds_an_altered_hash(tmp_path):
  first = _run("--out", str(tmp_path / "first.json"))
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  result = json.loads((tmp_path / "first.json").read_text())
  assert list(result["hashes"]) == ONLY.split(",")
  for name, digest in result["hashes"].items():
    assert len(digest) == 64 and not digest.startswith("error"), (name, digest)
    assert name in first.stdout and digest[:16] in first.stdout
  assert result["details"]["fp16"]["bytes_sent"]  # the wrapper's byte counts are hashed
  # The second run compares against the first with fp16's hash altered.
  result["hashes"]["fp16"] = "0" * 64
  (tmp_path / "altered.json").write_text(json.dumps(result))
  second = _run("--out", str(tmp_path / "second.json"),
                "--compare", str(tmp_path / "altered.json"))
  assert second.returncode == 1, second.stdout[-3000:] + second.stderr[-3000:]
  assert "one_replica_none           same" in second.stdout
  assert "fp16                       DIFFERENT" in second.stdout
  first_hashes = json.loads((tmp_path / "first.json").read_text())["hashes"]
  assert json.loads((tmp_path / "second.json").read_text())["hashes"] == first_hashes
