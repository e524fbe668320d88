"""A real kvkeep cluster on loopback: etcd, kvstore daemons, vLLM workers with the kvkeep
connector, a `kvkeep worker` agent per vLLM server, and router replicas, all as subprocesses.

    with LocalCluster(ClusterSpec(daemons=2, workers=2, routers=1)) as cluster:
        cluster.router_url              # an OpenAI-compatible endpoint
        cluster.kill_worker("w1")       # SIGKILL vLLM and its agent: the node is gone
        cluster.restart_worker("w1")
        cluster.kill_daemon("d1"); cluster.restart_daemon("d1")      # same port, same disk
        cluster.kill_router("r1"); cluster.restart_router("r1")
        cluster.signal_etcd(signal.SIGSTOP); cluster.signal_etcd(signal.SIGCONT)
        cluster.add_worker("w3"); cluster.add_router("r2", ("--api-keys", "keys"))
        cluster.freeze_worker("w2"); cluster.thaw_worker("w2")   # SIGSTOP: a hung node

`ClusterSpec(daemons=0)` is a router-only cluster: its workers run plain vLLM, without the
connector (the router's own tests); `worker_args` gives every worker more vLLM flags.

For chaos runs (root only): `daemon_disk_tmpfs` puts each daemon's data dir on a tmpfs of its
own (a disk that really fills, `disks.py`), `isolated_workers` runs those workers and their
agents in network namespaces of their own (`netns.py`), which `cluster.fabric` can cut off from
etcd or from the daemons. The daemons then listen on the fabric's address and check bearer
tokens (a daemon refuses a non-loopback address without them).

Start order follows dependencies (etcd, daemons, workers and routers, agents); stop is the
reverse, each part by pid: SIGTERM, then SIGKILL after a grace period. The temp dir (logs, etcd
data, daemon disks, the model unless one was given) is removed at the end unless `keep_dir`.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from deploy.local.disks import mount_tmpfs, unmount
from deploy.local.engines import REPO_ROOT, EngineSettings, vllm_argv, vllm_env
from deploy.local.members import Daemon, Router, Worker
from deploy.local.netns import Fabric
from deploy.local.probes import daemon_serving, http_json, http_ok, port_open, wait_until
from deploy.local.processes import ManagedProcess, free_port
from deploy.local.tls import LocalPki
from deploy.local.tokens import LocalTokens
from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from kvstore.net.daemon_client import ClientTLS

__all__ = ["ClusterSpec", "LocalCluster", "Worker", "Daemon", "Router", "REPO_ROOT"]

# The daemon re-executes itself with these set unless they already are (kvstore/commands/store.py):
# set here, it starts once.
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "67108864", "MALLOC_TRIM_THRESHOLD_": "268435456"}


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    daemons: int = 2
    """0: no daemons, and the workers run without the kvkeep connector (a router-only set-up,
    as the router's own tests use)."""
    workers: int = 2
    routers: int = 1
    lease_ttl_s: float = 2.0
    """Worker agents' lease: a SIGKILLed node is noticed by every router within this."""
    model_dir: Path | None = None
    """A built model (see deploy.local.model); None: build one into the temp dir."""
    base_dir: Path | None = None
    """Where logs and data go; None: a fresh temp dir."""
    keep_dir: bool = False
    vllm_start_timeout_s: float = 240.0
    engine: EngineSettings | None = None
    """Overrides for the workers' engine (its model_dir is replaced by the cluster's)."""
    router_args: tuple[str, ...] = ()
    """Extra `kvkeep router serve` flags for every router (e.g. `--policy round-robin`)."""
    worker_args: tuple[str, ...] = ()
    """Extra vLLM flags for every worker (a chat template, tool parsers); they go last, so
    they win over the cluster's own."""
    daemon_mem_budget: str = "128MiB"
    daemon_disk_budget: str = "1GiB"
    daemon_disk_tmpfs: str | None = None
    """Mount each daemon's data dir on a tmpfs of this size (root only): a disk that fills."""
    isolated_workers: tuple[str, ...] = ()
    """Workers (`w1`, ...) run in network namespaces of their own (root only)."""
    daemon_token_file: Path | None = None
    """A `--token-file` for every daemon (bearer tokens and the tenants each may touch): the
    workers' connectors then present `engine.store_token_file`. Loopback daemons, so clients
    need no proof of their identity (isolated workers and `tls` bring their own tokens and
    certificates instead)."""
    tls: bool = False
    """etcd over TLS with client certificates, daemons over mTLS with signed registrations:
    deploy/k8s's trust settings, with a throwaway CA in the cluster's dir (deploy/local/tls.py)."""

    def __post_init__(self) -> None:
        if self.daemons < 0 or self.workers < 1 or self.routers < 1:
            raise ConfigError("a local cluster needs at least one worker and router (and no "
                              "negative number of daemons)")
        from kvstore.daemon.config import parse_size  # the daemon's own size syntax

        for size in (self.daemon_mem_budget, self.daemon_disk_budget,
                     *([self.daemon_disk_tmpfs] if self.daemon_disk_tmpfs else [])):
            parse_size(size)
        unknown = set(self.isolated_workers) - {f"w{i + 1}" for i in range(self.workers)}
        if unknown:
            raise ConfigError(f"isolated_workers names no worker of this cluster: "
                              f"{sorted(unknown)} (workers are w1..w{self.workers})")
        if self.daemon_token_file is not None and (self.tls or self.isolated_workers):
            raise ConfigError("daemon_token_file is for loopback clusters: tls and "
                              "isolated_workers bring their own credentials")
        if self.tls and self.isolated_workers:
            # The throwaway certificates name 127.0.0.1 and localhost, not the fabric's
            # addresses the isolated nodes reach etcd and the daemons at.
            raise ConfigError("tls and isolated_workers cannot be combined in a local cluster")


@dataclass
class LocalCluster:
    spec: ClusterSpec = field(default_factory=ClusterSpec)
    base_dir: Path = field(init=False, default=Path())
    etcd: ManagedProcess | None = field(init=False, default=None)
    etcd_port: int = field(init=False, default=0)
    daemons: list[Daemon] = field(init=False, default_factory=list)
    workers: dict[str, Worker] = field(init=False, default_factory=dict)
    routers: list[Router] = field(init=False, default_factory=list)
    engine: EngineSettings | None = field(init=False, default=None)
    fabric: Fabric | None = field(init=False, default=None)
    tokens: LocalTokens | None = field(init=False, default=None)
    """The isolated workers' bearer tokens and registration key (None: daemons check none)."""
    pki: LocalPki | None = field(init=False, default=None)
    """The TLS option's certificates and keys (None without `spec.tls`)."""
    _owns_dir: bool = field(init=False, default=False)
    _etcd_peer_port: int = field(init=False, default=0)

    # --- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self, say: Callable[[str], None] = lambda _line: None) -> None:
        """Start everything and wait until the routers see every worker; `say` is told what
        is happening (the demo prints it)."""
        self._make_dirs()
        if self.spec.tls:
            self.pki = LocalPki.create(self.base_dir / "pki")
            say(f"TLS on: a throwaway CA and certificates in {self.base_dir / 'pki'}")
        if self.spec.isolated_workers:
            self.fabric = Fabric.create()
            self.tokens = LocalTokens.create(
                self.base_dir, (self.spec.engine or EngineSettings(Path())).tenant)
            say(f"network namespaces on {self.fabric.subnet} for "
                f"{', '.join(self.spec.isolated_workers)}; daemons check bearer tokens")
        self.engine = self._engine_settings(say)
        say(f"etcd on 127.0.0.1:{self._start_etcd()}")
        if self.pki is not None:
            self.pki.enable_etcd_roles(self.etcd_url,
                                       [f"w{i + 1}" for i in range(self.spec.workers)],
                                       [f"d{i + 1}" for i in range(self.spec.daemons)])
            say("etcd auth on: each agent, daemon and router writes only its own keys")
        for i in range(self.spec.daemons):
            self._add_daemon(f"d{i + 1}")
        # vLLM is the slow part (tens of seconds on two cores): start all servers first, and
        # the routers meanwhile, then wait.
        for i in range(self.spec.workers):
            self._add_worker(f"w{i + 1}")
        for i in range(self.spec.routers):
            self._add_router(f"r{i + 1}")
        for d in self.daemons:
            wait_until(partial(daemon_serving, d.node_id, d.address, self.daemon_tls),
                       timeout=60,
                       what=f"kvstore daemon {d.node_id}", process=d.process)
            say(f"kvstore daemon {d.node_id} serving on {d.address} (kvkeep store serve)")
        for r in self.routers:
            self._wait_router(r)
            say(f"router {r.replica_id} listening on {r.url} (kvkeep router serve)")
        started = time.monotonic()
        for w in self.workers.values():
            self._wait_worker(w)
            say(f"vLLM worker {w.worker_id} healthy on {w.url} "
                f"({time.monotonic() - started:.0f}s since start), agent registering it")
        self.wait_routers_see(set(self.workers))
        say("every router sees every worker")

    def stop(self) -> None:
        """Stop everything this cluster started, in the reverse order of starting; remove the
        temp dir. Agents go first (they revoke their leases: no router rebinds sessions to a
        stopping worker), vLLM servers are signalled together (each takes seconds to exit)."""
        workers = list(self.workers.values())
        for w in reversed(workers):
            w.agent.stop(5)
        for r in reversed(self.routers):
            r.process.stop(5)
        for w in workers:
            w.server.terminate()
        for w in reversed(workers):
            w.server.stop(15)
        for d in reversed(self.daemons):
            d.process.signal(signal.SIGCONT)  # a paused one could not even die of SIGTERM
            d.process.stop(10)
        if self.etcd is not None:
            self.etcd.signal(signal.SIGCONT)
            self.etcd.stop(5)
        if self.spec.daemon_disk_tmpfs:
            for d in self.daemons:
                unmount(d.data_dir)
        if self.fabric is not None:
            self.fabric.destroy()
        if self._owns_dir and not self.spec.keep_dir and self.base_dir.exists():
            shutil.rmtree(self.base_dir, ignore_errors=True)

    # --- operations ------------------------------------------------------------------------
    @property
    def etcd_url(self) -> str:
        return f"{'https' if self.spec.tls else 'http'}://127.0.0.1:{self.etcd_port}"

    @property
    def daemon_tls(self) -> ClientTLS | None:
        """What a client needs to talk to the daemons directly (None without TLS)."""
        return None if self.pki is None else self.pki.daemon_client_tls()

    @property
    def peer_token(self) -> str | None:
        """An all-tenant token of the daemons (None: they check none)."""
        return None if self.tokens is None else self.tokens.peer_token

    def _etcd_flags(self) -> list[str]:
        """`--etcd URL` and, with TLS, the client certificate flags."""
        return ["--etcd", self.etcd_url,
                *([] if self.pki is None else self.pki.etcd_client_flags())]

    @property
    def router_url(self) -> str:
        return self.routers[0].url

    @property
    def router_urls(self) -> list[str]:
        return [r.url for r in self.routers]

    @property
    def logs(self) -> Path:
        return self.base_dir / "logs"

    def alive_workers(self) -> list[str]:
        return [wid for wid, w in self.workers.items() if w.alive]

    def kill_worker(self, worker_id: str) -> float:
        """SIGKILL the worker's vLLM server and its agent (the node dies: nobody revokes the
        lease, it expires). Returns the monotonic time of the kill."""
        w = self.workers[worker_id]
        w.server.kill()
        killed = time.monotonic()
        w.agent.kill()
        return killed

    def restart_worker(self, worker_id: str) -> None:
        """Start a killed worker again on the same ports and wait until routers see it."""
        w = self.workers[worker_id]
        w.server.stop(5)
        w.agent.stop(5)
        w.server.start()
        self._wait_worker(w)
        self.wait_routers_see({worker_id})

    def freeze_worker(self, worker_id: str) -> float:
        """The node hangs with its connections open: its agent SIGKILLed (nobody renews the
        lease, which expires after the TTL) and its vLLM SIGSTOPped (API server and engine
        core: sockets open and silent). Returns the monotonic time of the freeze."""
        w = self.workers[worker_id]
        w.agent.kill()
        w.server.signal(signal.SIGSTOP)
        return time.monotonic()

    def thaw_worker(self, worker_id: str) -> None:
        """A frozen node resumes: SIGCONT its vLLM, start its agent again, and wait until the
        routers use it."""
        w = self.workers[worker_id]
        w.server.signal(signal.SIGCONT)
        w.agent.stop(5)
        self._wait_worker(w)
        self.wait_routers_see({worker_id})

    def add_worker(self, worker_id: str, model_dir: Path | None = None) -> Worker:
        """Start one more worker node (vLLM and its agent) and wait until the routers use it;
        `model_dir`: other weights served under the same name (None: the cluster's model)."""
        if worker_id in self.workers:
            raise ConfigError(f"worker {worker_id!r} exists already")
        self._add_worker(worker_id, model_dir)
        w = self.workers[worker_id]
        self._wait_worker(w)
        self.wait_routers_see({worker_id})
        return w

    def add_router(self, replica_id: str, args: tuple[str, ...] = (), *,
                   see_workers: bool = True) -> Router:
        """Start one more router replica (`args`: flags of its own, after the cluster's) and
        wait until it answers, and until it uses every live worker unless `see_workers` is
        False (a router with `--api-keys` lists its workers to operators only; the cluster
        then never waits on its worker list)."""
        if any(r.replica_id == replica_id for r in self.routers):
            raise ConfigError(f"router {replica_id!r} exists already")
        self._add_router(replica_id, args)
        r = self.routers[-1]
        r.lists_workers = see_workers
        self._wait_router(r, set(self.alive_workers()) if see_workers else None)
        return r

    def daemon(self, node_id: str) -> Daemon:
        for d in self.daemons:
            if d.node_id == node_id:
                return d
        raise ConfigError(f"no daemon {node_id!r} (daemons: "
                          f"{', '.join(d.node_id for d in self.daemons)})")

    def router(self, replica_id: str) -> Router:
        for r in self.routers:
            if r.replica_id == replica_id:
                return r
        raise ConfigError(f"no router {replica_id!r}")

    def kill_daemon(self, node_id: str) -> float:
        """SIGKILL a daemon (no drain, its lease expires); returns the monotonic time."""
        d = self.daemon(node_id)
        d.process.signal(signal.SIGCONT)
        d.process.kill()
        return time.monotonic()

    def restart_daemon(self, node_id: str) -> None:
        """Start a stopped daemon again on the same port and data dir; wait until it serves."""
        d = self.daemon(node_id)
        d.process.stop(5)
        d.process.start()
        wait_until(partial(daemon_serving, d.node_id, d.address), timeout=60,
                   what=f"kvstore daemon {d.node_id}", process=d.process)

    def kill_router(self, replica_id: str) -> float:
        r = self.router(replica_id)
        r.process.kill()
        return time.monotonic()

    def restart_router(self, replica_id: str) -> None:
        """Start a stopped router again on its port; wait until it uses every worker the
        other live routers use (a worker still starting is nobody's yet)."""
        r = self.router(replica_id)
        r.process.stop(5)
        r.process.start()
        others = [self.router_workers(o) for o in self.routers
                  if o is not r and o.process.alive and o.lists_workers]
        self._wait_router(r, set.intersection(*others) if others else set(self.alive_workers()))

    def signal_etcd(self, sig: int) -> None:
        """SIGSTOP / SIGCONT (a hung etcd), SIGKILL (a crash)."""
        assert self.etcd is not None
        self.etcd.signal(sig)
        if sig == signal.SIGKILL:
            self.etcd.kill()

    def restart_etcd(self) -> None:
        """Start a killed etcd again: same ports, same data dir (its leases and keys)."""
        assert self.etcd is not None
        self.etcd.stop(5)
        self.etcd.start()
        wait_until(lambda: port_open(self.etcd_port), timeout=20, what="etcd",
                   process=self.etcd)

    def router_workers(self, router: Router | None = None) -> set[str]:
        """The workers a router considers usable right now."""
        listed = http_json(f"{(router or self.routers[0]).url}/kvkeep/workers")
        if not isinstance(listed, list):
            return set()
        return {str(w["id"]) for w in listed if isinstance(w, dict) and w.get("usable")}

    def wait_routers_see(self, worker_ids: set[str], timeout: float = 60.0) -> None:
        """Every live router uses `worker_ids`. A router that is down (or killed meanwhile, as
        chaos does) is not waited for: `restart_router` waits for it when it comes back."""
        def sees_or_down(r: Router) -> bool:
            return not r.process.alive or not r.lists_workers or self._router_sees(r, worker_ids)

        for r in self.routers:
            wait_until(partial(sees_or_down, r), timeout=timeout,
                       what=f"router {r.replica_id} to see {sorted(worker_ids)}")

    # --- private ---------------------------------------------------------------------------
    def _wait_router(self, r: Router, sees: set[str] | None = None) -> None:
        """Until the router answers its health check, and then uses `sees` (None: no wait)."""
        wait_until(partial(http_ok, f"{r.url}/health"), timeout=60,
                   what=f"router {r.replica_id}", process=r.process)
        if sees is not None:
            wait_until(partial(self._router_sees, r, sees), timeout=60,
                       what=f"router {r.replica_id} to see {sorted(sees)}", process=r.process)

    def _router_sees(self, router: Router, worker_ids: set[str]) -> bool:
        return worker_ids <= self.router_workers(router)

    def _make_dirs(self) -> None:
        if self.spec.base_dir is not None:
            self.base_dir = self.spec.base_dir
            self.base_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.base_dir = Path(tempfile.mkdtemp(prefix="kvkeep-local-"))
            self._owns_dir = True
        self.logs.mkdir(exist_ok=True)

    def _engine_settings(self, say: Callable[[str], None]) -> EngineSettings:
        model_dir = self.spec.model_dir
        if model_dir is None:
            from deploy.local.model import build_tiny_llama

            model_dir = build_tiny_llama(self.base_dir / "tiny-llama").path
            say(f"built a tiny random-weight Llama in {model_dir}")
        token = None if self.tokens is None else self.tokens.tenant_token_file
        engine = self.spec.engine or EngineSettings(model_dir=model_dir)
        return replace(engine, model_dir=model_dir,
                       store_token_file=engine.store_token_file if token is None else token,
                       connector=engine.connector and self.spec.daemons > 0)

    def _kvkeep(self, name: str, args: list[str], env: dict[str, str] | None = None,
                wrap: Callable[[list[str]], list[str]] = list) -> ManagedProcess:
        """`kvkeep ARGS` as `python -m kvstore.commands ARGS` (same entry point, no PATH needed);
        `wrap` turns the command line into one that runs elsewhere (a network namespace)."""
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                              environ.get("PYTHONPATH")]))
        return ManagedProcess(name, wrap([sys.executable, "-m", "kvstore.commands", *args]),
                              self.logs / f"{name}.log", environ, REPO_ROOT)

    def _start_etcd(self) -> int:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise ConfigError("etcd is not installed (`make setup` installs it)")
        self.etcd_port, peer_port = free_port(), free_port()
        peer = f"http://127.0.0.1:{peer_port}"
        listen = [self.etcd_url]
        if self.fabric is not None:  # isolated nodes reach it at the fabric's address
            listen.append(f"http://{self.fabric.etcd_address}:{self.etcd_port}")
        self.etcd = ManagedProcess("etcd", [
            etcd, "--name", "local", "--data-dir", str(self.base_dir / "etcd"),
            "--listen-client-urls", ",".join(listen), "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"local={peer}",
            # A throwaway single-node etcd: fast elections, and no fsync (nothing here must
            # survive a power cut; every fsync would cost the workers' leases latency).
            "--heartbeat-interval", "20", "--election-timeout", "200", "--unsafe-no-fsync",
            "--log-level", "error", *([] if self.pki is None else self.pki.etcd_server_args())],
            self.logs / "etcd.log").start()
        wait_until(lambda: port_open(self.etcd_port), timeout=20, what="etcd",
                   process=self.etcd)
        return self.etcd_port

    def _add_daemon(self, node_id: str) -> None:
        assert self.engine is not None
        port, metrics_port = free_port(), free_port()
        data = self.base_dir / f"store-{node_id}"
        data.mkdir(exist_ok=True)
        if self.spec.daemon_disk_tmpfs:
            from kvstore.daemon.config import parse_size

            mount_tmpfs(data, parse_size(self.spec.daemon_disk_tmpfs))
        # With isolated workers the daemons listen where those reach them, behind tokens.
        host = self.fabric.daemons_address if self.fabric is not None else "127.0.0.1"
        process = self._kvkeep(f"store-{node_id}", [
            "store", "serve", "--listen", f"{host}:{port}", "--data-dir", str(data),
            "--mem-budget", self.spec.daemon_mem_budget,
            "--disk-budget", self.spec.daemon_disk_budget, "--node-id", node_id,
            *self._etcd_flags(), "--lease-ttl", "3", "--workers", "2",
            "--replicas", str(self.engine.remote_replicas),
            "--metrics-listen", f"{host}:{metrics_port}", *self._daemon_trust_flags(node_id)],
            _MALLOC_ENV)
        self.daemons.append(Daemon(node_id, port, process.start(), data, host, metrics_port))

    def _daemon_trust_flags(self, node_id: str) -> list[str]:
        if self.pki is not None:
            return self.pki.daemon_flags(node_id)
        if self.tokens is not None:
            return self.tokens.daemon_flags()
        token_file = self.spec.daemon_token_file
        return [] if token_file is None else ["--token-file", str(token_file)]

    def _connector_remote(self) -> dict[str, Any] | None:
        """More `store.remote` keys: TLS and identity settings, or the registrations' key."""
        if self.pki is not None:
            return self.pki.connector_remote()
        return None if self.tokens is None else self.tokens.connector_remote()

    def _add_worker(self, worker_id: str, model_dir: Path | None = None) -> None:
        assert self.engine is not None
        engine = self.engine if model_dir is None else replace(self.engine, model_dir=model_dir)
        port, events, metrics = free_port(), free_port(), free_port()
        host, etcd_url = "127.0.0.1", self.etcd_url
        wrap: Callable[[list[str]], list[str]] = list
        if worker_id in self.spec.isolated_workers:
            assert self.fabric is not None
            host = self.fabric.add_node(worker_id).address
            etcd_url = f"http://{self.fabric.etcd_address}:{self.etcd_port}"
            wrap = partial(self.fabric.wrap, worker_id)
        server = ManagedProcess(f"vllm-{worker_id}",
                                wrap(vllm_argv(engine, port=port, events_port=events,
                                               etcd_url=etcd_url, host=host,
                                               remote_extra=self._connector_remote(),
                                               worker_id=worker_id,
                                               extra_args=self.spec.worker_args)),
                                self.logs / f"vllm-{worker_id}.log", vllm_env(),
                                REPO_ROOT)
        agent = self._kvkeep(f"agent-{worker_id}", [
            "worker", "--etcd", etcd_url,
            *([] if self.pki is None else self.pki.agent_flags(worker_id)),
            "--url", f"http://{host}:{port}",
            "--id", worker_id, "--kv-events", f"tcp://{host}:{events}",
            "--ttl", str(self.spec.lease_ttl_s), "--metrics-listen", f"{host}:{metrics}"],
            wrap=wrap)
        self.workers[worker_id] = Worker(worker_id, port, events, server.start(), agent, host,
                                         metrics)

    def _wait_worker(self, w: Worker) -> None:
        wait_until(lambda: http_ok(f"{w.url}/health"), timeout=self.spec.vllm_start_timeout_s,
                   what=f"vLLM worker {w.worker_id}", process=w.server, step=0.25)
        # The agent starts once its server answers: it would register nothing before that.
        if not w.agent.alive:
            w.agent.start()

    def _add_router(self, replica_id: str, args: tuple[str, ...] = ()) -> None:
        assert self.engine is not None
        port = free_port()
        # Routers trust loopback workers only unless told; isolated workers register their
        # namespace's address, so the fabric's subnet is allowed too.
        allow = ([] if self.fabric is None else
                 ["--allow-workers", f"127.0.0.0/8,::1,localhost,{self.fabric.subnet}"])
        process = self._kvkeep(f"router-{replica_id}", [
            "router", "serve", "--listen", f"127.0.0.1:{port}", "--etcd", self.etcd_url,
            *([] if self.pki is None else self.pki.router_flags()),
            "--replica-id", replica_id, "--block-size", str(self.engine.block_size),
            "--stream-idle-timeout", "20", *allow, *self.spec.router_args, *args])
        self.routers.append(Router(replica_id, port, process.start()))

