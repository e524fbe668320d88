"""Session bindings as stored in the state backend (etcd or in-process)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.keys import SessionId
from router.tenants import DEFAULT_TENANT
from router.workers import WorkerId

__all__ = ["Binding", "VersionedBinding"]


@dataclass(frozen=True, slots=True)
class Binding:
    """Where a session lives. `restore_from` is set when it moved (migration, failover) and
    cleared after the first request on the new worker succeeds: until then every request
    carries a restore hint, so a failed first attempt still restores on the next.
    `owner` is the tenant whose request created the session: only its requests may use it
    (a binding written before owners existed is the `default` tenant's)."""

    session_id: SessionId
    worker_id: WorkerId
    model: str
    epoch: int = 0
    restore_from: WorkerId | None = None
    reason: str = "new"
    updated: float = 0.0
    owner: str = DEFAULT_TENANT

    def to_json(self) -> bytes:
        return json.dumps(
            {"s": self.session_id, "w": self.worker_id, "m": self.model, "e": self.epoch,
             "r": self.restore_from, "why": self.reason, "t": self.updated, "o": self.owner},
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Binding:
        try:
            d = json.loads(raw)
            return cls(SessionId(str(d["s"])), WorkerId(str(d["w"])), str(d["m"]), int(d["e"]),
                       None if d.get("r") is None else WorkerId(str(d["r"])),
                       str(d.get("why", "")), float(d.get("t", 0.0)),
                       str(d.get("o", DEFAULT_TENANT)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"malformed session binding {raw[:200]!r}") from exc


@dataclass(frozen=True, slots=True)
class VersionedBinding:
    """A binding with the backend revision a compare-and-swap must match."""

    binding: Binding
    revision: int

    @property
    def worker_id(self) -> WorkerId:
        return self.binding.worker_id
