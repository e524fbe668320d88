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
        "model_revision": "",                # part of every scope: bump it for new weights
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
The token is read from a file so that it never sits in the config, which LMCache logs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from kvstore.errors import ConfigError, InvalidKey
from kvstore.etcd import EtcdSpec
from kvstore.keys import validate_name
from kvstore.tiers.factory import read_token_file

__all__ = ["PluginSettings", "TLSPaths", "read_token"]

_KEYS: Final = frozenset({
    "etcd", "prefix", "daemons", "tenant", "token_file", "replicas", "write_ack",
    "timeout_ms", "lookup_timeout_ms", "store_timeout_ms", "load_threads", "put_batch_mb",
    "skip_present", "model_revision", "max_capacity_gb", "tls", "data_plane",
    "registration_public_key", "etcd_ca", "etcd_cert", "etcd_key", "etcd_user",
    "etcd_password_file",
})
_TLS_KEYS: Final = frozenset({"ca", "cert", "key", "server_name"})
DEFAULT_PREFIX: Final = "/kvkeep/stores/"


@dataclass(frozen=True, slots=True)
class TLSPaths:
    ca: str
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None


@dataclass(frozen=True, slots=True)
class PluginSettings:
    """Where the daemons are, who we are to them, and how hard to try."""

    etcd: EtcdSpec | str | None = None
    """etcd URL(s), or an `EtcdSpec` with TLS and credentials (from the etcd_* keys)."""
    daemons: tuple[tuple[str, str], ...] = ()
    """(node id, host:port) pairs, when the daemons are listed instead of found in etcd."""
    prefix: str = DEFAULT_PREFIX
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
        params = dict(params or {})
        unknown = sorted(set(params) - _KEYS)
        if unknown:
            raise ConfigError(f"unknown kvkeep LMCache plugin keys {unknown}; "
                              f"known: {sorted(_KEYS)}")
        etcd = _optional_str(params, "etcd")
        security = {key: _optional_str(params, f"etcd_{key}")
                    for key in ("ca", "cert", "key", "user", "password_file")}
        return cls(
            etcd=None if etcd is None else EtcdSpec(
                etcd, ca_file=_path(security["ca"]), cert_file=_path(security["cert"]),
                key_file=_path(security["key"]), user=security["user"],
                password_file=_path(security["password_file"])),
            daemons=_daemons(params.get("daemons")),
            prefix=_optional_str(params, "prefix") or DEFAULT_PREFIX,
            tenant=_optional_str(params, "tenant") or "default",
            token_file=_optional_str(params, "token_file"),
            replicas=_int(params, "replicas", 2),
            write_ack=_write_ack(params.get("write_ack", "all")),
            timeout_s=_number(params, "timeout_ms", 2000.0) / 1000,
            lookup_timeout_s=_number(params, "lookup_timeout_ms", 500.0) / 1000,
            store_timeout_s=_number(params, "store_timeout_ms", 30000.0) / 1000,
            load_threads=_int(params, "load_threads", 1),
            put_batch_bytes=int(_number(params, "put_batch_mb", 64.0) * (1 << 20)),
            skip_present=_bool(params, "skip_present", True),
            model_revision=_optional_str(params, "model_revision") or "",
            max_capacity_bytes=int(_number(params, "max_capacity_gb", 0.0) * (1 << 30)),
            tls=_tls(params.get("tls")),
            data_plane=_bool(params, "data_plane", True),
            registration_public_key=_optional_str(params, "registration_public_key"),
        )


def read_token(path: str | None) -> str | None:
    """The first non-comment line of a token file; None without a file."""
    return None if path is None else read_token_file(path)


def _valid_name(value: str, what: str) -> None:
    try:
        validate_name(value, what)
    except InvalidKey as exc:
        raise ConfigError(str(exc)) from exc


def _optional_str(params: Mapping[str, Any], key: str) -> str | None:
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} must be a non-empty string")
    return value


def _int(params: Mapping[str, Any], key: str, default: int) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, not {value!r}")
    return value


def _number(params: Mapping[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key} must be a number, not {value!r}")
    return float(value)


def _bool(params: Mapping[str, Any], key: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, not {value!r}")
    return value


def _write_ack(value: object) -> Literal["one", "all"]:
    if value == "one":
        return "one"
    if value == "all":
        return "all"
    raise ConfigError(f"write_ack must be 'one' or 'all', not {value!r}")


def _daemons(value: object) -> tuple[tuple[str, str], ...]:
    """A mapping node id -> host:port, or a list of host:port (node ids d0, d1, ...)."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, list | tuple):
        pairs = [(f"d{i}", address) for i, address in enumerate(value)]
    else:
        raise ConfigError("daemons must map node ids to host:port, or list host:port")
    out: list[tuple[str, str]] = []
    for node, address in pairs:
        if not isinstance(node, str) or not isinstance(address, str):
            raise ConfigError("daemons: node ids and addresses must be strings")
        _valid_name(node, "daemon node id")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"daemons: {address!r} is not host:port")
        out.append((node, address))
    if not out:
        raise ConfigError("daemons is empty")
    return tuple(sorted(out))


def _tls(value: object) -> TLSPaths | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("ca"), str):
        raise ConfigError("tls must be an object with at least 'ca'")
    unknown = sorted(set(value) - _TLS_KEYS)
    if unknown:
        raise ConfigError(f"unknown tls keys {unknown}")
    cert, key = value.get("cert"), value.get("key")
    if (cert is None) != (key is None):
        raise ConfigError("tls: give both 'cert' and 'key', or neither")
    server_name = value.get("server_name")
    if server_name is not None and (not isinstance(server_name, str) or not server_name):
        raise ConfigError("tls.server_name must be a non-empty string")
    return TLSPaths(value["ca"], cert, key, server_name)


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value)
