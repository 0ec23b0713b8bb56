"""ResIST: layer-wise decomposition of ResNets into sub-ResNets trained independently.

Dun, Wolfe, Jermaine, Kyrillidis, UAI 2022 (arXiv 2107.00961); docs/resist.md.

- ``resnet(depth)``: a pre-activation CIFAR ResNet whose non-first residual blocks switch
  on and off per replica (``ResidualBlock``; ``set_gates``, ``get_gates``);
- ``deal``: each round's partition of those blocks among the replicas, from a shared seed;
  ``inference_scale``: the test-time factor of their residual branches;
- ``ResIST``: a Keras callback that trains with it inside ``model.fit`` (or, with
  ``partition=False``, local SGD), exchanging only what each replica trained;
- ``communication``: bytes per round of ResIST, local SGD and data-parallel on a model;
- ``HolderAverage``: the exchange itself (an average over each block's holders).
"""

from tf_adacomp.resist.model import ResidualBlock
from tf_adacomp.resist.model import blocks_per_stage
from tf_adacomp.resist.model import get_gates
from tf_adacomp.resist.model import partitionable_blocks
from tf_adacomp.resist.model import resnet
from tf_adacomp.resist.model import set_gates
from tf_adacomp.resist.partition import deal
from tf_adacomp.resist.partition import inference_scale
from tf_adacomp.resist.sync import HolderAverage
from tf_adacomp.resist.sync import reset_optimizer
from tf_adacomp.resist.trainer import ResIST
from tf_adacomp.resist.trainer import communication

__all__ = [
    "HolderAverage",
    "ResIST",
    "ResidualBlock",
    "blocks_per_stage",
    "communication",
    "deal",
    "get_gates",
    "inference_scale",
    "partitionable_blocks",
    "reset_optimizer",
    "resnet",
    "set_gates",
]
