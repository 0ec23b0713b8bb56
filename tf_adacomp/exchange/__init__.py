"""The compressed exchange, in one place: compress, move, decode, combine, count bytes.

Every compressed exchange of the package runs through ``Exchange``, whose work is split
in three stages, so that only the middle one depends on how payloads travel:

1. ``Exchange.compress``, on each replica: its gradients become payloads and new
   compressor states. Summable payloads (dense tensors, e.g. a float16 cast) are kept
   whole (and all-reduced joined, one buffer per dtype); compact payloads (AdaComp, FFT,
   top-k) come one per bucket (``Compressor.buckets``: AdaComp fuses the tensors of one
   bin size into one payload, the others send one per tensor), are trimmed to their used
   words and joined in one buffer, with their lengths in a second one (``Outgoing``).
2. Moving them: in a replica context with the strategy's collectives
   (``Exchange.replica_exchange``: one ``all_reduce`` of the summable payloads and two
   ``all_gather`` calls, lengths and data; this works under every strategy, including
   ``MultiWorkerMirroredStrategy`` over gRPC, and without one), or in a cross-replica
   context by copying each replica's buffers to each destination device
   (``Exchange.local_exchange``, used by ``CompressedAllReduce`` and by
   ``simulate.SimulatedLearners``).
3. ``Exchange.decode``: from what arrived (``Incoming``: every replica's buffers and
   lengths, or the summed summable payloads), the ``[replicas, words]`` rows of each
   tensor are rebuilt and decoded in replica order, so that every replica (and every
   destination device) computes bit-identical results; the ``Reduction`` combines them.

What one replica sent is counted from the lengths that were really exchanged, by
``stats.exchange_nbytes`` (the one byte model of the package; docs/wire_format.md).

With ``reduction="adasum"`` every payload travels to every replica (summable ones too:
Adasum needs each replica's tensor, not their sum), each replica's row is decoded on its
own, and the decoded tensors are combined with ``ops.adasum_reduce`` (same tree, same
order, on every replica).

The package's modules, one per part of that work (each name is importable from
``tf_adacomp.exchange`` as well):

- ``engine``: ``Exchange`` (its three stages, the flat collectives and the copies of
  ``local_exchange``) and ``replica_exchange``;
- ``hierarchical``: the exchange with one payload per worker (``hierarchy.Hierarchy``);
- ``wire``: ``Outgoing``, ``Incoming``, ``Exchanged``, and the reading of gathered
  buffers (``checked_lengths``, ``gathered_rows``);
- ``warm_up``: the dense warm-up step's float32 payloads;
- ``reduction``: ``Reduction`` (``SUM``, ``ADASUM``), ``get_reduction``,
  ``check_reduction``.
"""

from tf_adacomp.exchange.engine import Exchange
from tf_adacomp.exchange.engine import all_reduce_joined
from tf_adacomp.exchange.engine import densified
from tf_adacomp.exchange.engine import _marked
from tf_adacomp.exchange.engine import replica_exchange
from tf_adacomp.exchange.reduction import ADASUM
from tf_adacomp.exchange.reduction import REDUCTIONS
from tf_adacomp.exchange.reduction import SUM
from tf_adacomp.exchange.reduction import Reduction
from tf_adacomp.exchange.reduction import _REDUCTIONS
from tf_adacomp.exchange.reduction import _Adasum
from tf_adacomp.exchange.reduction import _Sum
from tf_adacomp.exchange.reduction import check_reduction
from tf_adacomp.exchange.reduction import get_reduction
from tf_adacomp.exchange.warm_up import _decode
from tf_adacomp.exchange.warm_up import _dense_bits
from tf_adacomp.exchange.warm_up import _dense_totals
from tf_adacomp.exchange.warm_up import _maybe_dense
from tf_adacomp.exchange.warm_up import _narrow_on_the_wire
from tf_adacomp.exchange.wire import Exchanged
from tf_adacomp.exchange.wire import Incoming
from tf_adacomp.exchange.wire import Outgoing
from tf_adacomp.exchange.wire import _padded_stride
from tf_adacomp.exchange.wire import checked_lengths
from tf_adacomp.exchange.wire import gathered_rows
