"""etcd for every kvkeep component: one typed `EtcdSpec` (endpoints, TLS, client certificate,
user and password file), the one client builder (`etcd_client`), and the command-line flags
every `kvkeep` command that talks to etcd shares (`kvstore.etcd.flags`).

The client (aetcd, grpc) is imported on first use, so that building a CLI parser stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.etcd.spec import EtcdSpec, etcd_spec

if TYPE_CHECKING:
    from kvstore.etcd.client import EtcdClient, etcd_client

__all__ = ["EtcdSpec", "etcd_spec", "EtcdClient", "etcd_client"]


def __getattr__(name: str) -> Any:
    if name in ("EtcdClient", "etcd_client"):
        from kvstore.etcd import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
