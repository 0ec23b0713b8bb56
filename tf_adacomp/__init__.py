"""tf_adacomp: AdaComp gradient compression for TensorFlow/Keras distributed training.

Public API (a flat list, as in Keras and optax):

- compressors: ``AdaComp``, ``TopK``, ``RotatingSign``, ``FFTCompressor``, ``FP16``,
  ``BF16``, ``NoCompression``, the ``Compressor`` base class, ``TensorPlan``, ``get_compressor``,
  ``serialize_compressor``;
- distribution: ``CompressedAllReduce`` (cross-device ops for ``MirroredStrategy``),
  ``CompressedOptimizer`` (a Keras optimizer wrapper, any strategy); both sum the
  replicas' gradients or, with ``reduction="adasum"``, combine them with Adasum; both
  adapt ``Exchange``, the one exchange engine, whose ``replica_exchange`` (also as a
  function) is the entry point for custom training loops (docs/distributed.md);
- helpers: ``tf_adacomp.distribute`` (logical devices, strategies, TF_CONFIG, the Keras
  multi-worker fix; ``UnsynchronizedWorkersWarning``, when TF_CONFIG names several
  workers but a compressed optimizer is built outside a multi-worker strategy),
  ``CompressionStats`` (a Keras callback), ``BackupAndRestore`` (Keras' callback
  with atomic, chief-only backups for multi-worker training), ``schedules``
  (``WarmupDecay`` and ``LEGW``, learning-rate schedules for large batches);
- ResIST: ``tf_adacomp.resist`` (a ResNet of sub-ResNets trained independently per replica);
- kernels: ``tf_adacomp.ops`` (``adacomp_compress``, ``adacomp_decompress``,
  ``payload_nbytes``, ``fft_compress``, ``fft_decompress``, ``adasum_reduce``).
"""

from tf_adacomp import quiet as _quiet

# The `tf-adacomp` command hides TensorFlow's start-up lines; in its own process this
# first import of TensorFlow is the one place to do so (quiet.py). Elsewhere: a no-op.
with _quiet.quiet_tensorflow_import():
  import tensorflow as _tensorflow  # pylint: disable=unused-import

from tf_adacomp import distribute
from tf_adacomp import hierarchy
from tf_adacomp import scaling
from tf_adacomp import local_steps
from tf_adacomp import ops
from tf_adacomp import resist
from tf_adacomp import schedules
from tf_adacomp import shared_moment
from tf_adacomp.backup import BackupAndRestore
from tf_adacomp.callbacks import CompressionStats
from tf_adacomp.exchange import Exchange
from tf_adacomp.exchange import replica_exchange
from tf_adacomp.cross_device_ops import CompressedAllReduce
from tf_adacomp.distribute import UnsynchronizedWorkersWarning
from tf_adacomp.optimizer import CompressedOptimizer
from tf_adacomp.compressors import AdaComp
from tf_adacomp.compressors import BF16
from tf_adacomp.compressors import Compressor
from tf_adacomp.compressors import FFTCompressor
from tf_adacomp.compressors import FP16
from tf_adacomp.compressors import NoCompression
from tf_adacomp.compressors import RotatingSign
from tf_adacomp.compressors import TensorPlan
from tf_adacomp.compressors import TopK
from tf_adacomp.compressors import available as available_compressors
from tf_adacomp.compressors import get_compressor
from tf_adacomp.compressors import register as register_compressor
from tf_adacomp.compressors import serialize as serialize_compressor

from tf_adacomp._version import __version__

__all__ = [
    "AdaComp",
    "BF16",
    "BackupAndRestore",
    "CompressedAllReduce",
    "CompressedOptimizer",
    "CompressionStats",
    "Compressor",
    "Exchange",
    "FFTCompressor",
    "FP16",
    "NoCompression",
    "RotatingSign",
    "TensorPlan",
    "TopK",
    "UnsynchronizedWorkersWarning",
    "available_compressors",
    "distribute",
    "get_compressor",
    "local_steps",
    "ops",
    "register_compressor",
    "replica_exchange",
    "resist",
    "schedules",
    "serialize_compressor",
    "shared_moment",
]
