"""The local cluster's TLS option (`ClusterSpec(tls=True)`): a throwaway CA and what every part
is started with, the same settings deploy/k8s uses, on loopback.

- etcd serves https with `--client-cert-auth`; every kvkeep command gets `--etcd https://...
  --etcd-ca/--etcd-cert/--etcd-key`, the connector the same as `store.remote.etcd_*`.
- Daemons serve mTLS with one shared certificate named `kvkeep-store` (checked by clients and
  peers: `--tls-server-name`) and sign their registrations (`--registration-key`); the
  connector dials them with the CA, its own certificate, that name, and the public key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploy.pki import Authority, CertPaths, registration_keypair, write_private

if TYPE_CHECKING:
    from kvstore.net.daemon_client import ClientTLS

__all__ = ["LocalPki", "STORE_NAME"]

STORE_NAME = "kvkeep-store"


@dataclass(frozen=True, slots=True)
class LocalPki:
    etcd_server: CertPaths
    client: CertPaths
    """One client identity for the agents, routers and connectors (CN kvkeep)."""
    store: CertPaths
    registration_key: Path
    registration_public_key: Path

    @classmethod
    def create(cls, directory: Path) -> LocalPki:
        ca = Authority.create("kvkeep-local-ca")
        private, public = registration_keypair()
        directory.mkdir(parents=True, exist_ok=True)
        pub = directory / "registration.pub"
        pub.write_bytes(public)
        return cls(
            etcd_server=ca.issue_to(directory, "etcd", "kvkeep-etcd", dns=("localhost",),
                                    ips=("127.0.0.1",)),
            client=ca.issue_to(directory, "client", "kvkeep"),
            store=ca.issue_to(directory, "store", STORE_NAME, dns=(STORE_NAME,)),
            registration_key=write_private(directory / "registration.key", private),
            registration_public_key=pub)

    def etcd_server_args(self) -> list[str]:
        p = self.etcd_server
        return ["--cert-file", str(p.cert), "--key-file", str(p.key),
                "--trusted-ca-file", str(p.ca), "--client-cert-auth"]

    def etcd_client_flags(self, identity: CertPaths | None = None) -> list[str]:
        p = identity or self.client
        return ["--etcd-ca", str(p.ca), "--etcd-cert", str(p.cert), "--etcd-key", str(p.key)]

    def daemon_flags(self) -> list[str]:
        p = self.store
        return [*self.etcd_client_flags(p), "--tls-cert", str(p.cert), "--tls-key", str(p.key),
                "--tls-ca", str(p.ca), "--tls-server-name", STORE_NAME,
                "--registration-key", str(self.registration_key)]

    def connector_remote(self) -> dict[str, Any]:
        """The connector's `store.remote` keys for etcd TLS and the daemons' identity."""
        p = self.client
        return {"etcd_ca": str(p.ca), "etcd_cert": str(p.cert), "etcd_key": str(p.key),
                "tls_ca": str(p.ca), "tls_cert": str(p.cert), "tls_key": str(p.key),
                "tls_server_name": STORE_NAME,
                "registration_public_key": str(self.registration_public_key)}

    def daemon_client_tls(self) -> ClientTLS:
        """`ClientTLS` for talking to the daemons directly (probes, the demo's Stat calls)."""
        from kvstore.net.daemon_client import ClientTLS

        p = self.client
        return ClientTLS(p.ca, p.cert, p.key, STORE_NAME)
