"""Router configuration: one frozen object built from the command line (or by tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.errors import ConfigError
from kvstore.etcd import EtcdSpec
from router.conversations.config import ContinuationConfig
from router.limits import Limits
from router.membership.allowlist import WorkerAllowList, is_loopback
from router.membership.workers import WorkerId
from router.policy import PolicySpec, policy_preset
from router.tenants import ApiKeys

__all__ = ["StaticWorker", "RouterConfig", "parse_static_worker"]


@dataclass(frozen=True, slots=True)
class StaticWorker:
    """A worker given on the command line (in-process state only): `[ID=]URL[,kv-events=EP]`."""

    worker_id: WorkerId
    url: str
    kv_events: str | None = None


def parse_static_worker(spec: str, index: int) -> StaticWorker:
    head, *options = spec.split(",")
    worker_id, sep, url = head.partition("=")
    if not sep:
        worker_id, url = f"w{index}", head
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"worker {spec!r}: URL must start with http:// or https://")
    kv_events = None
    for option in options:
        key, _, value = option.partition("=")
        if key.strip() != "kv-events" or not value:
            raise ConfigError(f"worker {spec!r}: unknown option {option!r}")
        kv_events = value.strip()
    return StaticWorker(WorkerId(worker_id.strip()), url.rstrip("/"), kv_events)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything a router replica needs.

    - `etcd_url` None: in-process state, one replica only; a URL or an `EtcdSpec` (TLS,
      client certificate, user auth: kvstore/etcd/spec.py) otherwise.
    - `session_ttl_s`: a binding unused this long is forgotten.
    - `stream_idle_timeout_s`: a worker silent this long mid-stream, once its first bytes came,
      counts as broken (hung, not dead: a SIGSTOPped worker keeps its socket open).
    - `first_byte_timeout_s`: how long a stream may wait for its worker's first bytes (queued
      behind others, or prefilling a long prompt); passing it is a soft failure of the worker
      (trust review M8), and the stream starts again elsewhere.
    - `request_timeout_s`: the whole of a non-streaming request (silent until it is done).
    - `max_resumes`: how many times one stream may move before the client gets an error event.
    - `block_size`: tokens per KV block on the workers, for precise prefix keys.
    - `policy`: what decides (`router/policy.py`; from `--policy`, `--policy-config` and the
      flags that override it: `router/policy_file.py`).
    - `api_keys`: bearer keys and their tenants (`router/tenants.py`); None: no auth, one
      tenant, and then the router listens on loopback only.
    - `workers_allow`: the worker addresses registrations must match
      (`router/membership/allowlist.py`; default loopback only); static workers are allowed
      as given.
    - `limits`: sessions, index sizes, KV-event intake, answer sizes (`router/limits.py`).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    etcd_url: EtcdSpec | str | None = None
    etcd_prefix: str = "/kvkeep"
    policy: PolicySpec = field(default_factory=policy_preset)
    api_keys: ApiKeys | None = None
    max_body_bytes: int = 8 << 20
    session_ttl_s: float = 3600.0
    scrape_interval_s: float = 0.5
    connect_timeout_s: float = 2.0
    stream_idle_timeout_s: float = 30.0
    first_byte_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    max_attempts: int = 3
    max_resumes: int = 2
    block_size: int = 32
    static_workers: tuple[StaticWorker, ...] = ()
    static_ttl_s: float = 3.0
    replica_id: str = ""
    workers_allow: WorkerAllowList = field(default_factory=WorkerAllowList)
    limits: Limits = field(default_factory=Limits)
    continuation: ContinuationConfig | None = None
    """Stateful continuation's store (`router/conversations/`); None: off."""
    extproc_listen: str | None = None
    """HOST:PORT of the Envoy ext_proc endpoint picker (`router/extproc/`); None: off."""
    extproc_fallbacks: int = 2
    """Ranked fallback endpoints the ext_proc picker returns after its pick."""

    def __post_init__(self) -> None:
        if not self.api_keys and not is_loopback(self.host):
            raise ConfigError(
                f"refusing to listen on {self.host}: without --api-keys the router serves "
                "loopback only (give an API key file to serve a network)")
        if self.max_body_bytes < 1024:
            raise ConfigError("max body must be at least 1 KiB")
        if self.block_size < 1:
            raise ConfigError("block size must be positive")
        if self.first_byte_timeout_s <= 0 or self.stream_idle_timeout_s <= 0:
            raise ConfigError("stream timeouts must be positive")
        if self.etcd_url is not None and self.static_workers:
            raise ConfigError("--worker is for the in-process state; with etcd, run "
                              "`kvkeep worker` beside each vLLM server")

    def allow_list(self) -> WorkerAllowList:
        """The allow-list registrations are checked against: the configured one, plus the
        static workers exactly as the operator named them."""
        return self.workers_allow.with_urls(
            [w.url for w in self.static_workers]
            + [w.kv_events for w in self.static_workers if w.kv_events])
