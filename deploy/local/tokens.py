"""The local cluster's bearer-token option, used when workers run in network namespaces
(`ClusterSpec(isolated_workers=...)`): daemons then listen beyond loopback, which they refuse
without tokens, and clients believe a non-loopback daemon only once it proves it is one.

- A tenant token for the workers' connectors and an all-tenant (`*`) one for the daemons'
  re-replication and the cluster's own probes, in a `--token-file`.
- An Ed25519 key pair: daemons sign their registrations (`--registration-key`), connectors get
  the public key (`store.remote.registration_public_key`, kvstore/cluster/daemon_trust.py).

`tls.py` is the other option (mTLS and etcd TLS, loopback only).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.pki import registration_keypair, write_private

__all__ = ["LocalTokens"]


@dataclass(frozen=True, slots=True)
class LocalTokens:
    tenant_token_file: Path
    """The workers' connector token (`store.remote.token_file`)."""
    daemon_token_file: Path
    peer_token: str
    """The daemons' all-tenant token."""
    registration_key: Path
    registration_public_key: Path

    @classmethod
    def create(cls, directory: Path, tenant: str) -> LocalTokens:
        tenant_token, peer_token = secrets.token_hex(16), secrets.token_hex(16)
        tenant_file, daemon_file = directory / "tenant-token", directory / "daemon-tokens"
        tenant_file.write_text(tenant_token + "\n")
        daemon_file.write_text(f"{tenant_token} {tenant}\n{peer_token} *\n")
        private, public = registration_keypair()
        pub = directory / "registration.pub"
        pub.write_bytes(public)
        return cls(tenant_token_file=tenant_file, daemon_token_file=daemon_file,
                   peer_token=peer_token,
                   registration_key=write_private(directory / "registration.key", private),
                   registration_public_key=pub)

    def daemon_flags(self) -> list[str]:
        return ["--token-file", str(self.daemon_token_file),
                "--registration-key", str(self.registration_key)]

    def connector_remote(self) -> dict[str, Any]:
        """The connector's `store.remote` key for the daemons' identity (its token file comes
        through `EngineSettings.store_token_file`)."""
        return {"registration_public_key": str(self.registration_public_key)}
