"""Test-only: simulated nodes with a network of their own, and real faults injected into it.

Each node gets a network namespace holding one end of a veth pair and its own address (10.99.X.N); the other
ends hang on a bridge the test creates. Its SMP runs inside the namespace (`ip netns exec`), so peer links use
the namespace addresses and cross the bridge, while the control socket (a unix socket on the shared filesystem)
and the shared-memory segments stay reachable from the test's own namespace.

Faults, per node, on both ends of its veth pair (so both directions of its traffic):
- partition: its veth leaves the bridge; packets go nowhere and nothing answers (no reset, no ICMP), as on a
  pulled cable.
- latency: `tc netem delay` where the kernel has sch_netem; otherwise tbf, a token bucket whose low rate and deep
  queue delay every packet behind the bulk traffic queued before it (queueing delay, not a fixed delay).
- loss: `tc netem loss` where available; otherwise tbf with a queue too short for the bulk traffic, which
  drops what does not fit.
Each fault says how to check that it happened (Fault.check): a fault requested but never applied to the traffic
fails the test instead of passing it.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass

_NETEM: bool | None = None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why namespaced networks cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "needs iproute2 (`ip` and `tc`)"
    name = f"nfprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` fails here: {e.stderr.strip()}"
    _ip("netns", "del", name)
    return None


def _tc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", *args], capture_output=True, text=True)


def netem_available(dev: str) -> bool:
    """Whether the kernel takes a netem qdisc (probed once on `dev`, then removed)."""
    global _NETEM
    if _NETEM is None:
        _NETEM = _tc("qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms").returncode == 0
        if _NETEM:
            _tc("qdisc", "del", "dev", dev, "root")
    return _NETEM


@dataclass
class Fault:
    """A fault put on one node's links: `kind` names what the kernel does (netem or its tbf stand-in)."""

    kind: str
    node: int
    rate_bps: int | None = None  # tbf: the bucket's rate, bits per second
    burst: int = 0  # tbf: bytes let through at line rate first
    delay_s: float = 0.0  # netem: added one-way delay

    def min_seconds(self, sent_bytes: int) -> float:
        """The least time the traffic counted by the qdiscs can have taken through this fault."""
        if self.rate_bps:
            return max(0.0, sent_bytes - self.burst) * 8 / self.rate_bps
        return self.delay_s


class Network:
    """A bridge and one namespace per node; `close()` removes them whatever happened."""

    def __init__(self, nodes: int):
        self.tag = secrets.token_hex(2)
        self.nodes = nodes
        self.subnet = f"10.99.{int(self.tag, 16) % 250}"
        self.bridge = f"nf{self.tag}br"
        self._made: list[tuple] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _ip("link", "set", self.bridge, "up")
            for node in range(nodes):
                ns, host = self.namespace(node), self.host_end(node)
                _ip("netns", "add", ns)
                self._made.append(("netns", ns))
                _ip("link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self._made.append(("link", host))
                _ip("link", "set", host, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def namespace(self, node: int) -> str:
        return f"nf{self.tag}n{node}"

    def host_end(self, node: int) -> str:
        return f"nf{self.tag}h{node}"

    def address(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def hosts(self) -> list[str]:
        return [self.address(n) for n in range(self.nodes)]

    def prefix(self, node: int) -> list[str]:
        """The command that runs a node's process inside its namespace (exec'ing it: the pid stays the same)."""
        return ["ip", "netns", "exec", self.namespace(node)]

    # ---- faults -------------------------------------------------------------------------------------------
    def partition(self, node: int) -> None:
        _ip("link", "set", self.host_end(node), "nomaster")

    def heal(self, node: int) -> None:
        _ip("link", "set", self.host_end(node), "master", self.bridge)

    def _tc_both(self, node: int, *args: str) -> list[subprocess.CompletedProcess]:
        """`tc OPTIONS... OBJECT COMMAND... dev D ...REST` on both ends of the node's veth pair (into the node, out
        of it); `args` holds "{dev}" where the device goes."""
        out = []
        for options, dev in (([], self.host_end(node)), (["-n", self.namespace(node)], "eth0")):
            out.append(_tc(*options, *(dev if a == "{dev}" else a for a in args)))
        return out

    def _shape(self, node: int, netem: list[str], tbf: list[str], fault: Fault, stand_in: Fault) -> Fault:
        """Put netem `netem` on node's links where the kernel has it, else tbf `tbf` (described by `stand_in`)."""
        spec = ["netem", *netem]
        if not netem_available(self.host_end(node)):
            fault, spec = stand_in, ["tbf", *tbf]
        for done in self._tc_both(node, "qdisc", "replace", "dev", "{dev}", "root", *spec):
            if done.returncode:
                raise RuntimeError(f"tc {' '.join(done.args[1:])}: {done.stderr.strip()}")
        return fault

    def latency(self, node: int, delay_s: float = 0.2, rate_bps: int = 16_000_000) -> Fault:
        """Delay node's traffic both ways: netem by `delay_s`, or tbf queueing behind `rate_bps`."""
        burst = 16 << 10
        return self._shape(node, ["delay", f"{int(delay_s * 1000)}ms"],
                           ["rate", str(rate_bps), "burst", str(burst), "latency", "2s"],
                           Fault("netem delay", node, delay_s=delay_s),
                           Fault("tbf queueing delay", node, rate_bps=rate_bps, burst=burst))

    def loss(self, node: int, percent: float = 3.0, rate_bps: int = 100_000_000) -> Fault:
        """Drop some of node's packets both ways: netem at `percent`, or tbf whose short queue overflows."""
        burst = 16 << 10
        # 30 kB of queue: a bulk flow loses about a sixth of its packets, which fast retransmit repairs (a queue
        # of a few packets drops nearly all of a GSO burst and stalls TCP in timeouts instead).
        return self._shape(node, ["loss", f"{percent}%"],
                           ["rate", str(rate_bps), "burst", str(burst), "limit", "30000"],
                           Fault("netem loss", node), Fault("tbf queue overflow loss", node, rate_bps=rate_bps,
                                                            burst=burst))

    def clear(self, node: int) -> None:
        self._tc_both(node, "qdisc", "del", "dev", "{dev}", "root")

    def stats(self, node: int) -> list[dict]:
        """Counters of node's root qdiscs, one dict per end (into the node, out of it): sent bytes, dropped and
        delayed (overlimits) packets."""
        out = []
        for done in self._tc_both(node, "-s", "qdisc", "show", "dev", "{dev}"):
            m = re.search(r"Sent (\d+) bytes \d+ pkt \(dropped (\d+), overlimits (\d+)", done.stdout)
            out.append(dict(zip(("sent", "dropped", "overlimits"), map(int, m.groups() if m else (0, 0, 0)))))
        return out

    def check(self, fault: Fault, seconds: float) -> list[dict]:
        """Fail unless `fault` acted on the traffic of an operation that took `seconds`: loss dropped packets,
        latency held them back at least as long as its own counters imply (the two ends run side by side)."""
        stats = self.stats(fault.node)
        total = {key: sum(end[key] for end in stats) for key in stats[0]}
        assert total["sent"] > 0, f"{fault.kind} on node {fault.node}: no traffic went through it ({stats})"
        if "loss" in fault.kind:
            assert total["dropped"] > 0, f"{fault.kind} on node {fault.node} dropped nothing ({stats})"
            return stats
        if fault.rate_bps:
            assert total["overlimits"] > 0, f"{fault.kind} on node {fault.node} delayed nothing ({stats})"
        need = max(fault.min_seconds(end["sent"]) for end in stats)
        assert seconds >= 0.9 * need, (f"{fault.kind} on node {fault.node}: took {seconds:.2f} s, but the bytes "
                                       f"through it need at least {need:.2f} s ({stats})")
        return stats

    def close(self) -> None:
        for kind, name in reversed(self._made):
            subprocess.run(["ip", kind, "del", name], capture_output=True)
        self._made = []
