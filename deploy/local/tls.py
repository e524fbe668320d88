"""The local cluster's TLS option (`ClusterSpec(tls=True)`): a throwaway CA and what every part
is started with, the same settings deploy/k8s uses, on loopback.

- etcd serves https with `--client-cert-auth`; every kvkeep command gets `--etcd https://...
  --etcd-ca/--etcd-cert/--etcd-key`, the connector the same as `store.remote.etcd_*`.
- Daemons serve mTLS with one shared certificate named `kvkeep-store` (checked by clients and
  peers: `--tls-server-name`) and sign their registrations (`--registration-key`); the
  connector dials them with the CA, its own certificate, that name, and the public key.
- etcd's auth is on with the roles of kvstore/etcd/roles.py (`enable_etcd_roles`, once etcd
  is up): each agent, daemon and router authenticates as its own user
  (`kvkeep-worker-<id>`, `kvkeep-daemon-<id>`, `kvkeep-router`, passwords in
  `etcd-passwords/`), so a worker's credential writes its own key only; the shared client
  certificate's CN (`kvkeep`) is the connectors' read-only user. More than deploy/k8s can
  do, where one Deployment's pods share one certificate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploy.pki import Authority, CertPaths, registration_keypair, write_private

if TYPE_CHECKING:
    from kvstore.net.daemon_client import ClientTLS

__all__ = ["LocalPki", "STORE_NAME"]

STORE_NAME = "kvkeep-store"
CLIENT_CN = "kvkeep"
"""The shared client certificate's CN: with etcd roles on, the connectors' read-only user."""
ROUTER_USER = "kvkeep-router"


@dataclass(frozen=True, slots=True)
class LocalPki:
    etcd_server: CertPaths
    client: CertPaths
    """One client identity for the agents, routers and connectors (CN kvkeep)."""
    store: CertPaths
    registration_key: Path
    registration_public_key: Path
    etcd_passwords: Path
    """Each etcd user's password file, named by the user (made by `enable_etcd_roles`)."""

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
            client=ca.issue_to(directory, "client", CLIENT_CN),
            store=ca.issue_to(directory, "store", STORE_NAME, dns=(STORE_NAME,)),
            registration_key=write_private(directory / "registration.key", private),
            registration_public_key=pub, etcd_passwords=directory / "etcd-passwords")

    def etcd_server_args(self) -> list[str]:
        p = self.etcd_server
        return ["--cert-file", str(p.cert), "--key-file", str(p.key),
                "--trusted-ca-file", str(p.ca), "--client-cert-auth"]

    def etcd_client_flags(self, identity: CertPaths | None = None) -> list[str]:
        p = identity or self.client
        return ["--etcd-ca", str(p.ca), "--etcd-cert", str(p.cert), "--etcd-key", str(p.key)]

    def enable_etcd_roles(self, url: str, workers: Sequence[str], daemons: Sequence[str]
                          ) -> None:
        """Give every part its own etcd user and turn etcd's auth on (etcd must still have
        it off: the client certificate is all this shows)."""
        from kvstore.etcd.roles import Layout, apply_roles, password_file, principals
        from kvstore.etcd.spec import EtcdSpec

        wanted = principals(Layout(), routers=[ROUTER_USER], workers=workers,
                            daemons=daemons, connectors=[CLIENT_CN])
        passwords: dict[str, str | None] = {
            p.user: None if p.user == CLIENT_CN else password_file(self.etcd_passwords,
                                                                   p.user)[1]
            for p in wanted}
        _, root = password_file(self.etcd_passwords, "root")
        c = self.client
        asyncio.run(apply_roles(EtcdSpec(url, ca_file=c.ca, cert_file=c.cert, key_file=c.key),
                                wanted, passwords=passwords, root_password=root))

    def etcd_user_flags(self, user: str) -> list[str]:
        """`--etcd-user USER --etcd-password-file F` (the users `enable_etcd_roles` made)."""
        return ["--etcd-user", user, "--etcd-password-file", str(self.etcd_passwords / user)]

    def agent_flags(self, worker_id: str) -> list[str]:
        from kvstore.etcd.roles import Layout, worker

        return [*self.etcd_client_flags(), *self.etcd_user_flags(worker(Layout(),
                                                                        worker_id).user)]

    def router_flags(self) -> list[str]:
        return [*self.etcd_client_flags(), *self.etcd_user_flags(ROUTER_USER)]

    def daemon_flags(self, node_id: str | None = None) -> list[str]:
        """The daemons' TLS and identity flags; with `node_id`, its own etcd user too."""
        from kvstore.etcd.roles import Layout, daemon

        user = [] if node_id is None else self.etcd_user_flags(daemon(Layout(), node_id).user)
        return [*self._daemon_tls_flags(), *user]

    def _daemon_tls_flags(self) -> list[str]:
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
