"""The cluster of a multi-worker job: ``TF_CONFIG`` checked, and compared between workers.

- ``tf_config(addresses, index)``: the ``TF_CONFIG`` of one worker of a cluster;
- ``check_tf_config(raw)``: a ``TF_CONFIG`` parsed and checked before TensorFlow reads it
  (TensorFlow's own errors name no value, and some mistakes make it wait for a worker
  that never comes), and ``worker_count`` of its cluster;
- ``check_same_cluster(strategy, config)``: one all-gather in which the workers compare
  their clusters, so that workers whose ``TF_CONFIG`` lists another cluster fail at once,
  with both clusters in the error.

``tf_adacomp.distribute.multi_worker_strategy`` runs these checks; ``tf_config`` is also
``tf_adacomp.distribute.tf_config``.
"""

import hashlib
import json
from typing import Sequence

import tensorflow as tf

from tf_adacomp.ops import checks


# The task types TensorFlow allows in a cluster (multi_worker_util._validate_cluster_spec),
# and those a MultiWorkerMirroredStrategy can run as (TensorFlow's worker_count refuses
# "ps").
_CLUSTER_TASK_TYPES = ("chief", "worker", "evaluator", "ps")
_STRATEGY_TASK_TYPES = ("chief", "worker", "evaluator")
# Bytes of the cluster's canonical JSON sent in the cluster check (its SHA-256 decides;
# the text only makes the error readable).
_CLUSTER_TEXT_BYTES = 2048


def check_tf_config(raw: str) -> dict:
  """Parses and checks a ``TF_CONFIG`` for ``MultiWorkerMirroredStrategy``.

  A valid one is a JSON object with

  - "cluster": an object of task type ("chief", "worker", "evaluator", "ps") -> a
    non-empty list of distinct "host:port" addresses (port in 1..65535), at most one
    chief and one evaluator, and at least one chief or worker;
  - "task": an object with "type", a task type of the cluster that the strategy runs
    ("chief", "worker" or "evaluator"), and "index", an int within that type's list.

  Other keys ("rpc_layer", "environment") are left to TensorFlow.

  Args:
    raw: the value of the ``TF_CONFIG`` environment variable.

  Returns:
    The parsed ``TF_CONFIG``.

  Raises:
    ValueError: anything above, naming ``TF_CONFIG`` and the part received.
  """
  try:
    config = json.loads(raw)
  except ValueError as error:
    raise ValueError(f"The TF_CONFIG environment variable is not valid JSON. "
                     f"Received: TF_CONFIG={raw!r}") from error
  if not isinstance(config, dict):
    raise ValueError(f"The TF_CONFIG environment variable must hold a JSON object. "
                     f"Received: TF_CONFIG={raw!r}")
  if "cluster" not in config:
    raise ValueError(f'TF_CONFIG has no "cluster" (an object of task type -> list of '
                     f'"host:port" addresses). Received: TF_CONFIG={raw!r}')
  cluster = config["cluster"]
  if not isinstance(cluster, dict) or not cluster:
    raise ValueError(f'TF_CONFIG["cluster"] must be a non-empty object of task type -> '
                     f'list of "host:port" addresses. Received: TF_CONFIG["cluster"]={cluster!r}')
  seen = {}
  for task_type, addresses in cluster.items():
    part = f'TF_CONFIG["cluster"][{task_type!r}]'
    if task_type not in _CLUSTER_TASK_TYPES:
      raise ValueError(f'The task types of TF_CONFIG["cluster"] are '
                       f'{", ".join(map(repr, _CLUSTER_TASK_TYPES))}. '
                       f'Received: {part}={addresses!r}')
    if not isinstance(addresses, list) or not addresses:
      raise ValueError(f'{part} must be a non-empty list of "host:port" addresses. '
                       f'Received: {part}={addresses!r}')
    if task_type in ("chief", "evaluator") and len(addresses) > 1:
      raise ValueError(f'A cluster has at most one {task_type!r} task. '
                       f'Received: {part}={addresses!r}')
    for index, address in enumerate(addresses):
      if not _is_address(address):
        raise ValueError(f'Each address in TF_CONFIG["cluster"] must be "host:port" with a '
                         f'port in 1..65535. Received: {part}[{index}]={address!r}')
      if address in seen:
        raise ValueError(f'TF_CONFIG["cluster"] must not repeat an address: {address!r} is '
                         f'both {seen[address]} and {part}[{index}]. '
                         f'Received: TF_CONFIG["cluster"]={cluster!r}')
      seen[address] = f"{part}[{index}]"
  if not any(task_type in cluster for task_type in ("chief", "worker")):
    raise ValueError(f'TF_CONFIG["cluster"] has no "chief" or "worker" task. '
                     f'Received: TF_CONFIG["cluster"]={cluster!r}')
  if "task" not in config:
    raise ValueError(f'TF_CONFIG has no "task" (an object with this worker\'s "type" and '
                     f'"index"). Received: TF_CONFIG={raw!r}')
  task = config["task"]
  if not isinstance(task, dict):
    raise ValueError(f'TF_CONFIG["task"] must be an object with "type" and "index". '
                     f'Received: TF_CONFIG["task"]={task!r}')
  task_type = task.get("type")
  if task_type not in cluster or task_type not in _STRATEGY_TASK_TYPES:
    types = [t for t in cluster if t in _STRATEGY_TASK_TYPES]
    raise ValueError(f'TF_CONFIG["task"]["type"] must be one of the task types of '
                     f'TF_CONFIG["cluster"] that MultiWorkerMirroredStrategy runs as: '
                     f'{", ".join(map(repr, types))}. Received: TF_CONFIG["task"]={task!r}')
  index = task.get("index")
  size = len(cluster[task_type])
  if not checks.is_int(index) or not 0 <= index < size:
    raise ValueError(f'TF_CONFIG["task"]["index"] must be an int in 0..{size - 1} (the '
                     f'{task_type!r} list of TF_CONFIG["cluster"] has {size} address'
                     f'{"" if size == 1 else "es"}). Received: TF_CONFIG["task"]={task!r}')
  return config


def worker_count(config: dict) -> int:
  """The workers of a checked TF_CONFIG's cluster: its chief and worker tasks."""
  cluster = config["cluster"]
  return len(cluster.get("chief", [])) + len(cluster.get("worker", []))


def _is_address(address) -> bool:
  """Whether ``address`` is a "host:port" str with a port in 1..65535."""
  if not isinstance(address, str):
    return False
  host, _, port = address.rpartition(":")
  return bool(host) and port.isdigit() and 0 < int(port) < 65536


def _cluster_buffer(cluster: dict) -> tf.Tensor:
  """int32 ``[1, 8 + 1 + _CLUSTER_TEXT_BYTES]``: the SHA-256 of the cluster's canonical
  JSON, the text's length, then its first bytes (0-padded)."""
  text = json.dumps(cluster, sort_keys=True, separators=(",", ":")).encode()
  digest = hashlib.sha256(text).digest()
  words = [int.from_bytes(digest[i:i + 4], "little", signed=True) for i in range(0, 32, 4)]
  head = list(text[:_CLUSTER_TEXT_BYTES])
  row = words + [len(text)] + head + [0] * (_CLUSTER_TEXT_BYTES - len(head))
  return tf.constant([row], tf.int32)


def _cluster_of_buffer(row) -> str:
  """The (possibly cut) cluster text of one row of ``_cluster_buffer``."""
  length = int(row[8])
  text = bytes(int(b) for b in row[9:9 + min(length, _CLUSTER_TEXT_BYTES)]).decode(
      errors="replace")
  return text if length <= _CLUSTER_TEXT_BYTES else text + "..."


def _first_reason(error: Exception) -> str:
  """The line of a TensorFlow error that says what went wrong (not "Graph execution
  error:", nor the Python frames of the op's definition)."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  for line in lines:
    if "aborted by" in line:
      return line[:500]
  noise = ("Graph execution error", "Detected at node", "File ")
  return next((line[:500] for line in lines if not line.startswith(noise)), repr(error))


def check_same_cluster(strategy, config: dict) -> None:
  """Checks, with one all-gather, that every worker's TF_CONFIG lists this cluster.

  TensorFlow compares no cluster: a worker whose TF_CONFIG lists fewer workers than
  the others is only caught at the first collective ("joining a group with size 3,
  but that group has size 2"), one that lists another address gets "Connection
  refused", both naming no TF_CONFIG. (When the collective leader, the chief or worker
  0, lists more workers than exist, ``MultiWorkerMirroredStrategy()`` itself waits for
  them, and this check is never reached: TensorFlow's start-up barrier has no timeout
  that can be set.)

  Args:
    strategy: the new ``MultiWorkerMirroredStrategy``.
    config: this worker's parsed ``TF_CONFIG``.

  Raises:
    ValueError: a worker's cluster differs from this one, or the gather failed.
  """
  cluster = config["cluster"]
  mine = _cluster_buffer(cluster)
  ours = json.dumps(cluster, sort_keys=True)
  try:
    values = strategy.experimental_distribute_values_from_function(lambda _: mine)
    rows = strategy.gather(values, axis=0).numpy()
  except (tf.errors.OpError, RuntimeError) as error:
    raise ValueError(
        f"The workers could not compare their clusters, most likely because their "
        f"TF_CONFIGs list different clusters (another number of workers or other "
        f"addresses). TensorFlow said: {_first_reason(error)} "
        f"Received: TF_CONFIG[\"cluster\"]={ours} "
        f"(task {config['task']!r})") from error
  for row in rows:
    if not (row[:8] == mine.numpy()[0, :8]).all():
      raise ValueError(
          f"The workers' TF_CONFIGs list different clusters: this worker's is {ours}, "
          f"another worker's is {_cluster_of_buffer(row)}. Give every worker the same "
          f"\"cluster\". Received: TF_CONFIG[\"cluster\"]={ours} "
          f"(task {config['task']!r})")


def tf_config(worker_addresses: Sequence[str], index: int) -> str:
  """The ``TF_CONFIG`` JSON of worker ``index`` in a cluster of workers only.

  Args:
    worker_addresses: "host:port" of every worker, in task order (worker 0 is the
      chief).
    index: this worker's position in ``worker_addresses``.

  Returns:
    ``'{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": index}}'``.

  Raises:
    TypeError: ``worker_addresses`` not a list or tuple of str; ``index`` not an int.
    ValueError: no address, an address not "host:port" with a numeric port, a repeated
      address, or ``index`` out of range.
  """
  if isinstance(worker_addresses, str) or not isinstance(worker_addresses, (list, tuple)):
    raise TypeError(f"`worker_addresses` must be a list or tuple of 'host:port' strings. "
                    f"Received: worker_addresses={worker_addresses!r}")
  if not worker_addresses:
    raise ValueError(f"`worker_addresses` must not be empty. "
                     f"Received: worker_addresses={worker_addresses!r}")
  for address in worker_addresses:
    if not isinstance(address, str):
      raise TypeError(f"`worker_addresses` must hold 'host:port' strings. "
                      f"Received: worker_addresses={worker_addresses!r}")
    if not _is_address(address):
      raise ValueError(f"Each worker address must be 'host:port' with a port in 1..65535. "
                       f"Received: worker_addresses={worker_addresses!r}")
  if len(set(worker_addresses)) != len(worker_addresses):
    raise ValueError(f"`worker_addresses` must not repeat an address. "
                     f"Received: worker_addresses={worker_addresses!r}")
  index = checks.typed_int(index, "index", 0)
  if index >= len(worker_addresses):
    raise ValueError(f"`index` must be < len(worker_addresses) = {len(worker_addresses)}. "
                     f"Received: index={index}")
  return json.dumps({"cluster": {"worker": list(worker_addresses)},
                     "task": {"type": "worker", "index": index}})
