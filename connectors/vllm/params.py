"""The per-request contract with the router: `kv_transfer_params` in, and what goes back out.

In (from `SamplingParams.extra_args["kv_transfer_params"]` or the HTTP body field)::

    {"session_id": "chat-42",          # optional: checkpoint this conversation's manifest
     "restore": "auto"                 # default: restore whatever prefix the store holds
              | "none"                 # never load (the request is computed; saving goes on)
              | {"layers": [a, b]},    # restrict restore to layers [a, b) (see below)
     # set by the router (router/README.md, "To the worker"):
     "session_epoch": 3,               # the session's binding epoch: fences manifest writes
     "restore_reason": "migrated" | "failover" | "resumed",
     "previous_worker": "w2"}          # where the session's KV was computed

Out (`RequestOutput.kv_transfer_params`, only for requests with a session or a restore)::

    {"session_id": "chat-42", "checkpointed_tokens": 256, "manifest_generation": 17...,
     "restored_tokens": 224}

What the router's fields do:

- `restore_reason` says the session's KV was computed on another worker and checkpointed, so
  it is known to be in the store: the request's lookup and load get `hinted_restore_deadline_ms`
  instead of `restore_deadline_ms` (waiting longer for KV that is there beats recomputing it),
  `restores_hinted` counts such requests and `hinted_blocks_missing` what their lookups did not
  find (checkpoints that had not landed: the prefix is recomputed).
- `previous_worker` is named in the log line of a hinted restore that finds less than it
  asked for, for the operator (no decision depends on it: blocks are found by key).
- `session_epoch` orders the session's manifest writes (`connectors.vllm.manifests`): a worker
  whose request is older or carries an older epoch than the current holder's never overwrites
  its manifest.

Which fields a client may set is the router's decision (`router/front/kv_params.py`: a client
may set only `restore`; the router sets `session_id` from the session header or body field and owns
the three above); here every field is type- and range-checked, unknown
fields are ignored (they may be meant for another component), and anything malformed makes the
whole `kv_transfer_params` ignored and counted (`bad_params`): the request is then served as if
it had none, which is always safe.

What a layer hint can reuse, precisely. vLLM computes a block for *all* layers at once: its
scheduler counts a block as computed or not, and recomputing a block means running every layer
over its tokens, which needs the hidden states between layers that no KV store keeps. So KV for
a strict subset of a block's layers cannot spare any compute: a block is reused only if every
layer is restored. Hence:

- `{"layers": [0, L]}` (all L layers) behaves like `"auto"`; the loader reads exactly the
  segments of the layers the worker hosts (range reads of the frames);
- any strict subset reuses nothing: the request is computed in full, nothing is fetched, and the
  `partial_layer_unusable` counter says so. Loading the subset anyway would cost I/O and save
  no compute, and claiming the blocks would hand vLLM incomplete KV, which is never allowed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from kvstore.errors import InvalidKey
from kvstore.keys import Namespace, SessionId, validate_name, validate_session_id

__all__ = ["RestoreParams", "RestoreMode", "RestoreReason", "RESTORE_REASONS", "MAX_EPOCH",
           "parse_params", "namespace_for"]

RestoreMode = Literal["auto", "none"]
RestoreReason = Literal["migrated", "failover", "resumed"]
RESTORE_REASONS: Final = ("migrated", "failover", "resumed")

MAX_EPOCH: Final = (1 << 31) - 1
"""Largest `session_epoch` accepted (the router counts rebinds of one session from 0)."""

_MAX_WORKER_CHARS: Final = 256


@dataclass(frozen=True, slots=True)
class RestoreParams:
    session_id: SessionId | None = None
    mode: RestoreMode = "auto"
    layers: tuple[int, int] | None = None
    """The hinted layer range [a, b), or None for all layers."""
    epoch: int | None = None
    """The router's `session_epoch`; None when the request came without one."""
    reason: RestoreReason | None = None
    """The router's `restore_reason`: the session's KV was computed elsewhere."""
    previous_worker: str | None = None

    def usable_for(self, num_layers: int) -> bool:
        """Whether a restore can reuse anything (see the module docstring)."""
        if self.mode == "none":
            return False
        return self.layers is None or (self.layers[0] <= 0 and self.layers[1] >= num_layers)

    @property
    def hinted(self) -> bool:
        """The router says this request's KV is in the store (it moved with its session)."""
        return self.reason is not None


def parse_params(raw: object) -> RestoreParams:
    """Parse `kv_transfer_params`; raises InvalidKey (a ValueError) on anything malformed."""
    if raw is None:
        return RestoreParams()
    if not isinstance(raw, Mapping):
        raise InvalidKey("kv_transfer_params must be an object")
    session = raw.get("session_id")
    if session is not None and (isinstance(session, bool) or not isinstance(session, str | int)):
        raise InvalidKey(f"session_id must be a string, got {type(session).__name__}")
    session_id = None if session is None else validate_session_id(str(session))
    mode, layers = _restore(raw.get("restore", "auto"))
    return RestoreParams(session_id, mode, layers, _epoch(raw.get("session_epoch")),
                         _reason(raw.get("restore_reason")),
                         _worker(raw.get("previous_worker")))


def _restore(restore: Any) -> tuple[RestoreMode, tuple[int, int] | None]:
    if restore in ("auto", None):
        return "auto", None
    if restore == "none":
        return "none", None
    if isinstance(restore, Mapping) and set(restore) == {"layers"}:
        layers = restore["layers"]
        if (isinstance(layers, list | tuple) and len(layers) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
                and 0 <= layers[0] < layers[1]):
            return "auto", (int(layers[0]), int(layers[1]))
    raise InvalidKey(f"restore must be 'auto', 'none' or {{'layers': [a, b]}} with "
                     f"0 <= a < b, got {restore!r}")


def _epoch(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_EPOCH:
        raise InvalidKey(f"session_epoch must be an integer in [0, {MAX_EPOCH}], got {value!r}")
    return value


def _reason(value: object) -> RestoreReason | None:
    if value is None:
        return None
    if value not in RESTORE_REASONS:
        raise InvalidKey(f"restore_reason must be one of {list(RESTORE_REASONS)}, got {value!r}")
    return value


def _worker(value: object) -> str | None:
    """A worker id as the router names it (its own id, or host:port): only ever logged, so
    only printable text of a bounded length (no forged log lines)."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_WORKER_CHARS \
            or not value.isprintable():
        raise InvalidKey(f"previous_worker must be 1-{_MAX_WORKER_CHARS} printable characters")
    return value


def namespace_for(tenant: str, cache_salt: str | None) -> Namespace:
    """The namespace of a request: the tenant, plus vLLM's per-request cache salt if any.

    vLLM already mixes the salt into block hashes; keeping it in the namespace as well means
    salted blocks are also separated on disk and in metrics. Salts that are not valid names
    (any string is allowed by vLLM) are replaced by a digest of themselves.
    """
    if not cache_salt:
        return Namespace(tenant)
    try:
        return Namespace(tenant, validate_name(cache_salt, "cache salt"))
    except InvalidKey:
        digest = hashlib.blake2b(cache_salt.encode(), digest_size=16).hexdigest()
        return Namespace(tenant, f"h{digest}")
