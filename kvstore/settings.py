"""Settings users hand the product as a mapping (JSON or YAML), read one way: a msgspec Struct
per shape, unknown keys refused, and one `ConfigError` naming what is wrong.

The vLLM connector's `kv_connector_extra_config` (`connectors/vllm/config.py`) and the LMCache
plugin's `adapter_params` (`connectors/lmcache/config.py`) are parsed with `parse_settings`, as
is the daemon's `kvkeep store serve --config FILE` with its flags over it
(`kvstore/daemon/config.py`); router policy files (`router/policy_file.py`) decode their bytes
into Structs the same way, and a settings file is read by the same rule as theirs
(`read_settings_file`: `.json` is JSON, anything else YAML). A Struct says what a key may hold (a
JSON type, a range, a non-empty string, a `Size`); what needs two keys at once (exactly one of
`etcd` and `daemons`, say) is checked by the caller after parsing.

`RegistrySettings` is how every one of those spells where the daemons register (the etcd, its
TLS and credentials, the prefix) and which keys their registrations must verify with, so a key
means the same, and is checked the same, in the connector, the plugin and the daemon.
`RemoteClientSettings` adds a client's token file.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
import msgspec.json
import msgspec.yaml

from kvstore.errors import ConfigError
from kvstore.etcd import EtcdSpec
from kvstore.etcd.roles import DEFAULT_STORES_PREFIX

__all__ = ["DEFAULT_STORES_PREFIX", "RegistrySettings", "RemoteClientSettings", "Size", "Text",
           "parse_settings", "parse_size", "read_settings_file"]

S = TypeVar("S", bound=msgspec.Struct)

Text = Annotated[str, msgspec.Meta(min_length=1)]
"""A string that must not be empty (an empty path or URL is a typo, not a choice)."""

_SIZE_RE = re.compile(r"(?i)\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """`512MiB`, `4G`, `1.5GiB`, `1048576` -> bytes (binary units either way)."""
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        raise ConfigError(f"bad size {text!r}: use e.g. 512MiB, 4GiB or a byte count")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise ConfigError(f"size {text!r} must be positive")
    return value


class Size(int):
    """A positive byte count, given as an integer or as text with a binary unit (`512MiB`,
    `4GiB`: `parse_size`). A type of its own (not `int`) so that `parse_settings`' decode hook
    sees it: msgspec has no hook for a plain int, and sizes are what people write by hand."""


class RegistrySettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Where the daemons register and how their registrations are believed: the keys the
    daemon, the connector and the plugin spell, and check, one way."""

    etcd: Text | None = None
    """etcd URL(s), comma-separated; https means TLS."""
    prefix: str | None = None
    """The etcd prefix of the daemons' registrations; null or "": the default."""
    registration_public_key: Text | None = None
    """Ed25519 public key(s) (PEM) the daemons sign their registrations with (on a daemon:
    more keys than its own `registration_key`'s that peers may sign with, a rotation)."""
    etcd_ca: Text | None = None
    etcd_cert: Text | None = None
    etcd_key: Text | None = None
    etcd_user: Text | None = None
    etcd_password_file: Text | None = None

    @property
    def stores_prefix(self) -> str:
        return self.prefix or DEFAULT_STORES_PREFIX

    def etcd_spec(self) -> EtcdSpec | None:
        """`etcd` with its etcd_* keys as one checked spec; None without `etcd` (then an
        etcd_* key is an error: TLS or credentials given for nothing are a mistake, never
        silently unused)."""
        if self.etcd is None:
            given = [key for key in _ETCD_KEYS if getattr(self, key) is not None]
            if given:
                raise ConfigError(f"{', '.join(given)} given without etcd")
            return None
        return EtcdSpec(self.etcd, ca_file=_path(self.etcd_ca), cert_file=_path(self.etcd_cert),
                        key_file=_path(self.etcd_key), user=self.etcd_user,
                        password_file=_path(self.etcd_password_file))


_ETCD_KEYS = ("etcd_ca", "etcd_cert", "etcd_key", "etcd_user", "etcd_password_file")


class RemoteClientSettings(RegistrySettings, frozen=True):
    """The keys every client of the remote daemons spells the same way."""

    token_file: Text | None = None
    """A file whose first line is the daemons' bearer token (never the token itself: configs
    get logged)."""


def parse_settings(raw: Mapping[str, Any] | None, shape: type[S], where: str) -> S:
    """`raw` as a `shape`, or a ConfigError: every unknown key at once (with the keys known
    where it stood), else msgspec's message naming the bad key (`$.store.nvme.bytes`).

    Strict JSON types: "2" or 2.0 is not 2 and 1 is not true (`bool("false")` is True); a
    `Size` is a positive integer or `parse_size` text.
    """
    given = dict(raw or {})
    try:
        return msgspec.convert(given, type=shape, dec_hook=_decode)
    except msgspec.ValidationError as exc:
        unknown = _unknown_keys(given, shape, "$")
        if unknown:
            listed = "; ".join(f"{path}: unknown key(s) {keys}; known: {known}"
                               for path, keys, known in unknown)
            raise ConfigError(f"{where}: {listed}") from exc
        # YAML 1.1 (pyyaml) reads a bare off/on/yes/no as a boolean: `data_listen: off`.
        hint = (" (YAML reads a bare off, on, yes or no as a boolean: quote it)"
                if "Expected `str" in str(exc) and "got `bool`" in str(exc) else "")
        raise ConfigError(f"{where}: {exc}{hint}") from exc


def read_settings_file(path: str | Path) -> dict[str, Any]:
    """A settings file's mapping, for `parse_settings`: `.json` is JSON, anything else YAML (the
    rule router policy files follow). An empty file is an empty mapping."""
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read it: {exc}") from exc
    try:
        given = msgspec.json.decode(raw) if source.endswith(".json") else msgspec.yaml.decode(raw)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    if given is None:
        return {}
    if not isinstance(given, dict) or not all(isinstance(k, str) for k in given):
        raise ConfigError(f"{source}: must be a mapping of keys to values, not "
                          f"{type(given).__name__}")
    return given


def _decode(shape: type, value: object) -> object:
    """msgspec's hook for the types it does not know: `Size`."""
    if shape is Size:
        if isinstance(value, str):
            try:
                return Size(parse_size(value))
            except ConfigError as exc:  # msgspec names the key for a ValueError only
                raise ValueError(str(exc)) from exc
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return Size(value)
        raise ValueError(f"expected a positive byte count or a size like 512MiB, "
                         f"not {value!r}")
    raise NotImplementedError(shape)


def _unknown_keys(raw: object, shape: type[msgspec.Struct], path: str
                  ) -> list[tuple[str, list[str], list[str]]]:
    """(path, unknown keys, known keys) for `raw` and every nested settings mapping in it."""
    if not isinstance(raw, Mapping):
        return []
    fields = {f.encode_name: f for f in msgspec.structs.fields(shape)}
    found: list[tuple[str, list[str], list[str]]] = []
    unknown = sorted(str(k) for k in raw if k not in fields)
    if unknown:
        found.append((path, unknown, sorted(fields)))
    for key, value in raw.items():
        nested = _struct_in(fields[key].type) if key in fields else None
        if nested is not None:
            found += _unknown_keys(value, nested, f"{path}.{key}")
    return found


def _struct_in(annotation: Any) -> type[msgspec.Struct] | None:
    """The Struct a field holds (itself, or inside `X | None`), if any."""
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _struct_in(arg)
            if found is not None:
                return found
    return None


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value)
