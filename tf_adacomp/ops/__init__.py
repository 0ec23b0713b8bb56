"""XLA-compiled compression kernels: pure functions of tensors, eager-testable."""

from tf_adacomp.ops.adacomp import adacomp_compress
from tf_adacomp.ops.adacomp import adacomp_decompress
from tf_adacomp.ops.adacomp import payload_nbytes
from tf_adacomp.ops.adacomp import payload_words
from tf_adacomp.ops.adasum import adasum_reduce
from tf_adacomp.ops.adasum import adasum_tree
from tf_adacomp.ops.fft import fft_compress
from tf_adacomp.ops.fft import fft_decompress
from tf_adacomp.ops.fft import fft_payload_nbytes
from tf_adacomp.ops.fft import fft_payload_words
from tf_adacomp.ops.topk import topk_compress
from tf_adacomp.ops.topk import topk_decompress
from tf_adacomp.ops.topk import topk_payload_words
