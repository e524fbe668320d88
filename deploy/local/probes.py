"""Readiness probes for a local cluster's parts, and one bounded wait loop for all of them.

Each probe answers "ready yet?" without raising; `wait_until` turns a probe into a bounded wait
that fails fast, with the child's log, when the child exits instead of becoming ready.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from deploy.local.processes import ManagedProcess
from kvstore.errors import DeadlineExceeded, KVKeepError

if TYPE_CHECKING:
    from kvstore.net.daemon_client import ClientTLS

__all__ = ["wait_until", "port_open", "http_ok", "http_json", "daemon_serving"]


def wait_until(ready: Callable[[], bool], *, timeout: float, what: str,
               process: ManagedProcess | None = None, step: float = 0.1) -> float:
    """Poll `ready()` until true; returns the seconds it took.

    Raises KVKeepError if `process` exits first (with the end of its log) and DeadlineExceeded
    after `timeout`.
    """
    start = time.monotonic()
    while True:
        if ready():
            return time.monotonic() - start
        if process is not None and process.proc is not None and not process.alive:
            raise KVKeepError(f"{what}: {process.name} exited with {process.returncode}; "
                              f"log {process.log_path}:\n{process.log_tail()}")
        if time.monotonic() - start > timeout:
            tail = f"\nlog {process.log_path}:\n{process.log_tail()}" if process else ""
            raise DeadlineExceeded(f"{what}: not ready after {timeout:.0f}s{tail}")
        time.sleep(step)


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), 0.2):
        return True
    return False


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except (OSError, http.client.HTTPException, ValueError):
        return False


def http_json(url: str, timeout: float = 2.0) -> Any:
    """GET `url` and decode JSON; None when unreachable or not JSON."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (OSError, http.client.HTTPException, ValueError):
        return None


def daemon_serving(node_id: str, address: str, tls: ClientTLS | None = None) -> bool:
    """Whether the kvstore daemon's standard gRPC health service says SERVING (over mTLS
    with `tls`)."""
    from kvstore.net.daemon_client import DaemonClient

    client = DaemonClient(node_id, address, data_plane=False, tls=tls)
    try:
        return client.health(timeout=0.5) == "SERVING"
    except KVKeepError:
        return False
    finally:
        client.close()
