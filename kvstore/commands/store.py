"""`kvkeep store ...` subcommands (registered into the CLI by kvstore/commands/kvkeep.py).

    kvkeep store serve --listen HOST:PORT --data-dir DIR --mem-budget SIZE --disk-budget SIZE
                       --node-id ID [--etcd URL] [--token-file F]
                       [--tls-cert F --tls-key F [--tls-ca F]] [--data-listen auto|off|H:P]
                       [--metrics-listen auto|off|H:P] ...
                       [--etcd-ca F --etcd-cert F --etcd-key F] [--etcd-user U
                        --etcd-password-file F]

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

from kvstore.errors import KVKeepError
from kvstore.etcd.flags import add_etcd_arguments, etcd_spec_from_args

__all__ = ["register", "serve_main", "build_serve_parser", "MALLOC_ENV"]

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
    p.add_argument("--listen", required=True, help="HOST:PORT to bind (PORT 0: any free port)")
    p.add_argument("--data-dir", required=True, type=Path, help="where the nvme tier lives")
    p.add_argument("--mem-budget", default="1GiB", help="host RAM tier size (e.g. 8GiB)")
    p.add_argument("--disk-budget", default="10GiB", help="nvme tier size (e.g. 500GiB)")
    p.add_argument("--mem-prefault", action="store_true",
                   help="touch the whole RAM budget at start-up (a slower start, then puts at "
                   "memcpy speed from the first one: on a VM whose host backs memory lazily, "
                   "the first touch of a page runs at a fraction of that, 0.28 GB/s against "
                   "8.6 GB/s on this project's machines)")
    p.add_argument("--disk-fsync", choices=("block", "off"), default="block",
                   help="'block' (default): every block written behind to the nvme tier is "
                   "fsync'd, so an acknowledged block survives a power loss once written; "
                   "'off': written to the page cache only (a killed daemon keeps its blocks, a "
                   "power loss may lose the last ones, read back as misses), which is what "
                   "LMCache's fs backend and Redis without AOF give")
    p.add_argument("--node-id", required=True, help="this node's unique name")
    add_etcd_arguments(p, help="etcd URL(s), e.g. https://10.0.0.1:2379 (https: TLS); omit to "
                               "run unregistered")
    p.add_argument("--etcd-prefix", default=None, help="registration prefix "
                   "(default /kvkeep/stores/)")
    p.add_argument("--advertise", default=None, help="HOST:PORT clients dial (default: --listen)")
    p.add_argument("--lease-ttl", type=int, default=5, help="etcd lease TTL in seconds")
    p.add_argument("--token-file", type=Path, default=None,
                   help="bearer tokens -> tenants; required to listen beyond loopback")
    p.add_argument("--tls-cert", type=Path, default=None)
    p.add_argument("--tls-key", type=Path, default=None)
    p.add_argument("--tls-ca", type=Path, default=None,
                   help="CA for client certificates: turns on mutual TLS (and peers are "
                        "verified against it)")
    p.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="the name every daemon's certificate carries, checked instead of a "
                        "peer's address (one certificate shared by all daemons)")
    p.add_argument("--registration-key", type=Path, default=None, metavar="FILE",
                   help="Ed25519 private key (PEM) the etcd registration is signed with; "
                        "peers are believed only if theirs verify")
    p.add_argument("--registration-pubkey", type=Path, default=None, metavar="FILE",
                   help="more Ed25519 public keys (PEM) peers may sign with (key rotation)")
    p.add_argument("--replicas", type=int, default=2,
                   help="copies per block the re-replication restores (match the clients' R)")
    p.add_argument("--rereplicate-after", type=float, default=30.0,
                   help="seconds membership must be stable before blocks are re-replicated")
    p.add_argument("--drain-timeout", type=float, default=15.0,
                   help="seconds in-flight streams get to finish on SIGTERM")
    p.add_argument("--workers", type=int, default=4, help="storage I/O threads")
    p.add_argument("--tenant-put-share", type=float, default=0.5,
                   help="share of the in-flight put budget (half of --mem-budget, 64MiB-4GiB) "
                   "one tenant may hold (default 0.5)")
    p.add_argument("--tenant-put-streams", type=int, default=16,
                   help="concurrent puts (gRPC streams, data plane requests) per tenant")
    p.add_argument("--tenant-stored-share", type=float, default=1.0,
                   help="share of --disk-budget one tenant's blocks may fill; past it its "
                   "oldest blocks go (default 1.0: all tenants share the disk by LRU)")
    p.add_argument("--inflight-put-bytes", default=None,
                   help="the daemon's in-flight put budget (default: half of --mem-budget)")
    p.add_argument("--put-idle-timeout", type=float, default=10.0,
                   help="seconds a put may go without a byte arriving before it is dropped")
    p.add_argument("--idle-timeout", type=float, default=120.0,
                   help="seconds an authenticated connection may stay idle")
    p.add_argument("--preauth-timeout", type=float, default=5.0,
                   help="seconds a data plane connection may stay open without an "
                   "authenticated request (slowloris)")
    p.add_argument("--data-listen", default="auto",
                   help="bulk data plane (plain TCP beside gRPC, for block get/put): 'auto' "
                   "(the --listen host, any free port; advertised in etcd and Stat), 'off', or "
                   "HOST:PORT. Always off with TLS.")
    p.add_argument("--metrics-listen", default="auto",
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
    from kvstore.daemon.config import DaemonConfig, budget_options, parse_size
    from kvstore.daemon.server import run_daemon

    try:
        config = DaemonConfig(
            listen=args.listen, data_dir=args.data_dir, mem_budget=parse_size(args.mem_budget),
            disk_budget=parse_size(args.disk_budget), disk_fsync=args.disk_fsync == "block",
            mem_prefault=args.mem_prefault,
            node_id=args.node_id,
            etcd=etcd_spec_from_args(args, check_files=True),
            advertise=args.advertise, lease_ttl=args.lease_ttl, token_file=args.token_file,
            tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
            tls_server_name=args.tls_server_name, registration_key=args.registration_key,
            registration_public_keys=args.registration_pubkey,
            replicas=args.replicas, rereplicate_after=args.rereplicate_after,
            drain_timeout=args.drain_timeout, workers=args.workers,
            data_listen=args.data_listen, metrics_listen=args.metrics_listen,
            tenant_put_share=args.tenant_put_share,
            tenant_put_streams=args.tenant_put_streams,
            tenant_stored_share=args.tenant_stored_share,
            inflight_put_bytes=(parse_size(args.inflight_put_bytes)
                                if args.inflight_put_bytes else None),
            put_idle_timeout=args.put_idle_timeout, idle_timeout=args.idle_timeout,
            preauth_timeout=args.preauth_timeout, **budget_options(args),
            **({"etcd_prefix": args.etcd_prefix} if args.etcd_prefix else {}))
    except KVKeepError as exc:
        print(f"kvkeep store serve: {exc}", file=sys.stderr)
        return 2
    return run_daemon(config)

