"""Prefetch hints: the router telling a worker's connector that a session just moved to it.

When a worker dies, the router replica that wins a session's rebinding knows, at that moment,
which worker will serve the session's next turn; that worker's connector otherwise learns it
only when the turn arrives, and then reads the session's blocks from the remote daemons while
the client waits. So the rebinding transaction (router/state/etcd.py `cas_binding`) also writes
a hint under the new worker's own prefix, on the same lease as the binding:

    {router prefix}/prefetch/{worker_id}/{session_id} -> PrefetchHint JSON

and the connector of that worker watches only its own prefix (connectors/vllm/prefetch.py)
and pulls the session's blocks into its host tier before the turn arrives. Writing the hint in
the binding's own transaction costs no round trip, and a hint exists exactly when the move won.

What a hint may do, since anyone who can write etcd chooses its bytes: make a connector read a
session manifest and its blocks, under the connector's own fingerprint and tenant, into its
host tier. Every block read is verified as any restore's is, the namespace comes from the
connector's tenant (a hint cannot reach another store tenant's blocks) and the work is bounded
per hint and in total by the connector. A forged hint can waste a bounded amount of bandwidth
and host-tier room; it cannot make anyone serve wrong KV or read a block it could not read
anyway. Hints are believed only with a lease (a routers' writes always have one) and under the
key their session names.

`salt` is the session's vLLM cache salt when the router sets it (its tenants' salts, with API
keys): the connector's namespace is (its tenant, the salt). etcd's roles give the router write
and the connectors read on `{prefix}/prefetch/` (kvstore/etcd/roles.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvstore.cluster.records import json_object, number, opt_text, text
from kvstore.errors import InvalidKey, UntrustedRegistration
from kvstore.keys import SessionId, validate_session_id

__all__ = ["PrefetchHint", "hints_prefix", "hint_key"]


def hints_prefix(router_prefix: str, worker_id: str) -> bytes:
    """The etcd prefix of the hints for `worker_id`."""
    return f"{router_prefix.rstrip('/')}/prefetch/{worker_id}/".encode()


def hint_key(router_prefix: str, worker_id: str, session_id: str) -> bytes:
    return hints_prefix(router_prefix, worker_id) + session_id.encode()


@dataclass(frozen=True, slots=True)
class PrefetchHint:
    """Session `session_id` (model `model`) was bound to this worker at `epoch`, wall time
    `created` (seconds); its blocks are under the namespace of `salt` (None: unsalted)."""

    session_id: SessionId
    model: str
    epoch: int
    created: float
    salt: str | None = None

    def to_json(self) -> bytes:
        return json.dumps({"s": self.session_id, "m": self.model, "e": self.epoch,
                           "t": self.created, "salt": self.salt},
                          separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, session_id: str) -> PrefetchHint:
        """Parse a stored hint; raises UntrustedRegistration whatever `raw` holds.
        `session_id`: the name its key gives; a hint naming another session is refused."""
        what = "prefetch hint"
        d = json_object(raw, what)
        sid = text(d, "s", what)
        if sid != session_id:
            raise UntrustedRegistration(
                "wrong-key", f"the hint under {session_id[:100]!r} names session {sid[:100]!r}")
        try:
            valid = validate_session_id(sid)
        except InvalidKey as exc:
            raise UntrustedRegistration("malformed", f"{what}: {exc}") from None
        epoch = number(d, "e", what)
        if epoch != int(epoch) or epoch < 0:
            raise UntrustedRegistration("malformed", f"{what}: epoch {epoch} is no count")
        return cls(valid, text(d, "m", what), int(epoch), number(d, "t", what),
                   opt_text(d, "salt", what))
