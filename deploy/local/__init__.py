"""A real local kvkeep cluster as subprocesses on loopback (see `cluster.py`), and the tiny
model it serves (`model.py`). Used by `kvkeep demo` and `kvkeep chaos`; nothing is mocked.

Its parts, each started one way: a vLLM server's command line and environment are
`engines.py`'s (a cluster's worker, or one alone: `vllm_server.py`) and a kvstore daemon's are
`daemons.py`'s, both run as a `processes.ManagedProcess` (its own process group, stopped by
pid), as the cluster's etcd, agents and routers are; the etcd and redis-server that tests and
benchmarks start alone are `services.py`'s (plain `Popen`s still)."""

from deploy.local.cluster import ClusterSpec, Daemon, LocalCluster, Router, Worker
from deploy.local.engines import EngineSettings, kv_transfer_config

__all__ = ["ClusterSpec", "Daemon", "EngineSettings", "LocalCluster", "Router", "Worker",
           "kv_transfer_config"]
