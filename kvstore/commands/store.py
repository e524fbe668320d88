"""`kvkeep store ...` subcommands (registered into the CLI by kvstore/commands/kvkeep.py).

    kvkeep store serve [--config FILE] --listen HOST:PORT --data-dir DIR --mem-budget SIZE
                       --disk-budget SIZE --node-id ID [--etcd URL] [--token-file F]
                       [--tls-cert F --tls-key F [--tls-ca F]] [--data-listen auto|off|H:P]
                       [--metrics-listen auto|off|H:P] ...
                       [--etcd-ca F --etcd-cert F --etcd-key F] [--etcd-user U
                        --etcd-password-file F]

--config FILE: the same settings as a YAML (or, named *.json, JSON) mapping, one key per flag
(the flag without its dashes, `-` as `_`: `mem_budget: 16GiB`; `--etcd-prefix` is `prefix` and
`--registration-pubkey` is `registration_public_key`, as the connector spells them). A flag
given on the command line wins over the file's key; an unknown key is an error.

etcd: `https://` URLs mean TLS, verified against --etcd-ca; a client certificate
(--etcd-cert/--etcd-key) for etcd's --client-cert-auth, and/or etcd user auth.

Blocks travel over a plain TCP data plane beside gRPC (kvstore/net/tcp_protocol.py: same tokens,
tenants and limits, every block verified; ~2-3x gRPC's throughput here), on `--data-listen`
(default: the --listen host, any free port, advertised in etcd and in Stat). Give it a fixed
HOST:PORT where a firewall needs one; it is off with TLS, since it is not encrypted.

The daemon moves multi-MiB messages; glibc would map and unmap a fresh buffer for each (page
faults cap gRPC at ~1.2-1.6 GB/s here, against ~3.7 with reuse). So `serve` re-executes itself
once with MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ set, which only takes effect at
process start. Set KVKEEP_NO_MALLOC_TUNING=1 to skip that.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.errors import KVKeepError
from kvstore.etcd import EtcdSpec
from kvstore.etcd.flags import add_etcd_arguments

if TYPE_CHECKING:
    from kvstore.daemon.config import DaemonSettings

__all__ = ["register", "serve_main", "build_serve_parser", "settings_from_args", "MALLOC_ENV"]

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "67108864", "MALLOC_TRIM_THRESHOLD_": "268435456"}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    store = subparsers.add_parser("store", help="the kvstore daemon and its tools")
    commands = store.add_subparsers(dest="store_command", required=True)
    serve = commands.add_parser("serve", help="run a kvstore daemon (one per node)",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_serve_arguments(serve)
    serve.set_defaults(handler=_serve_handler)
    probe = commands.add_parser(
        "probe", help="exit 0 iff a daemon's health service says SERVING (an exec probe for "
                      "daemons with mTLS, which the kubelet's gRPC probe cannot speak)")
    probe.add_argument("--address", default="127.0.0.1:7070", help="HOST:PORT of the daemon")
    probe.add_argument("--tls-ca", type=Path, default=None)
    probe.add_argument("--tls-cert", type=Path, default=None)
    probe.add_argument("--tls-key", type=Path, default=None)
    probe.add_argument("--tls-server-name", default=None, metavar="NAME")
    probe.add_argument("--timeout", type=float, default=2.0, metavar="SECONDS")
    probe.set_defaults(handler=_probe_handler)
    # `kvkeep etcd roles`: the etcd users and roles every component above runs under.
    from kvstore.etcd import roles

    roles.register(subparsers)


def build_serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvstore.daemon", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_serve_arguments(parser)
    return parser


def serve_main(argv: Sequence[str]) -> int:
    args = build_serve_parser().parse_args(argv)
    return _serve_handler(args, argv=list(argv))


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The serve flags: each one's dest is a `DaemonSettings` key (tests/test_daemon_settings.py
    checks both ways), and none has a default, so that a flag left out leaves the --config
    file's key (or `DaemonConfig`'s default) in place."""
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="settings file (YAML, or JSON if named *.json): one key per flag; the "
                   "flags given win over it")
    p.add_argument("--listen", help="HOST:PORT to bind (PORT 0: any free port); required, as a "
                   "flag or in --config, as are --data-dir and --node-id")
    p.add_argument("--data-dir", type=Path, help="where the nvme tier lives")
    p.add_argument("--mem-budget", help="host RAM tier size (e.g. 8GiB; default 1GiB)")
    p.add_argument("--disk-budget", help="nvme tier size (e.g. 500GiB; default 10GiB)")
    # --no-mem-prefault turns off a config file's `mem_prefault: true`; None: not given.
    p.add_argument("--mem-prefault", action=argparse.BooleanOptionalAction, default=None,
                   help="touch the whole RAM budget at start-up (a slower start, then puts at "
                   "memcpy speed from the first one: on a VM whose host backs memory lazily, "
                   "the first touch of a page runs at a fraction of that, 0.28 GB/s against "
                   "8.6 GB/s on this project's machines)")
    p.add_argument("--disk-fsync", choices=("block", "off"),
                   help="'block' (default): every block written behind to the nvme tier is "
                   "fsync'd, so an acknowledged block survives a power loss once written; "
                   "'off': written to the page cache only (a killed daemon keeps its blocks, a "
                   "power loss may lose the last ones, read back as misses), which is what "
                   "LMCache's fs backend and Redis without AOF give")
    p.add_argument("--node-id", help="this node's unique name")
    add_etcd_arguments(p, help="etcd URL(s), e.g. https://10.0.0.1:2379 (https: TLS); omit to "
                               "run unregistered")
    p.add_argument("--etcd-prefix", dest="prefix", help="registration prefix "
                   "(default /kvkeep/stores/)")
    p.add_argument("--advertise", help="HOST:PORT clients dial (default: --listen)")
    p.add_argument("--lease-ttl", type=int, help="etcd lease TTL in seconds")
    p.add_argument("--token-file", type=Path,
                   help="bearer tokens -> tenants; required to listen beyond loopback")
    p.add_argument("--tls-cert", type=Path)
    p.add_argument("--tls-key", type=Path)
    p.add_argument("--tls-ca", type=Path,
                   help="CA for client certificates: turns on mutual TLS (and peers are "
                        "verified against it)")
    p.add_argument("--tls-server-name", metavar="NAME",
                   help="the name every daemon's certificate carries, checked instead of a "
                        "peer's address (one certificate shared by all daemons)")
    p.add_argument("--registration-key", type=Path, metavar="FILE",
                   help="Ed25519 private key (PEM) the etcd registration is signed with; "
                        "peers are believed only if theirs verify")
    p.add_argument("--registration-pubkey", dest="registration_public_key", type=Path,
                   metavar="FILE",
                   help="more Ed25519 public keys (PEM) peers may sign with (key rotation)")
    p.add_argument("--replicas", type=int,
                   help="copies per block the re-replication restores (match the clients' R)")
    p.add_argument("--rereplicate-after", type=float,
                   help="seconds membership must be stable before blocks are re-replicated")
    p.add_argument("--drain-timeout", type=float,
                   help="seconds in-flight streams get to finish on SIGTERM")
    p.add_argument("--workers", type=int, help="storage I/O threads")
    p.add_argument("--tenant-put-share", type=float,
                   help="share of the in-flight put budget (half of --mem-budget, 64MiB-4GiB) "
                   "one tenant may hold (default 0.5)")
    p.add_argument("--tenant-put-streams", type=int,
                   help="concurrent puts (gRPC streams, data plane requests) per tenant")
    p.add_argument("--tenant-stored-share", type=float,
                   help="share of --disk-budget one tenant's blocks may fill; past it its "
                   "oldest blocks go (default 1.0: all tenants share the disk by LRU)")
    p.add_argument("--inflight-put-bytes",
                   help="the daemon's in-flight put budget (default: half of --mem-budget)")
    p.add_argument("--put-idle-timeout", type=float,
                   help="seconds a put may go without a byte arriving before it is dropped")
    p.add_argument("--idle-timeout", type=float,
                   help="seconds an authenticated connection may stay idle")
    p.add_argument("--preauth-timeout", type=float,
                   help="seconds a data plane connection may stay open without an "
                   "authenticated request (slowloris)")
    p.add_argument("--data-listen",
                   help="bulk data plane (plain TCP beside gRPC, for block get/put): 'auto' "
                   "(the --listen host, any free port; advertised in etcd and Stat), 'off', or "
                   "HOST:PORT. Always off with TLS.")
    p.add_argument("--metrics-listen",
                   help="Prometheus /metrics over HTTP (HTTPS with --tls-cert): 'auto' (the "
                   "--listen host, any free port; logged), 'off', or HOST:PORT (give one for "
                   "Prometheus to scrape). Beyond loopback only with --token-file.")
    from kvstore.daemon.config import add_budget_arguments
    add_budget_arguments(p)


def _probe_handler(args: argparse.Namespace) -> int:
    from kvstore.net.daemon_client import ClientTLS, DaemonClient

    tls = None if args.tls_ca is None else ClientTLS(args.tls_ca, args.tls_cert, args.tls_key,
                                                     args.tls_server_name)
    try:
        client = DaemonClient("probe", args.address, tls=tls)
        try:
            status = client.health(timeout=args.timeout)
        finally:
            client.close()
    except KVKeepError as exc:
        print(f"kvkeep store probe: {args.address}: {exc}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def _serve_handler(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    if argv is None and "serve" in sys.argv:  # `kvkeep store serve ...`
        argv = sys.argv[sys.argv.index("serve") + 1:]
    if argv is not None and os.environ.get("KVKEEP_NO_MALLOC_TUNING") != "1" and any(
            os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        env = {**os.environ, **MALLOC_ENV}
        os.execve(sys.executable, [sys.executable, "-m", "kvstore.daemon", *argv], env)
    from kvstore.daemon.server import run_daemon

    try:
        config = settings_from_args(args).config()
        if isinstance(config.etcd, EtcdSpec):
            config.etcd.check_files()  # a typo fails the start, not every reconnect
    except KVKeepError as exc:
        print(f"kvkeep store serve: {exc}", file=sys.stderr)
        return 2
    return run_daemon(config)


def settings_from_args(args: argparse.Namespace) -> DaemonSettings:
    """The serve command's settings: the --config file's keys, each flag given over its own
    (a flag's dest is its key), parsed as one mapping, so a key is checked the same wherever
    it was given; a ConfigError names the key."""
    from kvstore.daemon.config import DaemonSettings
    from kvstore.settings import parse_settings, read_settings_file

    given = {} if args.config is None else read_settings_file(args.config)
    for key in _setting_keys():
        value = getattr(args, key, None)
        if value is not None:  # given on the command line
            given[key] = os.fspath(value) if isinstance(value, os.PathLike) else value
    where = ("the command line" if args.config is None
             else f"{args.config} (with the command line's flags over it)")
    return parse_settings(given, DaemonSettings, where)


def _setting_keys() -> list[str]:
    """Every serve flag's dest but --config's: the `DaemonSettings` keys flags can give."""
    parser = build_serve_parser()
    return [a.dest for a in parser._actions if a.dest not in ("help", "config")]
