"""What a daemon publishes about itself in etcd (`<prefix><node_id>` -> this, as JSON).

Whether a client believes it is kvstore/cluster/daemon_trust.py's question.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvstore.cluster.records import json_object, number, opt_text, text
from kvstore.errors import ConfigError, KVKeepError
from kvstore.keys import validate_name

__all__ = ["DaemonInfo"]


@dataclass(frozen=True, slots=True)
class DaemonInfo:
    """What a daemon publishes about itself."""

    node_id: str
    address: str
    """host:port that clients dial."""
    started_at: float = 0.0
    data_address: str = ""
    """host:port of the TCP data plane (kvstore/net/tcp_protocol.py); empty when there is none."""

    def __post_init__(self) -> None:
        validate_name(self.node_id, "node id")
        for address in (self.address, self.data_address) if self.data_address else (
                self.address,):
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError(f"daemon address {address!r} is not host:port")

    def encode(self) -> bytes:
        fields: dict[str, object] = {"node_id": self.node_id, "address": self.address,
                                     "started_at": self.started_at}
        if self.data_address:
            fields["data_address"] = self.data_address
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> DaemonInfo:
        """Parse a registration value; raises ConfigError when it is not one of ours, whatever
        `raw` holds (deep nesting, wrong field types, binary: kvstore/cluster/records.py)."""
        what = "daemon registration"
        try:
            obj = json_object(raw, what)
            return cls(text(obj, "node_id", what), text(obj, "address", what),
                       number(obj, "started_at", what, default=0.0),
                       opt_text(obj, "data_address", what) or "")
        except KVKeepError as exc:
            raise ConfigError(f"malformed daemon registration: {exc}") from exc
