"""The processes benchmarks start on loopback: a free port, a kvstore daemon, a clean stop.

The daemon runs as `kvkeep store serve` runs it in production (its malloc settings applied), so
a benchmark measures the daemon users get.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.context
import os
import threading
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

from deploy.chaos.slow_link import SlowLink
from deploy.local.daemons import DaemonProcess
from deploy.local.ports import free_port
from deploy.local.services import stop_process

__all__ = ["free_port", "stop_process", "bench_daemon", "process_cpu_s", "slow_link_process"]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used, all its threads (Linux /proc); 0.0 once
    it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def bench_daemon(data_dir: Path, *, mem_budget: int | str, disk_budget: int | str,
                 node_id: str = "bench", timeout: float = 30.0,
                 extra: Sequence[str] = (), port: int | None = None
                 ) -> Iterator[tuple[str, int]]:
    """One `python -m kvstore.daemon` on loopback (on `port`, or a free one), started as the
    tests start theirs (`deploy.local.daemons.DaemonProcess`: its malloc settings, its own
    process group, a log beside `data_dir`), waited on until its health service says SERVING;
    yields its address and pid, and drains it at the end."""
    port = free_port() if port is None else port
    daemon = DaemonProcess(
        node_id, port, data_dir, data_dir.with_name(f"{data_dir.name}.log"),
        ["--listen", f"127.0.0.1:{port}", "--data-dir", str(data_dir),
         "--mem-budget", str(mem_budget), "--disk-budget", str(disk_budget),
         "--node-id", node_id, *extra])
    daemon.spawn()
    try:
        daemon.wait_healthy(timeout)
        assert daemon.proc is not None
        yield daemon.address, daemon.proc.pid
    finally:
        daemon.terminate(timeout)


def _serve_link(upstream: str, delay_s: float, conn: Connection) -> None:
    link = SlowLink(upstream, delay_s)
    conn.send(link.address)
    threading.Event().wait()  # until terminated


def slow_link_process(upstream: str, delay_s: float
                      ) -> tuple[multiprocessing.context.ForkProcess, str]:
    """A `SlowLink` to `upstream` (each call delivered `delay_s` late) in a process of its own,
    so its pump threads never take the measuring process's GIL; returns it and its address.
    Fork it before this process opens any gRPC channel (gRPC does not survive a fork)."""
    parent, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=_serve_link, args=(upstream, delay_s, child),
                                           daemon=True)
    proc.start()
    if not parent.poll(30):
        proc.terminate()
        raise RuntimeError("the slow link did not start")
    return proc, str(parent.recv())
