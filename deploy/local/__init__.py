"""A real local kvkeep cluster as subprocesses on loopback (see `cluster.py`), and the tiny
model it serves (`model.py`). Used by `kvkeep demo` and `kvkeep chaos`; nothing is mocked.

Its parts, each started the one way: every child process is a `processes.ManagedProcess` (its
own process group, stopped by pid); a vLLM server's command line and environment are
`engines.py`'s (a cluster's worker, or one alone: `vllm_server.py`); a kvstore daemon is
`daemons.py`'s; etcd and redis-server are `services.py`'s."""

from deploy.local.cluster import ClusterSpec, Daemon, LocalCluster, Router, Worker
from deploy.local.engines import EngineSettings, kv_transfer_config

__all__ = ["ClusterSpec", "Daemon", "EngineSettings", "LocalCluster", "Router", "Worker",
           "kv_transfer_config"]
