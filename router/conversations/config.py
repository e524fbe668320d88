"""Stateful continuation's configuration and its `kvkeep router serve` flags.

    --continuation                      keep each session's conversation in the kvkeep store
    --store-etcd URL                    where the daemons register (default: --etcd)
    --store-daemon ID=HOST:PORT         or list them (repeatable)
    --store-token-file FILE             bearer token of the daemons (first line)
    --store-tenant NAME                 the store tenant the records live under
                                        (conversations; never the connectors' `default`)
    --store-record-key-file FILE        the key records are signed with (the same file on
                                        every replica; default: one of this process only)
    --store-replicas N                  daemons each record is written to (2)
    --store-tls-ca F [--store-tls-cert F --store-tls-key F] [--store-tls-server-name N]
    --store-registration-pubkey F       how the daemons prove their identity (a token goes
                                        only to daemons that do: kvstore/cluster/daemon_trust.py)

Without --store-etcd the records use the router's own etcd; with it, another etcd, reached
with the router's etcd TLS and credentials all the same.

The store tenant must be the records' own (trust-review H7): `default` is the connectors'
tenant (deploy/k8s/workers.yaml), so with it every worker pod's token could read and rewrite
every conversation, and `*` is no tenant. Both are refused; give the router a token that
grants its own tenant only.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace

from kvstore.errors import ConfigError, InvalidKey
from kvstore.etcd import EtcdSpec
from kvstore.etcd.flags import etcd_spec_from_args
from kvstore.keys import validate_name
from kvstore.mac import MacKey
from kvstore.tiers.factory import RemoteSpec
from router.conversations.records import RecordKey

__all__ = ["ContinuationConfig", "add_arguments", "from_args", "STORE_TENANT",
           "SHARED_TENANTS"]

STORE_TENANT = "conversations"
"""The records' store tenant unless told."""
SHARED_TENANTS = frozenset({"default", "*"})
"""Store tenants the records may not use: the connectors' default, and the peers' wildcard."""


@dataclass(frozen=True, slots=True)
class ContinuationConfig:
    """Where conversation records live: the daemons (a remote tier's spec: through etcd or
    listed, the token that grants `tenant`, TLS, how many daemons hold each record), and the
    key they are signed with (None: one of this process only)."""

    remote: RemoteSpec
    tenant: str = STORE_TENANT
    record_key: RecordKey | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.tenant in SHARED_TENANTS:
            raise ConfigError(
                f"--store-tenant {self.tenant!r}: conversation records need a store tenant of "
                "their own (`default` is the connectors', so every worker pod could read and "
                f"rewrite every conversation); use e.g. {STORE_TENANT!r} with a token that "
                "grants it")
        try:
            validate_name(self.tenant, "store tenant")
        except InvalidKey as exc:
            raise ConfigError(str(exc)) from exc

    def remote_spec(self) -> RemoteSpec:
        return self.remote


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("stateful continuation")
    group.add_argument("--continuation", action="store_true",
                       help="keep each session's conversation (token ids) in the kvkeep store "
                            "so a client may send only the new turn")
    group.add_argument("--store-etcd", default=None, metavar="URL",
                       help="etcd the kvstore daemons register in (default: --etcd), "
                            "reached with the --etcd-* TLS and credentials")
    group.add_argument("--store-daemon", action="append", default=[], metavar="ID=HOST:PORT",
                       help="a kvstore daemon, instead of discovery through etcd (repeatable)")
    group.add_argument("--store-token-file", default=None, metavar="FILE",
                       help="file whose first line is the daemons' bearer token")
    group.add_argument("--store-tenant", default=STORE_TENANT,
                       help="store tenant of the records, their own (not `default`, the "
                            "connectors'; the token must grant it; default %(default)s)")
    group.add_argument("--store-record-key-file", default=None, metavar="FILE",
                       help="secret the records are signed with (hex or raw bytes, at least "
                            "32; the same file on every replica); default: a key of this "
                            "process only (a continuation reaching another replica, or a "
                            "restarted one, is a 409)")
    group.add_argument("--store-replicas", type=int, default=2)
    group.add_argument("--store-timeout", type=float, default=1.0, metavar="SECONDS")
    group.add_argument("--store-tls-ca", default=None, metavar="FILE",
                       help="mTLS to the daemons: the CA their certificates are checked against")
    group.add_argument("--store-tls-cert", default=None, metavar="FILE")
    group.add_argument("--store-tls-key", default=None, metavar="FILE")
    group.add_argument("--store-tls-server-name", default=None, metavar="NAME",
                       help="the name the daemons' certificates carry (checked instead of "
                            "their address)")
    group.add_argument("--store-registration-pubkey", default=None, metavar="FILE",
                       help="Ed25519 public key the daemons sign their registrations with")


def from_args(args: argparse.Namespace) -> ContinuationConfig | None:
    if not args.continuation:
        if args.store_etcd or args.store_daemon or args.store_token_file \
                or args.store_record_key_file:
            raise ConfigError("--store-* flags need --continuation")
        return None
    daemons = []
    for spec in args.store_daemon:
        node, sep, address = str(spec).partition("=")
        if not sep or not node or ":" not in address:
            raise ConfigError(f"--store-daemon must be ID=HOST:PORT, not {spec!r}")
        daemons.append((node, address))
    # The router's own etcd comes with its TLS and credentials (--etcd-ca, ...), and so does
    # --store-etcd's: a plain URL would talk to it without them (trust review L7).
    own = etcd_spec_from_args(args)
    etcd: EtcdSpec | str | None = None
    if not daemons:
        etcd = own
        if args.store_etcd:
            etcd = args.store_etcd if own is None else replace(own, url=args.store_etcd)
    if etcd is None and not daemons:
        raise ConfigError("--continuation needs the kvstore daemons: --store-etcd, "
                          "--store-daemon, or --etcd")
    # A bad flag stops the router at start: the spec checks itself.
    remote = RemoteSpec(etcd=etcd, daemons=tuple(daemons), replicas=args.store_replicas,
                        timeout_s=args.store_timeout, token_file=args.store_token_file,
                        name="conversations", tls_ca=args.store_tls_ca,
                        tls_cert=args.store_tls_cert, tls_key=args.store_tls_key,
                        tls_server_name=args.store_tls_server_name,
                        registration_public_key=args.store_registration_pubkey)
    key = None if args.store_record_key_file is None else RecordKey(
        MacKey.from_file(args.store_record_key_file).secret)
    return ContinuationConfig(remote, tenant=args.store_tenant, record_key=key)
