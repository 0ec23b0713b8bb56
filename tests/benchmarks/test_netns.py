"""benchmarks/netns.py: the namespaces are made, limited, isolated and always removed."""

import os
import signal
import subprocess
import sys
import time

import pytest

import benchmark_scripts  # noqa: F401  (benchmarks/ on sys.path)
import netns

_namespaces_available = pytest.mark.skipif(not netns.available(),
                                           reason="needs root and iproute2 (ip netns, tc)")


def needs_namespaces(test):
  """Real namespaces (ip and tc, processes of their own; root): the slow tier."""
  return pytest.mark.slow(_namespaces_available(test))


def _namespaces():
  return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _links():
  return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("rate,bits", [("100mbit", 10**8), ("1gbit", 10**9),
                                       ("2.5Mbit", 2_500_000), ("500kbit", 500_000)])
def test_rate_bits(rate, bits):
  assert netns.rate_bits(rate) == bits


@pytest.mark.parametrize("rate", ["100", "fast", "0mbit", "-1mbit", "mbit", "1tbit"])
def test_bad_rate_is_named(rate):
  with pytest.raises(ValueError, match=f"rate={rate!r}"):
    netns.LimitedNetwork(2, rate)


@pytest.mark.parametrize("hosts", [1, 201, 2.0, True])
def test_bad_host_count_is_named(hosts):
  with pytest.raises(ValueError, match=f"hosts={hosts!r}"):
    netns.LimitedNetwork(hosts)


@needs_namespaces
def test_links_are_limited_isolated_and_removed():
  with netns.LimitedNetwork(3, "20mbit") as net:
    assert len(net.leftovers()) == 4  # the hub and three hosts
    measured = net.throughput(2, 0, nbytes=2 << 20)
    assert 0.5 * 20e6 < measured < 1.3 * 20e6
    # The hosts' only route is their subnet: nothing else is reachable from them.
    routes = subprocess.run(net.command(0, ["ip", "route"]), capture_output=True,
                            text=True, check=True).stdout.strip().splitlines()
    assert routes == [f"{netns.SUBNET}.0/24 dev eth0 proto kernel scope link "
                      f"src {net.address(0)}"]
  assert net.leftovers() == [] and net.tag not in _links()


@needs_namespaces
def test_removed_after_an_error_inside():
  with pytest.raises(KeyError):
    with netns.LimitedNetwork(2, "100mbit") as net:
      raise KeyError("boom")
  assert net.leftovers() == []


@needs_namespaces
def test_removed_when_building_fails_halfway(monkeypatch):
  calls = []

  def failing_tc(self, namespace, device):
    calls.append(device)
    if len(calls) == 3:  # the second host's link
      raise RuntimeError("tc failed")

  monkeypatch.setattr(netns.LimitedNetwork, "_tc", failing_tc)
  net = netns.LimitedNetwork(2, "100mbit")
  with pytest.raises(RuntimeError, match="tc failed"):
    with net:
      pass
  assert net.leftovers() == [] and net.tag not in _links()


@needs_namespaces
def test_removed_on_sigterm(tmp_path):
  ready = tmp_path / "ready"
  script = (f"import sys, time; sys.path.insert(0, {benchmark_scripts.BENCHMARKS_DIR!r})\n"
            "import netns\n"
            "with netns.LimitedNetwork(2, '100mbit') as net:\n"
            f"  open({str(ready)!r}, 'w').write(net.tag)\n"
            "  time.sleep(60)\n")
  process = subprocess.Popen([sys.executable, "-c", script])
  try:
    for _ in range(200):
      if ready.exists() and ready.read_text():
        break
      time.sleep(0.05)
    tag = ready.read_text()
    assert tag in _namespaces()
    os.kill(process.pid, signal.SIGTERM)
    assert process.wait(timeout=30) != 0
  finally:
    if process.poll() is None:
      process.kill()
  assert tag not in _namespaces() and tag not in _links()


@needs_namespaces
def test_a_test_sees_only_the_namespaces_of_its_own_script():
  # Another test's network.py, beside it under pytest-xdist, holds tfac<its pid>...
  # names: a check for leftovers must not read them as its own (nor a longer pid that
  # starts with the same digits).
  pid = 999999991
  mine, other = f"tfac{pid}h0", f"tfac{pid}2h0"
  try:
    for name in (mine, other):
      subprocess.run(["ip", "netns", "add", name], check=True)
    assert benchmark_scripts.namespaces_of(pid) == [mine]
  finally:
    for name in (mine, other):
      subprocess.run(["ip", "netns", "del", name], check=False)
  assert benchmark_scripts.namespaces_of(pid) == []
