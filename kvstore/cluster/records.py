"""Total decoding of what etcd holds: one record's value can never raise anything but
`UntrustedRegistration` (counted and skipped by the watcher), whatever bytes it holds.

Anyone who can write etcd chooses these bytes. `json.loads` raises `RecursionError` (not a
`ValueError`) at about 2,000 levels of nesting, and a field of the wrong type makes the code
that reads it raise `AttributeError` or `TypeError` far from the parser, so: `json_object`
catches every failure of the parse itself, and the typed getters check every field's type where
it is read (a bool is not a number, a number is not a string).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.errors import UntrustedRegistration

__all__ = ["MAX_RECORD_BYTES", "EtcdRecord", "json_object", "text", "opt_text", "flag",
           "opt_number", "number", "texts", "malformed"]

MAX_RECORD_BYTES = 64 << 10
"""Larger values are not parsed: no registration or binding of ours comes near this."""


@dataclass(frozen=True, slots=True)
class EtcdRecord:
    """One key-value as etcd returned it, with the name the key gives (the key minus the
    watched prefix): the one identity a record may claim."""

    key: bytes
    name: str
    value: bytes
    lease: int
    mod_revision: int
    create_revision: int

    @classmethod
    def of(cls, prefix: bytes, kv: Any) -> EtcdRecord:
        key = bytes(kv.key)
        return cls(key, key[len(prefix):].decode(errors="replace"), bytes(kv.value or b""),
                   int(kv.lease or 0), int(kv.mod_revision or 0),
                   int(getattr(kv, "create_revision", 0) or 0))


def malformed(detail: str) -> UntrustedRegistration:
    return UntrustedRegistration("malformed", detail)


def json_object(raw: bytes, what: str) -> Mapping[str, Any]:
    """`raw` as a JSON object, or UntrustedRegistration("malformed")."""
    if len(raw) > MAX_RECORD_BYTES:
        raise malformed(f"{what}: {len(raw)} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError, MemoryError) as exc:  # RecursionError: deep nesting
        raise malformed(f"{what}: not JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise malformed(f"{what}: a JSON {type(data).__name__}, not an object")
    return data


def text(data: Mapping[str, Any], name: str, what: str, *, default: str | None = None) -> str:
    value = data.get(name, default)
    if not isinstance(value, str):
        raise malformed(f"{what}: field {name!r} is not a string")
    return value


def opt_text(data: Mapping[str, Any], name: str, what: str) -> str | None:
    value = data.get(name)
    if value is not None and not isinstance(value, str):
        raise malformed(f"{what}: field {name!r} is not a string or null")
    return value


def flag(data: Mapping[str, Any], name: str, what: str, *, default: bool = False) -> bool:
    value = data.get(name, default)
    if not isinstance(value, bool):
        raise malformed(f"{what}: field {name!r} is not a boolean")
    return value


def opt_number(data: Mapping[str, Any], name: str, what: str) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value):
        raise malformed(f"{what}: field {name!r} is not a finite number or null")
    return float(value)


def number(data: Mapping[str, Any], name: str, what: str, *, default: float | None = None
           ) -> float:
    value = opt_number(data, name, what) if name in data else default
    if value is None:
        raise malformed(f"{what}: field {name!r} is missing or null")
    return value


def texts(data: Mapping[str, Any], name: str, what: str, *, limit: int = 256
          ) -> tuple[str, ...]:
    value = data.get(name, ())
    if not isinstance(value, list | tuple) or len(value) > limit or not all(
            isinstance(v, str) for v in value):
        raise malformed(f"{what}: field {name!r} is not a list of at most {limit} strings")
    return tuple(value)
