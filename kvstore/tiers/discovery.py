"""Moved to the control plane: kvstore/cluster/discovery.py (this name stays for importers)."""

from kvstore.cluster.discovery import (
    DEFAULT_PREFIX,
    DELETE_GRACE_S,
    DaemonInfo,
    DaemonTrust,
    Discovery,
    EtcdDiscovery,
    Listener,
    MembershipWatcher,
    StaticDiscovery,
    parse_etcd_endpoints,
)

__all__ = ["DEFAULT_PREFIX", "DELETE_GRACE_S", "DaemonInfo", "Discovery", "StaticDiscovery",
           "MembershipWatcher", "EtcdDiscovery", "parse_etcd_endpoints", "Listener",
           "DaemonTrust"]
