"""Loopback ports for the servers that tests, benchmarks and local clusters start.

A port is taken from below the kernel's ephemeral range (`ip_local_port_range`), never from
it: the kernel hands ephemeral ports to every outgoing connection, so a server that is
stopped and started again on its port (chaos restarts routers, daemons, etcd) could find the
port taken by some client's connection in between, and fail to bind (a CI run lost a router
restart that way, most likely). Below the range, only another server binding that very
number can take it; each port is checked free when chosen and never handed out twice by one
process.

Processes that start servers side by side (pytest-xdist's workers: `tests/conftest.py` sets it)
each take a disjoint slice of that range with `KVKEEP_PORT_SLICE=i/n` (slice i of n, from 0), so
a port one of them chose and freed for a restart is never chosen by another meanwhile.
"""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

__all__ = ["free_port"]

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
SLICE_ENV = "KVKEEP_PORT_SLICE"
_LOWEST = 10_000  # below: the well-known and registered ports of the machine's own services
_lock = threading.Lock()
_handed_out: set[int] = set()
_rng = random.Random()  # seeded from the OS: two processes choosing at once rarely collide


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _slice(low: int, high: int) -> tuple[int, int]:
    """[low, high] narrowed to this process's slice ($KVKEEP_PORT_SLICE "i/n"), if any."""
    index, _, count = os.environ.get(SLICE_ENV, "").partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        return low, high
    width = (high - low + 1) // int(count)
    start = low + int(index) * width
    return start, start + width - 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing is bound to right now, outside the ephemeral range.

    Where the range leaves no room below it (a machine configured so), the kernel's choice
    (an ephemeral port) is the fallback.
    """
    low, high = _slice(_LOWEST, _ephemeral_low() - 1)
    with _lock:
        if high - low >= 1_000:
            for _ in range(200):
                port = _rng.randint(low, high)
                if port not in _handed_out and _bindable(port, host):
                    _handed_out.add(port)
                    return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        _handed_out.add(port)
        return port
