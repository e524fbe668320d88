"""The etcd flags every `kvkeep` command that talks to etcd shares, and the `EtcdSpec` they
make: `kvkeep store serve`, `kvkeep router serve`, `kvkeep worker`.

    --etcd https://etcd-0:2379,https://etcd-1:2379  --etcd-ca ca.pem
    --etcd-cert client.pem --etcd-key client.key      (client certificate)
    --etcd-user kvkeep --etcd-password-file pw        (etcd user auth)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.etcd.spec import EtcdSpec

__all__ = ["add_etcd_arguments", "etcd_spec_from_args"]

_SECURITY = ("etcd_ca", "etcd_cert", "etcd_key", "etcd_user", "etcd_password_file")


def add_etcd_arguments(parser: argparse.ArgumentParser, *, required: bool = False,
                       help: str = "etcd URL(s), comma-separated; https:// means TLS") -> None:
    parser.add_argument("--etcd", required=required, default=None, metavar="URL", help=help)
    parser.add_argument("--etcd-ca", type=Path, default=None, metavar="FILE",
                        help="CA of the etcd servers' certificates (https; default: the "
                             "system's roots)")
    parser.add_argument("--etcd-cert", type=Path, default=None, metavar="FILE",
                        help="client certificate for etcd's --client-cert-auth")
    parser.add_argument("--etcd-key", type=Path, default=None, metavar="FILE",
                        help="the client certificate's key")
    parser.add_argument("--etcd-user", default=None, metavar="NAME",
                        help="etcd user (with --etcd-password-file)")
    parser.add_argument("--etcd-password-file", type=Path, default=None, metavar="FILE",
                        help="file whose first line is the etcd user's password")


def etcd_spec_from_args(args: argparse.Namespace, *, check_files: bool = False
                        ) -> EtcdSpec | None:
    """The spec the flags describe; None without --etcd (then no other etcd flag may be set).

    check_files reads every named file now (what a command does before it starts, so that a
    typo fails it at once rather than at every reconnect)."""
    if args.etcd is None:
        given = [f"--{name.replace('_', '-')}" for name in _SECURITY
                 if getattr(args, name, None) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} given without --etcd")
        return None
    spec = EtcdSpec(args.etcd, ca_file=args.etcd_ca, cert_file=args.etcd_cert,
                    key_file=args.etcd_key, user=args.etcd_user,
                    password_file=args.etcd_password_file)
    if check_files:
        spec.check_files()
    return spec
