"""A bandwidth-limited star network of Linux network namespaces, for the benchmarks.

``LimitedNetwork(hosts=2, rate="100mbit")`` builds, on enter:

    host namespace i (address 10.231.0.<i+1>/24, device eth0) --veth-- hub namespace
                                                                       (bridge br0)

one namespace per host plus a hub namespace whose bridge joins them (a switch), with a
token-bucket filter (``tc qdisc ... tbf``) of ``rate`` on both directions of every
host's link: each host sends and receives at most ``rate``, like a machine on a
switched network with a ``rate`` port. Hosts have no other interface and no route out,
so their traffic can only reach each other. ``command(i, argv)`` wraps a command to
run in host i; ``throughput(src, dst)`` measures a link. On exit (normal, exception,
SIGINT or SIGTERM) every namespace and interface created is deleted again.

``link_counters("eth0", namespace)`` (or ``counters(i)``, host i's end) reads an
interface's byte and packet counters (``ip -n NAMESPACE -s -j link show DEVICE``): the
bytes that really crossed a link, headers and every protocol's traffic included.

Needs root (CAP_NET_ADMIN) and ``ip``/``tc`` from iproute2.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

SUBNET = "10.231.0"  # private, /24; host i is SUBNET.(i + 1)


def _ip(*args, check=True):
  return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available():
  """Whether namespaces can be made here: root, iproute2, and a trial namespace."""
  if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
    return False
  name = f"tfac{os.getpid()}probe"
  if _ip("netns", "add", name, check=False).returncode:
    return False
  _ip("netns", "del", name, check=False)
  return True


COUNTERS = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")


def parse_link_counters(text: str, device: str) -> dict:
  """``{"tx_bytes", "rx_bytes", "tx_packets", "rx_packets"}`` of ``device``, from the
  JSON that ``ip -s -j link show DEVICE`` prints (its ``stats64``, else ``stats``).

  Raises:
    ValueError: no such device in ``text``, or no counters for it.
  """
  for link in json.loads(text or "[]"):
    if link.get("ifname") != device:
      continue
    stats = link.get("stats64") or link.get("stats")
    if not stats:
      break
    return {f"{way}_{unit}": int(stats[way][unit])
            for way in ("tx", "rx") for unit in ("bytes", "packets")}
  raise ValueError(f"no counters of device {device!r} in `ip -s -j link show`'s output. "
                   f"Received: {text[:300]!r}")


def link_counters(device: str = "eth0", namespace=None) -> dict:
  """The byte and packet counters of ``device`` in ``namespace`` (None: this process's
  own): ``ip [-n NAMESPACE] -s -j link show DEVICE``, parsed (``parse_link_counters``).

  Raises:
    RuntimeError: ``ip`` failed (no such namespace or device), naming both.
  """
  args = (["-n", namespace] if namespace else []) + ["-s", "-j", "link", "show", device]
  result = _ip(*args, check=False)
  if result.returncode:
    raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}. "
                       f"Received: device={device!r}, namespace={namespace!r}")
  return parse_link_counters(result.stdout, device)


def counter_deltas(before: dict, after: dict) -> dict:
  """``after - before`` for each of ``COUNTERS``."""
  return {name: after[name] - before[name] for name in COUNTERS}


def rate_bits(rate: str) -> int:
  """Bits per second of a tc rate ("100mbit", "1gbit", "500kbit").

  Raises:
    ValueError: not a number followed by kbit, mbit or gbit.
  """
  units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
  text = str(rate).strip().lower()
  for unit, scale in units.items():
    number = text[:-len(unit)]
    if text.endswith(unit) and number.replace(".", "", 1).isdigit() and float(number) > 0:
      return int(float(number) * scale)
  raise ValueError(f"`rate` must be a positive number followed by kbit, mbit or gbit "
                   f"(e.g. 100mbit). Received: rate={rate!r}")


class LimitedNetwork:
  """Namespaces joined by a switch whose ports are limited to ``rate`` (see module doc).

  Args:
    hosts: number of host namespaces, 2 to 200.
    rate: each host's link rate, both directions, as tc writes it ("100mbit").
    prefix: name prefix of everything created (made unique with the process id).

  Raises:
    ValueError: ``hosts`` or ``rate`` out of range.
    RuntimeError: (on enter) a namespace or link could not be made; everything made
      before is removed.
  """

  def __init__(self, hosts: int = 2, rate: str = "100mbit", prefix: str = "tfac"):
    if isinstance(hosts, bool) or not isinstance(hosts, int) or not 2 <= hosts <= 200:
      raise ValueError(
          f"`hosts` must be an integer from 2 to 200. Received: hosts={hosts!r}")
    self.hosts, self.rate = hosts, rate
    self.rate_bits = rate_bits(rate)
    self.tag = f"{prefix}{os.getpid()}"
    self.hub = f"{self.tag}hub"
    self.namespaces = [f"{self.tag}h{i}" for i in range(hosts)]
    self._made = []  # ("netns" | "link", name), in creation order
    self._old_handlers = {}

  def address(self, i: int) -> str:
    """IPv4 address of host i."""
    return f"{SUBNET}.{i + 1}"

  def __enter__(self):
    for sig in (signal.SIGINT, signal.SIGTERM):  # clean up on kill, too
      self._old_handlers[sig] = signal.signal(sig, self._on_signal)
    try:
      self._build()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc):
    self.close()
    return False

  def _on_signal(self, signum, frame):
    raise SystemExit(f"interrupted by signal {signum}")  # unwinds through __exit__

  def _run(self, *args):
    result = _ip(*args, check=False)
    if result.returncode:
      raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")

  def _tc(self, namespace, device):
    # burst: at least one 64 KB GSO segment and 10 ms at the rate (tbf drops packets
    # larger than its bucket); latency bounds the queue as a real port's buffer would.
    burst = max(self.rate_bits // 8 // 100, 1 << 17)
    result = subprocess.run(
        ["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate",
         self.rate, "burst", str(burst), "latency", "100ms"],
        capture_output=True, text=True, check=False)
    if result.returncode:
      raise RuntimeError(f"tc tbf on {namespace}/{device} failed: {result.stderr.strip()}")

  def _build(self):
    for namespace in [self.hub] + self.namespaces:
      self._run("netns", "add", namespace)
      self._made.append(("netns", namespace))
      self._run("-n", namespace, "link", "set", "lo", "up")
    self._run("-n", self.hub, "link", "add", "br0", "type", "bridge")
    self._run("-n", self.hub, "link", "set", "br0", "up")
    for i, namespace in enumerate(self.namespaces):
      host_end, hub_end = f"{self.tag}a{i}", f"{self.tag}b{i}"
      self._run("link", "add", host_end, "type", "veth", "peer", "name", hub_end)
      self._made.append(("link", host_end))  # until moved; deleting it deletes the peer
      self._run("link", "set", host_end, "netns", namespace, "name", "eth0")
      self._run("link", "set", hub_end, "netns", self.hub, "name", f"port{i}")
      self._run("-n", namespace, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
      self._run("-n", namespace, "link", "set", "eth0", "up")
      self._run("-n", self.hub, "link", "set", f"port{i}", "master", "br0", "up")
      self._tc(namespace, "eth0")  # host -> switch
      self._tc(self.hub, f"port{i}")  # switch -> host

  def close(self):
    """Deletes every namespace and interface made (their processes must have ended)."""
    for kind, name in reversed(self._made):
      if kind == "netns":
        _ip("netns", "del", name, check=False)  # takes its interfaces with it
      else:
        _ip("link", "del", name, check=False)  # only if it never left this namespace
    self._made = []
    for sig, handler in self._old_handlers.items():
      signal.signal(sig, handler)
    self._old_handlers = {}

  def command(self, i: int, argv):
    """``argv`` prefixed to run inside host i's namespace."""
    return ["ip", "netns", "exec", self.namespaces[i], *argv]

  def counters(self, i: int) -> dict:
    """Host i's link counters (``link_counters``): tx is what host i sent over its link,
    rx what it received."""
    return link_counters("eth0", self.namespaces[i])

  def leftovers(self):
    """Names of this network's namespaces that still exist (for checks)."""
    listed = _ip("netns", "list", check=False).stdout.split()
    return [n for n in [self.hub] + self.namespaces if n in listed]

  def throughput(self, src: int = 0, dst: int = 1, nbytes: int = 8 << 20) -> float:
    """Bits per second of one TCP stream from host ``src`` to host ``dst``, measured."""
    port = 5201
    receiver = subprocess.Popen(self.command(dst, [sys.executable, "-c", _RECEIVER,
                                                   self.address(dst), str(port)]),
                                stdout=subprocess.PIPE, text=True)
    try:
      sender = subprocess.run(self.command(src, [sys.executable, "-c", _SENDER,
                                                 self.address(dst), str(port), str(nbytes)]),
                              capture_output=True, text=True, timeout=120, check=False)
      received = receiver.communicate(timeout=120)[0]
    finally:
      if receiver.poll() is None:
        receiver.kill()
    if sender.returncode or not received.strip():
      raise RuntimeError(f"throughput probe failed: {sender.stderr.strip()[-500:]}")
    return float(received.split()[-1])


# The probe's two ends: the receiver prints bits per second from first to last byte.
_RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
c, _ = s.accept(); n = 0; start = None
while True:
  d = c.recv(1 << 20)
  if not d: break
  start = start or time.perf_counter(); n += len(d)
print(8 * n / (time.perf_counter() - start))
"""
_SENDER = """
import socket, sys, time
for _ in range(100):  # until the receiver listens
  try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
  except OSError:
    time.sleep(0.05)
s.sendall(bytes(int(sys.argv[3]))); s.close()
"""
