"""The processes benchmarks start on loopback: a free port, a kvstore daemon, a clean stop.

The daemon runs as `kvkeep store serve` runs it in production (its malloc settings applied), so
a benchmark measures the daemon users get.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from deploy.local.ports import free_port
from kvstore.commands.store import MALLOC_ENV
from kvstore.net.daemon_client import DaemonClient

__all__ = ["free_port", "stop_process", "bench_daemon"]


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM (the process drains), then SIGKILL if it has not exited within `timeout`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def bench_daemon(data_dir: Path, *, mem_budget: int | str, disk_budget: int | str,
                 node_id: str = "bench", timeout: float = 30.0,
                 extra: Sequence[str] = ()) -> Iterator[tuple[str, int]]:
    """One `python -m kvstore.daemon` on loopback, waited on until its health service says
    SERVING; yields its address and pid, and stops it at the end."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.daemon", "--listen", f"127.0.0.1:{port}",
         "--data-dir", str(data_dir), "--mem-budget", str(mem_budget),
         "--disk-budget", str(disk_budget), "--node-id", node_id, *extra],
        env={**os.environ, **MALLOC_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        probe = DaemonClient(node_id, f"127.0.0.1:{port}")
        end = time.monotonic() + timeout
        try:
            while time.monotonic() < end:
                if proc.poll() is not None:
                    raise RuntimeError(f"the daemon exited with {proc.returncode}")
                with contextlib.suppress(Exception):
                    if probe.health(timeout=1) == "SERVING":
                        break
                time.sleep(0.05)
            else:
                raise TimeoutError(f"the daemon was not serving after {timeout:.0f} s")
        finally:
            probe.close()
        yield f"127.0.0.1:{port}", proc.pid
    finally:
        stop_process(proc, timeout)
