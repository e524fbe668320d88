"""The connector's settings: `kv_connector_extra_config`, parsed and checked once.

Example (every key optional except a store with at least one tier)::

    {"store": {"host_bytes": 4294967296,
               "nvme": {"path": "/var/lib/kvkeep", "bytes": 107374182400},
               "remote": {"etcd": "https://etcd:2379", "prefix": "/kvkeep/stores/",
                          "replicas": 2, "timeout_ms": 1000,
                          "etcd_ca": "/etc/kvkeep/etcd/ca.pem",
                          "etcd_cert": "/etc/kvkeep/etcd/tls.crt",
                          "etcd_key": "/etc/kvkeep/etcd/tls.key",
                          "tls_ca": "/etc/kvkeep/store-tls/ca.crt",
                          "tls_cert": "/etc/kvkeep/store-tls/tls.crt",
                          "tls_key": "/etc/kvkeep/store-tls/tls.key",
                          "registration_public_key": "/etc/kvkeep/registration/key.pub"},
               "redis": {"url": "redis://redis:6379/0", "prefix": "kvkeep"}},
     "codec": "raw", "compression": "none",
     "checkpoint_tokens": 32, "restore_deadline_ms": 2000, "hinted_restore_deadline_ms": 5000,
     "save_timeout_ms": 0,
     "load_mode": "auto", "tenant": "default",
     "durability": {"replicas": 2, "timeout_ms": 5000},
     "model_id": "llama-3-8b", "weights_revision": "abc123",
     "mac_key_file": "/etc/kvkeep/tenant-default.mac", "restore_path": "auto",
     "prefetch": {"worker_id": "worker-3", "prefix": "/kvkeep", "max_blocks": 4096}}

`mac_key_file`: the tenant's MAC key (kvstore/mac.py), held by its engines and never by the
daemons: every frame saved is signed with it, and a frame restored must carry a valid MAC
under it (else it is recomputed, and deleted), so neither a holder of the tenant's daemon
token nor a daemon or disk can inject KV. Without it frames are unsigned and any that verify
are used.

`prefetch`: follow the routers' failover hints for this worker (PrefetchSpec,
`connectors.vllm.prefetch`); absent, a moved session's blocks are read when its turn arrives.

`durability`: see DurabilitySpec and the connector README ("Durability"); absent, blocks reach
the daemons by write-behind.

Unknown keys are an error, not a shrug: a typo in `checkpoint_tokens` would otherwise silently
leave a session unprotected. The keys and what each may hold are the `_Extra` Struct below,
parsed as every settings mapping of the product is (`kvstore.settings`): strict JSON types, a
`ConfigError` naming the key (`$.store.nvme.bytes`); what needs two keys at once is checked in
`ConnectorConfig.from_extra`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal, cast

import msgspec

from kvstore.codecs import config_codec_name
from kvstore.errors import CodecError, ConfigError, InvalidKey
from kvstore.etcd import EtcdSpec
from kvstore.keys import validate_name
from kvstore.mac import MacKey
from kvstore.settings import RemoteClientSettings, Text, parse_settings
from kvstore.tiers.factory import NvmeSpec, RedisSpec, RemoteSpec

__all__ = [
    "NvmeSpec",
    "RemoteSpec",
    "RedisSpec",
    "StoreSpec",
    "ConnectorConfig",
    "DurabilitySpec",
    "Codec",
    "Compression",
    "LoadMode",
    "LookupMode",
    "RestorePath",
    "SavePath",
    "RestorePolicy",
    "DEFAULT_REPLICAS",
]

# "int8" is resolved to the default int8 scheme when parsed (kvstore.codecs.DEFAULT_INT8), so a
# parsed config (and the fingerprint) names the scheme itself.
Codec = Literal["raw", "int8-sym", "int8-asym", "int8-kivi", "int8-g32", "int4"]
LoadMode = Literal["sync", "async", "auto"]
LookupMode = Literal["auto", "worker"]
RestorePath = Literal["auto", "device_decode", "staged"]
SavePath = Literal["auto", "staged"]
RestorePolicy = Literal["cost", "always"]
Compression = Literal["none", "auto", "zstd"]

DEFAULT_REPLICAS: Final = 2
"""Copies of each block on the remote daemons unless `store.remote.replicas` says otherwise."""
DEFAULT_DURABILITY_TIMEOUT_MS: Final = 5000

# -- the keys as given (milliseconds, bytes; None where a key may be left out) ------------------

_Positive = Annotated[int, msgspec.Meta(gt=0)]
_Count = Annotated[int, msgspec.Meta(ge=0)]
# A day at most: a larger deadline is a unit mistake (seconds for ms), and it keeps out inf.
_Ms = Annotated[float, msgspec.Meta(gt=0, le=86_400_000)]
_MsOrZero = Annotated[float, msgspec.Meta(ge=0, le=86_400_000)]
_Rate = Annotated[float, msgspec.Meta(gt=0, le=1e12)]


class _Nvme(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    path: Text
    bytes: _Positive = 64 << 30
    durable: bool = True


class _Remote(RemoteClientSettings, frozen=True):
    """`store.remote`: the shared remote-client keys (`kvstore.settings`) and the tier's own."""

    daemons: dict[Text, Text] | None = None
    replicas: _Positive | None = None
    timeout_ms: _Ms = 1000
    # mTLS to the daemons: the cluster CA their certificates are checked against, our client
    # certificate and key, and the name their certificates carry.
    tls_ca: Text | None = None
    tls_cert: Text | None = None
    tls_key: Text | None = None
    tls_server_name: Text | None = None


class _Redis(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    url: Text | None = None
    nodes: list[Text] | None = None
    prefix: Text = "kvkeep"
    ttl_seconds: _Positive | None = None
    timeout_ms: _Ms = 5000


class _Store(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    host_bytes: _Count = 0
    host_pinned: bool = False
    nvme: _Nvme | None = None
    remote: _Remote | None = None
    redis: _Redis | None = None
    name: str = "default"


class _Durability(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    replicas: _Positive | None = None
    timeout_ms: _Ms = DEFAULT_DURABILITY_TIMEOUT_MS


class _Prefetch(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    worker_id: Text
    prefix: Text = "/kvkeep"
    max_blocks: _Positive = 4096
    max_age_s: Annotated[float, msgspec.Meta(gt=0, le=86_400)] = 120.0


class _Extra(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """`kv_connector_extra_config` as given."""

    store: _Store
    codec: str = "raw"
    compression: Compression = "none"
    checkpoint_tokens: _Positive | None = None
    restore_deadline_ms: _Ms = 2000
    hinted_restore_deadline_ms: _Ms | None = None
    save_timeout_ms: _MsOrZero = 0
    load_mode: LoadMode = "auto"
    tenant: str = "default"
    model_id: Text | None = None
    weights_revision: Text | None = None
    max_inflight_saves: _Positive = 256
    lookup: LookupMode = "auto"
    restore_first_layers: _Count = 0
    mac_key_file: Text | None = None
    durability: _Durability | None = None
    restore_path: RestorePath = "auto"
    save_path: SavePath = "auto"
    restore_policy: RestorePolicy = "cost"
    prefill_tokens_per_s: _Rate | None = None
    prefetch: _Prefetch | None = None


# -- the parsed config --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StoreSpec:
    """The tiers of the store, fastest first (host, nvme, remote, redis; the specs are the tier
    factory's, `kvstore.tiers.factory`). Equal specs share one store per process.

    `name` separates two stores with otherwise equal specs in one process (tests that start a
    "fresh" engine next to an old one; two engines that must not share host RAM).
    """

    host_bytes: int = 0
    nvme: NvmeSpec | None = None
    remote: RemoteSpec | None = None
    name: str = "default"
    redis: RedisSpec | None = None
    host_pinned: bool = False
    """Page-locked host pages (CUDA only): a GPU restores lent blocks from them by DMA."""

    def __post_init__(self) -> None:
        if (self.host_bytes <= 0 and self.nvme is None and self.remote is None
                and self.redis is None):
            raise ConfigError("store: configure at least one of host_bytes, nvme, remote, redis")


@dataclass(frozen=True, slots=True)
class DurabilitySpec:
    """Make KV durable on `replicas` remote daemons before the tokens computed with it reach the
    client: every engine step that completes full blocks returns only once each is held by
    `replicas` distinct daemons, or `timeout_s` after the step (then counted, logged, and the
    blocks go on behind as without the setting). See the connector README, "Durability"."""

    replicas: int
    timeout_s: float


@dataclass(frozen=True, slots=True)
class PrefetchSpec:
    """Follow the router's failover hints for `worker_id` (the id its `kvkeep worker` agent
    registers) under the routers' etcd `prefix`, and pull each moved session's blocks (at most
    `max_blocks`; hints older than `max_age_s` are stale) into the tiers above the one holding
    them (`connectors.vllm.prefetch`). `etcd`: `store.remote`'s."""

    etcd: EtcdSpec
    worker_id: str
    prefix: str = "/kvkeep"
    max_blocks: int = 4096
    max_age_s: float = 120.0


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    store: StoreSpec
    codec: Codec = "raw"
    compression: Compression = "none"
    checkpoint_tokens: int | None = None
    """Save completed blocks every this many computed tokens; None: as each block completes."""
    restore_deadline_s: float = 2.0
    """Past this, a lookup reports what it has (or nothing) and a load reports the rest as
    failed: vLLM computes instead of waiting."""
    hinted_restore_deadline_s: float = 5.0
    """The same for a request the router sent with a `restore_reason` (its session moved: its
    KV was checkpointed elsewhere and is known to be in the store, so waiting for it beats
    recomputing it). Never below `restore_deadline_s`."""
    save_timeout_s: float = 0.0
    """Without `durability`, how long a step may wait for its saves: 0 (the default), never
    (they finish in the background, and a slow store costs only how recent the stored KV is);
    more bounds that lag at the step's expense."""
    """How long `wait_for_save` waits for one step's saves before letting them finish in the
    background (they are reported when they do)."""
    load_mode: LoadMode = "auto"
    """"auto": a restore from a network tier loads asynchronously (vLLM parks only its
    request, with the hinted deadline), one from host RAM or nvme inside the forward pass;
    "sync"/"async": always so (see the README's table)."""
    tenant: str = "default"
    model_id: str | None = None
    weights_revision: str | None = None
    max_inflight_saves: int = 256
    """Blocks staged for saving beyond which new saves are skipped (a slow store must not
    grow memory without bound); skipped blocks are retried at the next checkpoint."""
    restore_first_layers: int = 0
    """A restore reads layers [0, k) of every block first and the rest while the forward pass
    computes those (one more read per block); 0: all layers in one read."""
    mac_key: MacKey | None = None
    """The tenant's MAC key, from `mac_key_file` (see the module doc)."""
    lookup: LookupMode = "auto"
    """Where the scheduler's lookups run. "auto": in the scheduler's process when the worker
    shares it (vLLM's in-process executor), else in the worker, one engine step later, via the
    per-step metadata ("worker", which can also be forced)."""
    durability: DurabilitySpec | None = None
    """None: blocks reach the daemons by write-behind (a node lost meanwhile loses them)."""
    restore_path: RestorePath = "auto"
    """How blocks reach the paged cache. "auto": decoded on the host (straight into CPU caches
    whose blocks hold frames verbatim; else into a host staging tensor, copied over, scattered).
    "device_decode": a chunk's segments go to the cache's device in one copy and are decoded
    there (`decode_layer_batch`). "staged": the staging pipeline (`connectors.vllm.staging`).
    The last two are measured by `benchmarks.gpu` and not the default until a GPU run says."""
    save_path: SavePath = "auto"
    """How frames are made (`connectors.vllm.staging.save`). "auto": one frame encoded per
    block on the saver's thread. "staged": batches quantized on the device, one copy per
    batch, sealed (or compressed) on a pool. Either works with every codec, compression, MAC
    key and durability setting."""
    restore_policy: RestorePolicy = "cost"
    """"cost": restore only the stored prefix that loads faster than it computes
    (`connectors.vllm.restore_cost`); "always": every hit, whatever it costs."""
    prefill_tokens_per_s: float | None = None
    """The engine's prefill rate for the cost decision; None: learned from its own steps."""
    prefetch: PrefetchSpec | None = None
    """None: a moved session's blocks are read when its next turn arrives."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Parse `kv_connector_extra_config`; raises ConfigError on anything malformed."""
        given = parse_settings(extra, _Extra, "kv_connector_extra_config")
        deadline = given.restore_deadline_ms / 1000
        hinted = (max(5.0, deadline) if given.hinted_restore_deadline_ms is None
                  else given.hinted_restore_deadline_ms / 1000)
        if hinted < deadline:
            raise ConfigError("hinted_restore_deadline_ms must not be below restore_deadline_ms "
                              "(a restore known to be in the store waits at least as long)")
        store = _store(given.store)
        return cls(
            store=store,
            durability=None if given.durability is None else _durability(given.durability,
                                                                         store.remote),
            codec=_codec(given.codec),
            compression=given.compression,
            checkpoint_tokens=given.checkpoint_tokens,
            restore_deadline_s=deadline,
            hinted_restore_deadline_s=hinted,
            save_timeout_s=given.save_timeout_ms / 1000,
            load_mode=given.load_mode,
            tenant=_name(given.tenant, "tenant"),
            model_id=given.model_id,
            weights_revision=given.weights_revision,
            max_inflight_saves=given.max_inflight_saves,
            lookup=given.lookup,
            restore_first_layers=given.restore_first_layers,
            mac_key=None if given.mac_key_file is None else MacKey.from_file(given.mac_key_file),
            restore_path=given.restore_path,
            save_path=given.save_path,
            restore_policy=given.restore_policy,
            prefill_tokens_per_s=given.prefill_tokens_per_s,
            prefetch=None if given.prefetch is None else _prefetch(given.prefetch, given.store,
                                                                  store),
        )

    def restore_deadline_for(self, *, hinted: bool) -> float:
        """Seconds a lookup or load may take: longer when the router hinted a restore."""
        return self.hinted_restore_deadline_s if hinted else self.restore_deadline_s

    def checkpoint_interval(self, block_size: int) -> int:
        """Tokens between decode-time checkpoints; never below one block (blocks are the unit
        a store holds, so a smaller interval cannot lose less). With `durability`, one block:
        a block must be durable by the end of the step that completes it."""
        if self.durability is not None:
            return block_size
        return max(block_size, self.checkpoint_tokens or block_size)


def _store(given: _Store) -> StoreSpec:
    nvme = None if given.nvme is None else NvmeSpec(given.nvme.path, given.nvme.bytes,
                                                    given.nvme.durable)
    return StoreSpec(host_bytes=given.host_bytes, nvme=nvme,
                     remote=None if given.remote is None else _remote(given.remote),
                     name=_name(given.name, "store.name"),
                     redis=None if given.redis is None else _redis(given.redis),
                     host_pinned=given.host_pinned)


def _remote(given: _Remote) -> RemoteSpec:
    daemons = tuple(sorted((given.daemons or {}).items()))
    if (given.etcd is None) == (not daemons):
        raise ConfigError("store.remote needs exactly one of 'etcd' and 'daemons'")
    return RemoteSpec(
        etcd=given.etcd_spec(), prefix=given.stores_prefix, replicas=_replicas(given, daemons),
        daemons=daemons, timeout_s=given.timeout_ms / 1000, token_file=given.token_file,
        tls_ca=given.tls_ca, tls_cert=given.tls_cert, tls_key=given.tls_key,
        tls_server_name=given.tls_server_name,
        registration_public_key=given.registration_public_key)


def _prefetch(given: _Prefetch, raw: _Store, store: StoreSpec) -> PrefetchSpec:
    etcd = None if raw.remote is None else raw.remote.etcd_spec()
    if etcd is None:
        raise ConfigError("prefetch follows the routers' hints in etcd: it needs "
                          "store.remote with 'etcd'")
    if store.host_bytes <= 0 and store.nvme is None:
        raise ConfigError("prefetch pulls blocks into host RAM or nvme: it needs "
                          "store.host_bytes or store.nvme")
    worker_id = given.worker_id
    if not worker_id or "/" in worker_id or worker_id != worker_id.strip():
        raise ConfigError(f"prefetch.worker_id {worker_id!r}: the id the worker's agent "
                          f"registers, with no '/' or surrounding space")
    return PrefetchSpec(etcd, worker_id, given.prefix, given.max_blocks, given.max_age_s)


def _redis(given: _Redis) -> RedisSpec:
    if (given.url is None) == (given.nodes is None) or given.nodes == []:
        raise ConfigError("store.redis needs a 'url' (one server) or 'nodes' (a Redis "
                          "Cluster's seed host:port list, not empty), not both")
    return RedisSpec(url=given.url or "", nodes=tuple(given.nodes or ()), prefix=given.prefix,
                     ttl_s=given.ttl_seconds, timeout_s=given.timeout_ms / 1000)


def _replicas(given: _Remote, daemons: tuple[tuple[str, str], ...]) -> int:
    """R: 2 by default (one lost daemon loses no KV); capped at a static list's length, since a
    write acknowledged by all R owners could never succeed with fewer daemons than R."""
    if given.replicas is None:
        return min(DEFAULT_REPLICAS, len(daemons)) if daemons else DEFAULT_REPLICAS
    if daemons and given.replicas > len(daemons):
        raise ConfigError(f"store.remote.replicas is {given.replicas} but only {len(daemons)} "
                          f"daemon(s) are listed")
    return given.replicas


def _durability(given: _Durability, remote: RemoteSpec | None) -> DurabilitySpec:
    if remote is None:
        raise ConfigError("durability needs store.remote: KV is durable on remote daemons")
    replicas = remote.replicas if given.replicas is None else given.replicas
    if replicas > remote.replicas:
        raise ConfigError(f"durability.replicas is {replicas} but store.remote keeps "
                          f"{remote.replicas} copies of each block")
    return DurabilitySpec(replicas, given.timeout_ms / 1000)


def _codec(name: str) -> Codec:
    try:
        return cast(Codec, config_codec_name(name))
    except CodecError as exc:
        raise ConfigError(str(exc)) from None


def _name(value: str, what: str) -> str:
    try:
        return validate_name(value, what)
    except InvalidKey as exc:
        raise ConfigError(str(exc)) from None
