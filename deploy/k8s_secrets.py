"""The TLS and signing Secrets deploy/k8s mounts, made by a fresh CA (deploy/pki.py):

    python -m deploy.k8s_secrets --out kvkeep-secrets.yaml [--namespace kvkeep]
    kubectl apply -n kvkeep -f kvkeep-secrets.yaml      # before `kubectl apply -k deploy/k8s`

One CA signs every certificate; each component has its own, whose common name is its etcd
user name (etcd's --client-cert-auth):

- kvkeep-etcd-tls: the etcd members' server and peer certificate (kvkeep-etcd[.NS[.svc]],
  *.kvkeep-etcd-headless.NS.svc, localhost, 127.0.0.1);
- kvkeep-store-tls: every kvstore daemon, as server and as client of etcd and its peers; it
  names `kvkeep-store`, the name clients check (`--tls-server-name`, `tls_server_name`);
- kvkeep-connector-tls, kvkeep-agent-tls, kvkeep-router-tls: client certificates of the vLLM
  connector (etcd and the daemons), the worker agents and the routers (etcd);
- kvkeep-etcd-root-tls: etcd's root user (CN root), for the Job that sets the roles
  (`kvkeep etcd roles`, deploy/k8s/etcd.yaml) and nothing else;
- kvkeep-registration-key / kvkeep-registration-pubkey: the Ed25519 pair daemons sign their
  etcd registrations with / connectors verify them with;
- kvkeep-ca: the CA certificate alone (`ca.crt`), for Prometheus to check the daemons' HTTPS
  /metrics (deploy/k8s/monitoring.yaml) without reading a Secret that holds a private key.

The CA's private key is not written anywhere: to rotate, make a new set and apply it.
Secrets of type kubernetes.io/tls carry `ca.crt`, `tls.crt`, `tls.key`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped, unused-ignore]

from deploy.pki import Authority, registration_keypair, write_private

__all__ = ["Identity", "identities", "build_secrets", "main", "STORE_SERVER_NAME",
           "REGISTRATION_KEY_SECRET", "REGISTRATION_PUBKEY_SECRET", "CA_SECRET"]

STORE_SERVER_NAME = "kvkeep-store"
"""The name every daemon's certificate carries, which its clients check."""
REGISTRATION_KEY_SECRET = "kvkeep-registration-key"
REGISTRATION_PUBKEY_SECRET = "kvkeep-registration-pubkey"
CA_SECRET = "kvkeep-ca"
_LABELS = {"app.kubernetes.io/name": "kvkeep"}


@dataclass(frozen=True, slots=True)
class Identity:
    secret: str
    common_name: str
    """The etcd user name under --client-cert-auth."""
    dns: tuple[str, ...] = ()
    ips: tuple[str, ...] = ()


def identities(namespace: str = "kvkeep") -> tuple[Identity, ...]:
    svc = f"{namespace}.svc"
    etcd_names = ("kvkeep-etcd", f"kvkeep-etcd.{namespace}", f"kvkeep-etcd.{svc}",
                  f"kvkeep-etcd.{svc}.cluster.local", f"*.kvkeep-etcd-headless.{svc}",
                  f"*.kvkeep-etcd-headless.{svc}.cluster.local", "localhost")
    return (
        Identity("kvkeep-etcd-tls", "kvkeep-etcd", etcd_names, ("127.0.0.1",)),
        Identity("kvkeep-store-tls", "kvkeep-store", (STORE_SERVER_NAME,)),
        Identity("kvkeep-connector-tls", "kvkeep-connector"),
        Identity("kvkeep-agent-tls", "kvkeep-agent"),
        Identity("kvkeep-router-tls", "kvkeep-router"),
        # etcd's root (CN root): only the roles Job (deploy/k8s/etcd.yaml) mounts it.
        Identity("kvkeep-etcd-root-tls", "root"),
    )


def build_secrets(namespace: str = "kvkeep", authority: Authority | None = None
                  ) -> list[dict[str, Any]]:
    """Every Secret the manifests mount, as Kubernetes objects (a new CA unless given)."""
    ca = authority or Authority.create("kvkeep-cluster-ca")
    docs: list[dict[str, Any]] = []
    for ident in identities(namespace):
        issued = ca.issue(ident.common_name, dns=ident.dns, ips=ident.ips)
        docs.append(_secret(ident.secret, "kubernetes.io/tls", {
            "ca.crt": ca.cert_pem.decode(), "tls.crt": issued.cert_pem.decode(),
            "tls.key": issued.key_pem.decode()}))
    private, public = registration_keypair()
    docs.append(_secret(REGISTRATION_KEY_SECRET, "Opaque", {"key.pem": private.decode()}))
    docs.append(_secret(REGISTRATION_PUBKEY_SECRET, "Opaque", {"key.pub": public.decode()}))
    docs.append(_secret(CA_SECRET, "Opaque", {"ca.crt": ca.cert_pem.decode()}))
    return docs


def _secret(name: str, kind: str, data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": kind,
            "metadata": {"name": name, "labels": dict(_LABELS)}, "stringData": data}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.k8s_secrets",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the YAML file to write (0600)")
    parser.add_argument("--namespace", default="kvkeep")
    args = parser.parse_args(argv)
    docs = build_secrets(args.namespace)
    write_private(args.out, yaml.safe_dump_all(docs, sort_keys=False).encode())
    print(f"wrote {len(docs)} Secrets to {args.out}: kubectl apply -n {args.namespace} "
          f"-f {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
