"""The plugin's settings: LMCache's `adapter_params` dict, validated.

    {"type": "plugin", "module_path": "connectors.lmcache.adapter",
     "class_name": "KVKeepL2Adapter",
     "adapter_params": {
        "etcd": "http://etcd:2379",          # or "daemons": {"node-a": "10.0.0.5:7400", ...}
        "prefix": "/kvkeep/stores/",         # etcd prefix the daemons register under
        "tenant": "default",                 # the namespace every object is stored in
        "token_file": "/etc/kvkeep/token",   # first line: the bearer token for `tenant`
        "replicas": 2, "write_ack": "all",   # copies per object; wait for all or one
        "timeout_ms": 2000,                  # a load of one object, at most
        "lookup_timeout_ms": 500,            # a batched lookup
        "store_timeout_ms": 30000,           # a store task (the daemons hold acks while
                                             # their disk catches up: back-pressure)
        "load_threads": 1,                   # slices of one load task fetched in parallel
        "put_batch_mb": 64,                  # frames sent per put call at most
        "skip_present": true,                # look up before storing; send only new objects
        "model_revision": "v2",              # part of every scope (default: none): bump it
                                             # for new weights
        "max_capacity_gb": 0,                # LMCache's usage accounting (0: none)
        "tls": {"ca": "...", "cert": "...", "key": "...",  # optional mTLS to the daemons,
                "server_name": "kvkeep-store"},        # the name their certificates carry
        "registration_public_key": "...",    # Ed25519 key the daemons sign registrations with
        "etcd_ca": "...", "etcd_cert": "...", "etcd_key": "...",  # etcd over https (TLS)
        "etcd_user": "...", "etcd_password_file": "...",          # etcd user auth
        "data_plane": true}}                 # daemons' TCP bulk plane where offered

A token goes only to daemons that prove their identity (mTLS, or signed registrations; see
kvstore/cluster/daemon_trust.py): without `tls` or `registration_public_key` only daemons on
loopback are used.

Unknown keys are an error, not a shrug: a typo would otherwise silently run with a default.
So is a value of the wrong type (`"2"` or 2.0 for 2, 1 for true) or an empty string. `null`
is the same as leaving the key out for the string keys, `daemons` and `tls`, and an error for
the others; `prefix` null or "" is the default one. A bad key or value is a `ConfigError` naming
it (the keys: `_Params`'s fields), parsed as every settings mapping is (`kvstore.settings`).
The token is read from a file so that it never sits in the config, which LMCache logs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from kvstore.errors import ConfigError, InvalidKey
from kvstore.etcd import EtcdSpec
from kvstore.keys import validate_name
from kvstore.settings import DEFAULT_STORES_PREFIX, RemoteClientSettings, Text, parse_settings
from kvstore.tiers.factory import read_token_file

__all__ = ["PluginSettings", "TLSPaths", "read_token"]


class TLSPaths(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """`tls`: the CA, and a client certificate and key (both or neither), as files."""

    ca: str
    cert: str | None = None
    key: str | None = None
    server_name: Text | None = None


class _Params(RemoteClientSettings, frozen=True):
    """`adapter_params` as given, in LMCache's units; `None` where a key may be left out. The
    remote-client keys (etcd, its TLS and credentials, prefix, token_file,
    registration_public_key) are `kvstore.settings.RemoteClientSettings`'s, as the vLLM
    connector's `store.remote` spells them."""

    daemons: dict[str, str] | list[str] | None = None
    tenant: Text | None = None
    replicas: int = 2
    write_ack: Literal["one", "all"] = "all"
    timeout_ms: float = 2000.0
    lookup_timeout_ms: float = 500.0
    store_timeout_ms: float = 30000.0
    load_threads: int = 1
    put_batch_mb: float = 64.0
    skip_present: bool = True
    model_revision: Text | None = None
    max_capacity_gb: float = 0.0
    tls: TLSPaths | None = None
    data_plane: bool = True




@dataclass(frozen=True, slots=True)
class PluginSettings:
    """Where the daemons are, who we are to them, and how hard to try."""

    etcd: EtcdSpec | str | None = None
    """etcd URL(s), or an `EtcdSpec` with TLS and credentials (from the etcd_* keys)."""
    daemons: tuple[tuple[str, str], ...] = ()
    """(node id, host:port) pairs, when the daemons are listed instead of found in etcd."""
    prefix: str = DEFAULT_STORES_PREFIX
    tenant: str = "default"
    token_file: str | None = None
    replicas: int = 2
    write_ack: Literal["one", "all"] = "all"
    timeout_s: float = 2.0
    lookup_timeout_s: float = 0.5
    store_timeout_s: float = 30.0
    load_threads: int = 1
    put_batch_bytes: int = 64 << 20
    skip_present: bool = True
    model_revision: str = ""
    max_capacity_bytes: int = 0
    tls: TLSPaths | None = None
    data_plane: bool = True
    registration_public_key: str | None = None

    def __post_init__(self) -> None:
        if (self.etcd is None) == (not self.daemons):
            raise ConfigError("kvkeep LMCache plugin needs exactly one of 'etcd' and 'daemons'")
        _valid_name(self.tenant, "tenant")
        if self.replicas < 1 or self.load_threads < 1 or self.put_batch_bytes < 1:
            raise ConfigError("replicas, load_threads and put_batch_mb must be positive")
        if min(self.timeout_s, self.lookup_timeout_s, self.store_timeout_s) <= 0:
            raise ConfigError("timeout_ms, lookup_timeout_ms and store_timeout_ms must be "
                              "positive")
        if self.write_ack not in ("one", "all"):
            raise ConfigError(f"write_ack must be 'one' or 'all', not {self.write_ack!r}")
        if self.max_capacity_bytes < 0:
            raise ConfigError("max_capacity_gb must be >= 0")

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> PluginSettings:
        """Parse LMCache's `adapter_params`; raises ConfigError naming the bad key."""
        given = parse_settings(params, _Params, "kvkeep LMCache plugin adapter_params")
        tls = given.tls
        if tls is not None and (tls.cert is None) != (tls.key is None):
            raise ConfigError("tls: give both 'cert' and 'key', or neither")
        return cls(
            etcd=given.etcd_spec(),
            daemons=_daemons(given.daemons),
            prefix=given.stores_prefix,
            tenant=given.tenant or "default",
            token_file=given.token_file,
            replicas=given.replicas,
            write_ack=given.write_ack,
            timeout_s=given.timeout_ms / 1000,
            lookup_timeout_s=given.lookup_timeout_ms / 1000,
            store_timeout_s=given.store_timeout_ms / 1000,
            load_threads=given.load_threads,
            put_batch_bytes=int(given.put_batch_mb * (1 << 20)),
            skip_present=given.skip_present,
            model_revision=given.model_revision or "",
            max_capacity_bytes=int(given.max_capacity_gb * (1 << 30)),
            tls=tls,
            data_plane=given.data_plane,
            registration_public_key=given.registration_public_key,
        )


def read_token(path: str | None) -> str | None:
    """The first non-comment line of a token file; None without a file."""
    return None if path is None else read_token_file(path)


def _valid_name(value: str, what: str) -> None:
    try:
        validate_name(value, what)
    except InvalidKey as exc:
        raise ConfigError(str(exc)) from exc


def _daemons(value: dict[str, str] | list[str] | None) -> tuple[tuple[str, str], ...]:
    """A mapping node id -> host:port, or a list of host:port (node ids d0, d1, ...)."""
    if value is None:
        return ()
    pairs = (list(value.items()) if isinstance(value, dict)
             else [(f"d{i}", address) for i, address in enumerate(value)])
    if not pairs:
        raise ConfigError("daemons is empty")
    for node, address in pairs:
        _valid_name(node, "daemon node id")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"daemons: {address!r} is not host:port")
    return tuple(sorted(pairs))
