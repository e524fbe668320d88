"""State backends: etcd (shared by router replicas) and in-process (one replica only)."""

from router.state.base import BindingSink, StateBackend, WorkerLease, WorkerSink
from router.state.etcd import EtcdBackend
from router.state.memory import MemoryBackend

__all__ = ["StateBackend", "WorkerLease", "WorkerSink", "BindingSink", "EtcdBackend",
           "MemoryBackend"]
