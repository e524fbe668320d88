"""The per-request contract with the router: `kv_transfer_params` in, and what goes back out.

In (from `SamplingParams.extra_args["kv_transfer_params"]` or the HTTP body field)::

    {"session_id": "chat-42",          # optional: checkpoint this conversation's manifest
     "restore": "auto"                 # default: restore whatever prefix the store holds
              | "none"                 # never load (the request is computed; saving goes on)
              | {"layers": [a, b]}}    # restrict restore to layers [a, b) (see below)

Out (`RequestOutput.kv_transfer_params`, only for requests with a session)::

    {"session_id": "chat-42", "checkpointed_tokens": 256, "manifest_generation": 17...}

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
from typing import Any, Literal

from kvstore.errors import InvalidKey
from kvstore.keys import Namespace, SessionId, validate_name, validate_session_id

__all__ = ["RestoreParams", "parse_params", "namespace_for"]

RestoreMode = Literal["auto", "none"]


@dataclass(frozen=True, slots=True)
class RestoreParams:
    session_id: SessionId | None = None
    mode: RestoreMode = "auto"
    layers: tuple[int, int] | None = None
    """The hinted layer range [a, b), or None for all layers."""

    def usable_for(self, num_layers: int) -> bool:
        """Whether a restore can reuse anything (see the module docstring)."""
        if self.mode == "none":
            return False
        return self.layers is None or (self.layers[0] <= 0 and self.layers[1] >= num_layers)


def parse_params(raw: object) -> RestoreParams:
    """Parse `kv_transfer_params`; raises InvalidKey (a ValueError) on anything malformed."""
    if raw is None:
        return RestoreParams()
    if not isinstance(raw, Mapping):
        raise InvalidKey("kv_transfer_params must be an object")
    session = raw.get("session_id")
    session_id = None if session is None else validate_session_id(str(session))
    restore: Any = raw.get("restore", "auto")
    if restore in ("auto", None):
        return RestoreParams(session_id)
    if restore == "none":
        return RestoreParams(session_id, "none")
    if isinstance(restore, Mapping) and set(restore) == {"layers"}:
        layers = restore["layers"]
        if (isinstance(layers, list | tuple) and len(layers) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
                and 0 <= layers[0] < layers[1]):
            return RestoreParams(session_id, "auto", (int(layers[0]), int(layers[1])))
    raise InvalidKey(f"restore must be 'auto', 'none' or {{'layers': [a, b]}} with "
                     f"0 <= a < b, got {restore!r}")


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
