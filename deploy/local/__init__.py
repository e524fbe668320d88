"""A real local kvkeep cluster as subprocesses on loopback (see `cluster.py`), and the tiny
model it serves (`model.py`). Used by `kvkeep demo` and `kvkeep chaos`; nothing is mocked.

Its parts, each started one way: a vLLM server's command line and environment are
`engines.py`'s (a cluster's worker, or one alone: `vllm_server.py`), a kvstore daemon's
`daemons.py`'s (tests' and benchmarks' daemons alike), and the etcd and redis-server (or Redis
Cluster) that tests and benchmarks start alone `services.py`'s; every one runs as a
`processes.ManagedProcess` (its own process group and log, stopped by pid), as the cluster's
agents and routers do."""

from deploy.local.cluster import ClusterSpec, Daemon, LocalCluster, Router, Worker
from deploy.local.engines import EngineSettings, kv_transfer_config

__all__ = ["ClusterSpec", "Daemon", "EngineSettings", "LocalCluster", "Router", "Worker",
           "kv_transfer_config"]
