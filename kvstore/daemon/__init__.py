"""The kvstore daemon: one per node, serving KV blocks over gRPC and a TCP data plane
(`kvkeep store serve`): one transport-neutral core (core.py) and a thin front per transport."""

from __future__ import annotations

from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.server import Daemon, run_daemon

__all__ = ["Daemon", "DaemonConfig", "run_daemon"]
