"""A real local kvkeep cluster as subprocesses on loopback (see `cluster.py`), and the tiny
model it serves (`model.py`). Used by `kvkeep demo` and `kvkeep chaos`; nothing is mocked."""

from deploy.local.cluster import ClusterSpec, Daemon, LocalCluster, Router, Worker
from deploy.local.engines import EngineSettings, kv_transfer_config

__all__ = ["ClusterSpec", "Daemon", "EngineSettings", "LocalCluster", "Router", "Worker",
           "kv_transfer_config"]
