"""Session bindings as stored in the state backend (etcd or in-process)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvstore.cluster.records import json_object, number, opt_text, text
from kvstore.errors import ConfigError, UntrustedRegistration
from kvstore.keys import SessionId
from router.membership.workers import WorkerId
from router.tenants import DEFAULT_TENANT

__all__ = ["Binding", "MalformedBinding", "VersionedBinding"]


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
    def from_json(cls, raw: bytes, session_id: str | None = None) -> Binding:
        """Parse a stored binding; raises ConfigError whatever `raw` holds (deep nesting,
        wrong field types, binary). `session_id`: the id the etcd key names; a value naming
        another session is refused (it would overwrite that session's binding in every
        replica's table)."""
        what = "session binding"
        try:
            d = json_object(raw, what)
            sid = text(d, "s", what)
            if session_id is not None and sid != session_id:
                raise UntrustedRegistration(
                    "wrong-key", f"the binding under {session_id!r} names session {sid!r}")
            epoch = number(d, "e", what)
            if epoch != int(epoch):
                raise UntrustedRegistration("malformed", f"{what}: epoch {epoch} is no integer")
            restore = opt_text(d, "r", what)
            return cls(SessionId(sid), WorkerId(text(d, "w", what)), text(d, "m", what),
                       int(epoch), None if restore is None else WorkerId(restore),
                       text(d, "why", what, default=""), number(d, "t", what, default=0.0),
                       text(d, "o", what, default=DEFAULT_TENANT))
        except UntrustedRegistration as exc:
            raise MalformedBinding(exc.reason, f"{what} {raw[:100]!r}: {exc}") from None
        except Exception as exc:  # anything else a value can make a parser raise
            raise MalformedBinding("malformed", f"{what} {raw[:100]!r}: {exc}") from None


class MalformedBinding(ConfigError):
    """A stored binding that is not one (`reason`: the word it is counted under)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class VersionedBinding:
    """A binding with the backend revision a compare-and-swap must match."""

    binding: Binding
    revision: int

    @property
    def worker_id(self) -> WorkerId:
        return self.binding.worker_id
