"""Handles to the running parts of a local cluster (`cluster.py`): a kvstore daemon, a worker
node (vLLM and its agent), a router replica; their addresses and processes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deploy.local.processes import ManagedProcess

__all__ = ["Daemon", "Worker", "Router"]


@dataclass
class Daemon:
    node_id: str
    port: int
    process: ManagedProcess
    data_dir: Path = Path()
    host: str = "127.0.0.1"
    metrics_port: int = 0
    """Where its Prometheus `/metrics` is served (`--metrics-listen`)."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class Worker:
    """A vLLM server and the agent that registers it: what a node of the cluster is."""

    worker_id: str
    port: int
    events_port: int
    server: ManagedProcess
    agent: ManagedProcess
    host: str = "127.0.0.1"
    """127.0.0.1, or its namespace's address when isolated."""
    metrics_port: int = 0
    """The agent's relay of vLLM's /metrics (`kvkeep worker --metrics-listen`)."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.server.alive


@dataclass
class Router:
    replica_id: str
    port: int
    process: ManagedProcess
    lists_workers: bool = True
    """False: its worker list is an operator's (`--api-keys`), so the cluster does not wait for
    it to see workers."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
