"""Moved to the control plane: kvstore/cluster/daemon_info.py (this name stays for importers)."""

from kvstore.cluster.daemon_info import DaemonInfo

__all__ = ["DaemonInfo"]
