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
     "load_mode": "sync", "tenant": "default",
     "durability": {"replicas": 2, "timeout_ms": 5000},
     "model_id": "llama-3-8b", "weights_revision": "abc123",
     "mac_key_file": "/etc/kvkeep/tenant-default.mac", "restore_path": "auto"}

`mac_key_file`: the tenant's MAC key (kvstore/mac.py), held by its engines and never by the
daemons: every frame saved is signed with it, and a frame restored must carry a valid MAC
under it (else it is recomputed, and deleted), so neither a holder of the tenant's daemon
token nor a daemon or disk can inject KV. Without it frames are unsigned and any that verify
are used.

`durability`: see DurabilitySpec and the connector README ("Durability"); absent, blocks reach
the daemons by write-behind.

Unknown keys are an error, not a shrug: a typo in `checkpoint_tokens` would otherwise silently
leave a session unprotected.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, cast

from kvstore.codecs import CODEC_NAMES, config_codec_name
from kvstore.errors import CodecError, ConfigError, InvalidKey
from kvstore.etcd import EtcdSpec
from kvstore.keys import validate_name
from kvstore.mac import MacKey
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
LoadMode = Literal["sync", "async"]
LookupMode = Literal["auto", "worker"]
RestorePath = Literal["auto", "device_decode", "staged"]
SavePath = Literal["auto", "staged"]
RestorePolicy = Literal["cost", "always"]
Compression = Literal["none", "auto", "zstd"]

DEFAULT_REPLICAS: Final = 2
"""Copies of each block on the remote daemons unless `store.remote.replicas` says otherwise."""

_TOP_KEYS: Final = frozenset({
    "store", "codec", "compression", "checkpoint_tokens", "restore_deadline_ms",
    "hinted_restore_deadline_ms", "save_timeout_ms", "load_mode", "tenant", "model_id",
    "weights_revision", "max_inflight_saves", "lookup", "restore_first_layers", "mac_key_file",
    "durability",
    "restore_path", "save_path", "restore_policy", "prefill_tokens_per_s",
})
_STORE_KEYS: Final = frozenset({"host_bytes", "host_pinned", "nvme", "remote", "redis", "name"})
_NVME_KEYS: Final = frozenset({"path", "bytes", "durable"})
# etcd_*: TLS and auth towards etcd (kvstore/etcd/spec.py), as `kvkeep store serve --etcd-*`.
_ETCD_KEYS: Final = ("etcd_ca", "etcd_cert", "etcd_key", "etcd_user", "etcd_password_file")
# tls_*, registration_public_key: what proves a registered daemon is one (a token goes only
# to those): mTLS against the cluster CA, and/or registrations signed with the cluster key.
_IDENTITY_KEYS: Final = ("tls_ca", "tls_cert", "tls_key", "tls_server_name",
                         "registration_public_key")
_REMOTE_KEYS: Final = frozenset({"etcd", "prefix", "replicas", "daemons", "timeout_ms",
                                 "token_file", *_ETCD_KEYS, *_IDENTITY_KEYS})
_REDIS_KEYS: Final = frozenset({"url", "nodes", "prefix", "ttl_seconds", "timeout_ms"})


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


# -- durability (issue 13 item 10): one block, `"durability": {"replicas": R, "timeout_ms": T}`

_DURABILITY_KEYS: Final = frozenset({"replicas", "timeout_ms"})
DEFAULT_DURABILITY_TIMEOUT_MS: Final = 5000


@dataclass(frozen=True, slots=True)
class DurabilitySpec:
    """Make KV durable on `replicas` remote daemons before the tokens computed with it reach the
    client: every engine step that completes full blocks returns only once each is held by
    `replicas` distinct daemons, or `timeout_s` after the step (then counted, logged, and the
    blocks go on behind as without the setting). See the connector README, "Durability"."""

    replicas: int
    timeout_s: float


def _durability(raw: object, remote: RemoteSpec | None) -> DurabilitySpec:
    if not isinstance(raw, Mapping):
        raise ConfigError('durability must be an object, e.g. {"replicas": 2, "timeout_ms": 5000}')
    _reject_unknown("durability", raw, _DURABILITY_KEYS)
    if remote is None:
        raise ConfigError("durability needs store.remote: KV is durable on remote daemons")
    replicas = _positive_int(raw.get("replicas", remote.replicas), "durability.replicas")
    if replicas > remote.replicas:
        raise ConfigError(f"durability.replicas is {replicas} but store.remote keeps "
                          f"{remote.replicas} copies of each block")
    return DurabilitySpec(replicas, _positive_ms(raw, "timeout_ms", DEFAULT_DURABILITY_TIMEOUT_MS))


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
    load_mode: LoadMode = "sync"
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
    """"auto": one frame encoded per block on the saver's thread. "staged": the staging
    pipeline (batches quantized on the device, one copy per batch, hashed on a pool); needs
    `compression: "none"`."""
    restore_policy: RestorePolicy = "cost"
    """"cost": restore only the stored prefix that loads faster than it computes
    (`connectors.vllm.restore_cost`); "always": every hit, whatever it costs."""
    prefill_tokens_per_s: float | None = None
    """The engine's prefill rate for the cost decision; None: learned from its own steps."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Parse `kv_connector_extra_config`; raises ConfigError on anything malformed."""
        extra = dict(extra or {})
        _reject_unknown("kv_connector_extra_config", extra, _TOP_KEYS)
        if "store" not in extra:
            raise ConfigError("kv_connector_extra_config needs a 'store'")
        codec = _codec(_choice(extra, "codec", CODEC_NAMES, "raw"))
        compression = _choice(extra, "compression", ("none", "auto", "zstd"), "none")
        load_mode = _choice(extra, "load_mode", ("sync", "async"), "sync")
        checkpoint = extra.get("checkpoint_tokens")
        if checkpoint is not None:
            checkpoint = _positive_int(checkpoint, "checkpoint_tokens")
        tenant = _name(extra.get("tenant", "default"), "tenant")
        model_id = extra.get("model_id")
        revision = extra.get("weights_revision")
        deadline = _positive_ms(extra, "restore_deadline_ms", 2000)
        hinted = _positive_ms(extra, "hinted_restore_deadline_ms", max(5000, deadline * 1000))
        if hinted < deadline:
            raise ConfigError("hinted_restore_deadline_ms must not be below restore_deadline_ms "
                              "(a restore known to be in the store waits at least as long)")
        store = _store(extra["store"])
        durability = (None if extra.get("durability") is None
                      else _durability(extra["durability"], store.remote))
        return cls(
            store=store,
            durability=durability,
            codec=cast(Codec, codec),
            compression=cast(Compression, compression),
            checkpoint_tokens=checkpoint,
            restore_deadline_s=deadline,
            hinted_restore_deadline_s=hinted,
            save_timeout_s=_non_negative_ms(extra, "save_timeout_ms", 0),
            load_mode=cast(LoadMode, load_mode),
            tenant=tenant,
            model_id=None if model_id is None else _nonempty_str(model_id, "model_id"),
            weights_revision=None if revision is None else _nonempty_str(revision,
                                                                           "weights_revision"),
            max_inflight_saves=_positive_int(extra.get("max_inflight_saves", 256),
                                             "max_inflight_saves"),
            lookup=cast(LookupMode, _choice(extra, "lookup", ("auto", "worker"), "auto")),
            restore_first_layers=_nonnegative_int(extra.get("restore_first_layers", 0),
                                                  "restore_first_layers"),
            mac_key=(MacKey.from_file(_nonempty_str(extra["mac_key_file"], "mac_key_file"))
                     if extra.get("mac_key_file") is not None else None),
            restore_path=cast(RestorePath, _choice(extra, "restore_path",
                                                   ("auto", "device_decode", "staged"), "auto")),
            save_path=_save_path(extra, compression),
            restore_policy=cast(RestorePolicy, _choice(extra, "restore_policy",
                                                       ("cost", "always"), "cost")),
            prefill_tokens_per_s=_optional_rate(extra, "prefill_tokens_per_s"),
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


def _store(raw: object) -> StoreSpec:
    if not isinstance(raw, Mapping):
        raise ConfigError("store must be an object")
    store = dict(raw)
    _reject_unknown("store", store, _STORE_KEYS)
    host = int(store.get("host_bytes", 0) or 0)
    if host < 0:
        raise ConfigError("store.host_bytes must not be negative")
    nvme = None
    if store.get("nvme") is not None:
        spec = store["nvme"]
        if not isinstance(spec, Mapping):
            raise ConfigError("store.nvme must be an object")
        _reject_unknown("store.nvme", spec, _NVME_KEYS)
        if "path" not in spec:
            raise ConfigError("store.nvme needs a 'path'")
        nvme = NvmeSpec(_nonempty_str(spec["path"], "store.nvme.path"),
                        _positive_int(spec.get("bytes", 64 << 30), "store.nvme.bytes"),
                        _flag(spec.get("durable", True), "store.nvme.durable"))
    remote = None
    if store.get("remote") is not None:
        spec = store["remote"]
        if not isinstance(spec, Mapping):
            raise ConfigError("store.remote must be an object")
        _reject_unknown("store.remote", spec, _REMOTE_KEYS)
        listed = spec.get("daemons") or {}
        if not isinstance(listed, Mapping):
            raise ConfigError("store.remote.daemons must map node ids to host:port")
        daemons = tuple(sorted((_nonempty_str(node, "store.remote.daemons key"),
                                _nonempty_str(addr, "store.remote.daemons value"))
                               for node, addr in listed.items()))
        etcd = spec.get("etcd")
        if (etcd is None) == (not daemons):
            raise ConfigError("store.remote needs exactly one of 'etcd' and 'daemons'")
        remote = RemoteSpec(
            etcd=None if etcd is None else _etcd(spec),
            prefix=_nonempty_str(spec.get("prefix") or "/kvkeep/stores/",
                                 "store.remote.prefix"),
            replicas=_replicas(spec, daemons),
            daemons=daemons,
            timeout_s=_positive_ms(spec, "timeout_ms", 1000),
            token_file=(None if spec.get("token_file") is None
                        else _nonempty_str(spec["token_file"], "store.remote.token_file")),
            tls_ca=_optional_str(spec, "tls_ca"), tls_cert=_optional_str(spec, "tls_cert"),
            tls_key=_optional_str(spec, "tls_key"),
            tls_server_name=_optional_str(spec, "tls_server_name"),
            registration_public_key=_optional_str(spec, "registration_public_key"),
        )
    redis = None if store.get("redis") is None else _redis(store["redis"])
    name = _name(store.get("name", "default"), "store.name")
    return StoreSpec(host_bytes=host, nvme=nvme, remote=remote, name=name, redis=redis,
                     host_pinned=_flag(store.get("host_pinned", False), "store.host_pinned"))


def _etcd(remote: Mapping[str, Any]) -> EtcdSpec:
    """store.remote.etcd with its etcd_* keys: one checked spec (https means TLS)."""
    files = {key: None if remote.get(key) is None
             else _nonempty_str(remote[key], f"store.remote.{key}")
             for key in _ETCD_KEYS}

    def path(key: str) -> Path | None:
        value = files[key]
        return None if value is None else Path(value)

    return EtcdSpec(_nonempty_str(remote["etcd"], "store.remote.etcd"),
                    ca_file=path("etcd_ca"), cert_file=path("etcd_cert"),
                    key_file=path("etcd_key"), user=files["etcd_user"],
                    password_file=path("etcd_password_file"))


def _optional_str(remote: Mapping[str, Any], key: str) -> str | None:
    value = remote.get(key)
    return None if value is None else _nonempty_str(value, f"store.remote.{key}")


def _redis(raw: object) -> RedisSpec:
    if not isinstance(raw, Mapping):
        raise ConfigError("store.redis must be an object")
    _reject_unknown("store.redis", raw, _REDIS_KEYS)
    if ("url" in raw) == ("nodes" in raw):
        raise ConfigError("store.redis needs a 'url' (one server) or 'nodes' (a Redis "
                          "Cluster's seed host:port list), not both")
    nodes = raw.get("nodes", ())
    if not isinstance(nodes, list | tuple) or ("nodes" in raw and not nodes):
        raise ConfigError("store.redis.nodes must be a non-empty list of host:port")
    ttl = raw.get("ttl_seconds")
    return RedisSpec(url=_nonempty_str(raw["url"], "store.redis.url") if "url" in raw else "",
                     nodes=tuple(_nonempty_str(n, "store.redis.nodes[]") for n in nodes),
                     prefix=_nonempty_str(raw.get("prefix", "kvkeep"), "store.redis.prefix"),
                     ttl_s=None if ttl is None else _positive_int(ttl, "store.redis.ttl_seconds"),
                     timeout_s=_positive_ms(raw, "timeout_ms", 5000))


def _replicas(spec: Mapping[str, Any], daemons: tuple[tuple[str, str], ...]) -> int:
    """R: 2 by default (one lost daemon loses no KV); capped at a static list's length, since a
    write acknowledged by all R owners could never succeed with fewer daemons than R."""
    if "replicas" not in spec:
        return min(DEFAULT_REPLICAS, len(daemons)) if daemons else DEFAULT_REPLICAS
    replicas = _positive_int(spec["replicas"], "store.remote.replicas")
    if daemons and replicas > len(daemons):
        raise ConfigError(f"store.remote.replicas is {replicas} but only {len(daemons)} "
                          f"daemon(s) are listed")
    return replicas


def _save_path(extra: Mapping[str, Any], compression: str) -> SavePath:
    path = _choice(extra, "save_path", ("auto", "staged"), "auto")
    if path == "staged" and compression != "none":
        raise ConfigError("save_path 'staged' writes frames in place, uncompressed: it needs "
                          f"compression 'none', not {compression!r}")
    if path == "staged" and extra.get("mac_key_file") is not None:
        raise ConfigError("save_path 'staged' seals unsigned frames: it cannot be combined with "
                          "mac_key_file")
    if path == "staged" and extra.get("durability") is not None:
        # Durable saves wait for R acknowledgements per block on the saver's own path.
        raise ConfigError("save_path 'staged' cannot be combined with durability")
    return cast(SavePath, path)


def _codec(name: str) -> str:
    try:
        return config_codec_name(name)
    except CodecError as exc:
        raise ConfigError(str(exc)) from None


def _reject_unknown(where: str, mapping: Mapping[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _choice(extra: Mapping[str, Any], key: str, allowed: tuple[str, ...], default: str) -> str:
    value = extra.get(key, default)
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {list(allowed)}, got {value!r}")
    return str(value)


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}") from None
    if number <= 0 or (isinstance(value, float) and value != number):
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return number


def _nonnegative_int(value: object, what: str) -> int:
    return 0 if value == 0 and not isinstance(value, bool) else _positive_int(value, what)


def _positive_ms(mapping: Mapping[str, Any], key: str, default_ms: float) -> float:
    value = mapping.get(key, default_ms)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key} must be a positive number of milliseconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key} must be a positive number of milliseconds, got {value!r}")
    return float(value) / 1000.0


def _non_negative_ms(mapping: Mapping[str, Any], key: str, default_ms: float) -> float:
    value = mapping.get(key, default_ms)
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{key} must be a number of milliseconds >= 0, got {value!r}")
    return float(value) / 1000.0


def _optional_rate(mapping: Mapping[str, Any], key: str) -> float | None:
    value = mapping.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key} must be a positive number (tokens per second), got {value!r}")
    return float(value)


def _name(value: object, what: str) -> str:
    try:
        return validate_name(str(value), what)
    except InvalidKey as exc:
        raise ConfigError(str(exc)) from None


def _flag(value: object, what: str) -> bool:
    """A JSON boolean; anything else is refused (bool("false") is True)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{what} must be true or false, not {value!r}")
    return value


def _nonempty_str(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what} must be a non-empty string")
    return value
