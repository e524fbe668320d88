"""Settings users hand the product as a mapping (JSON or YAML), read one way: a msgspec Struct
per shape, unknown keys refused, and one `ConfigError` naming what is wrong.

The vLLM connector's `kv_connector_extra_config` (`connectors/vllm/config.py`) and the LMCache
plugin's `adapter_params` (`connectors/lmcache/config.py`) are parsed with `parse_settings`;
router policy files (`router/policy_file.py`) decode their bytes into Structs the same way. A
Struct says what a key may hold (a JSON type, a range, a non-empty string); what needs two
keys at once (exactly one of `etcd` and `daemons`, say) is checked by the caller after parsing.

`RemoteClientSettings` is how every one of those spells a remote-store client's settings (the
etcd the daemons register in, its TLS and credentials, the daemons' token and registration key),
so a key means the same in the connector and in the plugin.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec

from kvstore.errors import ConfigError
from kvstore.etcd import EtcdSpec
from kvstore.etcd.roles import DEFAULT_STORES_PREFIX

__all__ = ["DEFAULT_STORES_PREFIX", "RemoteClientSettings", "Text", "parse_settings"]

S = TypeVar("S", bound=msgspec.Struct)

Text = Annotated[str, msgspec.Meta(min_length=1)]
"""A string that must not be empty (an empty path or URL is a typo, not a choice)."""



class RemoteClientSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The keys every client of the remote daemons spells the same way."""

    etcd: Text | None = None
    """etcd URL(s), comma-separated; https means TLS."""
    prefix: str | None = None
    """The etcd prefix of the daemons' registrations; null or "": the default."""
    token_file: Text | None = None
    """A file whose first line is the daemons' bearer token (never the token itself: configs
    get logged)."""
    registration_public_key: Text | None = None
    """Ed25519 public key(s) (PEM) the daemons sign their registrations with."""
    etcd_ca: Text | None = None
    etcd_cert: Text | None = None
    etcd_key: Text | None = None
    etcd_user: Text | None = None
    etcd_password_file: Text | None = None

    @property
    def stores_prefix(self) -> str:
        return self.prefix or DEFAULT_STORES_PREFIX

    def etcd_spec(self) -> EtcdSpec | None:
        """`etcd` with its etcd_* keys as one checked spec; None without `etcd`."""
        if self.etcd is None:
            return None
        return EtcdSpec(self.etcd, ca_file=_path(self.etcd_ca), cert_file=_path(self.etcd_cert),
                        key_file=_path(self.etcd_key), user=self.etcd_user,
                        password_file=_path(self.etcd_password_file))


def parse_settings(raw: Mapping[str, Any] | None, shape: type[S], where: str) -> S:
    """`raw` as a `shape`, or a ConfigError: every unknown key at once (with the keys known
    where it stood), else msgspec's message naming the bad key (`$.store.nvme.bytes`).

    Strict JSON types: "2" or 2.0 is not 2 and 1 is not true (`bool("false")` is True).
    """
    given = dict(raw or {})
    try:
        return msgspec.convert(given, type=shape)
    except msgspec.ValidationError as exc:
        unknown = _unknown_keys(given, shape, "$")
        if unknown:
            listed = "; ".join(f"{path}: unknown key(s) {keys}; known: {known}"
                               for path, keys, known in unknown)
            raise ConfigError(f"{where}: {listed}") from exc
        raise ConfigError(f"{where}: {exc}") from exc


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
