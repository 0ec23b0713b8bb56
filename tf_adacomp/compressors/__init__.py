"""Gradient compressors: one module per algorithm, a small contract in ``base``."""

from tf_adacomp.compressors.adacomp import AdaComp
from tf_adacomp.compressors.base import Compressor
from tf_adacomp.compressors.base import TensorPlan
from tf_adacomp.compressors.base import infer_kind
from tf_adacomp.compressors.cast import BF16
from tf_adacomp.compressors.cast import FP16
from tf_adacomp.compressors.cast import NoCompression
from tf_adacomp.compressors.fft import FFTCompressor
from tf_adacomp.compressors.registry import available
from tf_adacomp.compressors.registry import get_compressor
from tf_adacomp.compressors.registry import register
from tf_adacomp.compressors.registry import serialize
from tf_adacomp.compressors.sign import RotatingSign
from tf_adacomp.compressors.topk import TopK
