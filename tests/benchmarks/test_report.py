"""benchmarks/report.py: AdaComp's element count read back from its bytes."""

import numpy as np
import pytest
import tensorflow as tf

import benchmark_scripts  # noqa: F401  (benchmarks/ on sys.path)
import report
from tf_adacomp import ops
from tf_adacomp import stats
import tiers


# The fast tier: [7] (the same count for every shape); the others with --full.
@pytest.mark.parametrize("shape,bin_size", [tiers.slow([3, 3, 16, 32], 50),
                                            tiers.slow([300, 100], 500), ([7], 50)])
def test_elements_sent_matches_the_payload_count(shape, bin_size):
  rng = np.random.default_rng(0)
  grad = tf.constant(rng.standard_normal(shape).astype(np.float32))
  residue = tf.constant(3 * rng.standard_normal(shape).astype(np.float32))
  payload, _ = ops.adacomp_compress(grad, residue, bin_size)
  count = int(payload[0])  # word 0 of the payload: elements sent (docs/wire_format.md)
  words = int(ops.payload_nbytes(payload)) // 4
  sent = float(stats.exchange_nbytes([[words]])[0])  # one replica: its bytes + 4
  estimate = report.adacomp_elements_sent(
      {"v": {"shape": shape, "sent_bytes": 3 * sent, "steps": 3}})
  bits = (int(np.prod(shape)) - 1).bit_length() + 1
  # The last packed word may be partly used: the estimate is exact to within one word.
  assert count <= estimate < count + 32 / bits
  assert report.adacomp_elements_sent(
      {"v": {"shape": shape, "sent_bytes_per_step": sent}}) == estimate


def test_write_json_makes_the_folder(tmp_path, capsys):
  path = tmp_path / "a" / "b.json"
  report.write_json(str(path), {"x": 1})
  assert path.read_text().replace(" ", "").replace("\n", "") == '{"x":1}'
  assert str(path) in capsys.readouterr().out
