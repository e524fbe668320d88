"""Network namespaces for a local cluster, so that a node can be cut off from etcd or from the
kvstore daemons while everything else keeps talking to it (root only).

    fabric = Fabric.create()                       # a bridge in the host namespace
    node = fabric.add_node("w2")                   # a namespace, a veth pair, an address
    argv = fabric.wrap("w2", ["python", ...])      # run a process inside it
    fabric.cut("w2", "etcd"); fabric.heal("w2", "etcd")
    fabric.destroy()

Addresses are private (10.213-10.254.x.0/24, picked free when the fabric is made) and exist only
on this machine: a bridge `kvk<tag>b` in the host namespace holds `.1` (the source of what the
host's processes send into a namespace: routers to workers), `.2` (where etcd listens) and `.3`
(where the daemons listen); node namespace `i` gets `.(10+i)` on a veth whose other end is on the
bridge, plus its own loopback.

A cut is silent, as a real partition is: inside the node's namespace the service's address is
routed to a neighbour that does not exist (a static ARP entry to an unused MAC), so its packets
leave and are lost; connections stall and time out rather than fail at once (a blackhole route
would answer EINVAL at once, which no network does). Only the node's own packets are lost, which
is enough for TCP: nothing reaches it either way. This kernel has no netem, prio or iptables, so
routes are the tool; tc netem would do the same where it exists.

Names carry the creating process's pid (`kvk<pid hex>`), so `sweep_stale()` can remove what a
killed run left behind without touching another live run's namespaces.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from kvstore.errors import ConfigError, KVKeepError

__all__ = ["Fabric", "NodeNet", "netns_available", "sweep_stale", "SERVICES"]

SERVICES = ("etcd", "daemons")
_SINK_MAC = "02:6b:76:6b:00:01"  # locally administered, owned by nobody
_NAME = re.compile(r"^kvk([0-9a-f]+)n\d+$")


def netns_available() -> str | None:
    """None when namespaces can be made here; else why not (for a clear skip message)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); this process is not root"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    return None


@dataclass(frozen=True, slots=True)
class NodeNet:
    name: str
    netns: str
    address: str
    host_veth: str


@dataclass
class Fabric:
    tag: str
    subnet: ipaddress.IPv4Network
    nodes: dict[str, NodeNet] = field(default_factory=dict)
    _cuts: set[tuple[str, str]] = field(default_factory=set)

    @classmethod
    def create(cls) -> Fabric:
        why = netns_available()
        if why is not None:
            raise ConfigError(why)
        sweep_stale()
        fabric = cls(tag=f"{os.getpid():x}", subnet=_free_subnet())
        try:
            _ip("link", "add", fabric.bridge, "type", "bridge")
            for host in (1, 2, 3):  # .1 first: the primary address, the host's source address
                _ip("addr", "add", f"{fabric._host(host)}/24", "dev", fabric.bridge)
            _ip("link", "set", fabric.bridge, "up")
        except BaseException:
            fabric.destroy()
            raise
        return fabric

    @property
    def bridge(self) -> str:
        return f"kvk{self.tag}b"

    @property
    def host_address(self) -> str:
        return self._host(1)

    @property
    def etcd_address(self) -> str:
        return self._host(2)

    @property
    def daemons_address(self) -> str:
        return self._host(3)

    def add_node(self, name: str) -> NodeNet:
        """A namespace for node `name`, reachable from the host at its own address."""
        if name in self.nodes:
            return self.nodes[name]
        index = len(self.nodes)
        node = NodeNet(name, f"kvk{self.tag}n{index}", self._host(10 + index),
                       f"kvk{self.tag}v{index}")
        inner = f"kvk{self.tag}i{index}"
        _ip("netns", "add", node.netns)
        self.nodes[name] = node
        _ip("link", "add", node.host_veth, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", node.netns)
        _ip("link", "set", node.host_veth, "master", self.bridge)
        _ip("link", "set", node.host_veth, "up")
        inside = ["netns", "exec", node.netns, "ip"]
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "link", "set", inner, "name", "eth0")
        _ip(*inside, "addr", "add", f"{node.address}/24", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        _ip(*inside, "neigh", "replace", self._sink, "lladdr", _SINK_MAC, "dev", "eth0",
            "nud", "permanent")
        return node

    def wrap(self, name: str, argv: list[str]) -> list[str]:
        """`argv` run inside node `name`'s namespace (`ip netns exec` execs it: same pid)."""
        ip = shutil.which("ip") or "ip"
        return [ip, "netns", "exec", self.nodes[name].netns, *argv]

    def service_address(self, service: str) -> str:
        if service == "etcd":
            return self.etcd_address
        if service == "daemons":
            return self.daemons_address
        raise ConfigError(f"unknown service {service!r}: one of {', '.join(SERVICES)}")

    def cut(self, name: str, service: str) -> None:
        """Lose every packet node `name` sends to `service` (silently) until `heal`."""
        address = self.service_address(service)
        _ip("netns", "exec", self.nodes[name].netns, "ip", "route", "replace",
            f"{address}/32", "via", self._sink, "dev", "eth0")
        self._cuts.add((name, service))

    def heal(self, name: str, service: str) -> None:
        address = self.service_address(service)
        _ip("netns", "exec", self.nodes[name].netns, "ip", "route", "del", f"{address}/32")
        self._cuts.discard((name, service))

    def reaches(self, name: str, address: str, port: int, timeout_s: float = 1.0) -> bool:
        """Whether a TCP connection from inside node `name` to address:port opens."""
        code = ("import socket,sys\n"
                "try:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), "
                "float(sys.argv[3])).close()\nexcept OSError:\n sys.exit(1)\n")
        import sys

        done = subprocess.run(self.wrap(name, [sys.executable, "-c", code, address, str(port),
                                               str(timeout_s)]),
                              capture_output=True, timeout=timeout_s + 10, check=False)
        return done.returncode == 0

    def destroy(self) -> None:
        """Remove every namespace (their veths go with them) and the bridge. Idempotent."""
        for node in self.nodes.values():
            with contextlib.suppress(KVKeepError):
                _ip("netns", "del", node.netns)
        self.nodes.clear()
        with contextlib.suppress(KVKeepError):
            _ip("link", "del", self.bridge)

    @property
    def _sink(self) -> str:
        return self._host(254)

    def _host(self, n: int) -> str:
        return str(self.subnet.network_address + n)


def sweep_stale() -> None:
    """Remove namespaces and bridges that runs now dead left behind (their pid is gone)."""
    stale: set[str] = set()
    with contextlib.suppress(KVKeepError):
        for line in _ip("netns", "list").splitlines():
            name = line.split()[0] if line.strip() else ""
            match = _NAME.match(name)
            if match and not _pid_alive(int(match.group(1), 16)):
                stale.add(match.group(1))
                with contextlib.suppress(KVKeepError):
                    _ip("netns", "del", name)
    with contextlib.suppress(KVKeepError):
        for line in _ip("-o", "link", "show", "type", "bridge").splitlines():
            match = re.search(r"\d+: kvk([0-9a-f]+)b[:@]", line)
            if match and (match.group(1) in stale or not _pid_alive(int(match.group(1), 16))):
                with contextlib.suppress(KVKeepError):
                    _ip("link", "del", f"kvk{match.group(1)}b")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_subnet() -> ipaddress.IPv4Network:
    used = [ipaddress.ip_interface(m).network
            for m in re.findall(r"inet (\d+\.\d+\.\d+\.\d+/\d+)", _ip("-4", "-o", "addr"))]
    start = os.getpid() % 40
    for i in range(42 * 256):
        n = (start * 256 + i) % (42 * 256)
        candidate = ipaddress.IPv4Network(f"10.{213 + n // 256}.{n % 256}.0/24")
        if not any(candidate.overlaps(u) for u in used):
            return candidate
    raise KVKeepError("no free 10.213-254.x.0/24 subnet for the cluster's namespaces")


def _ip(*args: str) -> str:
    ip = shutil.which("ip")
    if ip is None:
        raise ConfigError("the `ip` tool (iproute2) is not installed")
    done = subprocess.run([ip, *args], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise KVKeepError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout
