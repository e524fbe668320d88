"""The part of the kvkeep connector's `kv_transfer_params` (`connectors/vllm/params.py`) a
client may set: `restore` ("auto", "none", `{"layers": [a, b]}`), nothing else.

The rest of the contract (`session_id`, `session_epoch`, `restore_reason`, `previous_worker`)
is the router's: a client setting them could checkpoint into another session's manifest or
forge a restore hint. Unknown fields are dropped too, so a field a future connector reads is
opt-in, not open by default.
"""

from __future__ import annotations

from typing import Any

from router.errors import BadRequest

__all__ = ["KV_PARAMS_FIELD", "CLIENT_KV_FIELDS", "client_kv_params"]

KV_PARAMS_FIELD = "kv_transfer_params"
CLIENT_KV_FIELDS = frozenset({"restore"})
"""The `kv_transfer_params` fields a client may set."""


def client_kv_params(raw: object, *, strict: bool = False) -> dict[str, Any]:
    """The part of a client's `kv_transfer_params` it may set. `strict`: a malformed
    `restore` (or a params value that is not an object) is a 400 rather than dropped."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        if strict:
            raise BadRequest(f"`{KV_PARAMS_FIELD}` must be an object", param=KV_PARAMS_FIELD)
        return {}
    kept = {k: v for k, v in raw.items() if k in CLIENT_KV_FIELDS}
    restore = kept.get("restore")
    if restore is not None and not _valid_restore(restore):
        if strict:
            raise BadRequest(f"`{KV_PARAMS_FIELD}.restore` must be 'auto', 'none' or "
                             "{'layers': [a, b]} with 0 <= a < b", param=KV_PARAMS_FIELD)
        del kept["restore"]
    return kept


def _valid_restore(value: object) -> bool:
    if value in ("auto", "none"):
        return True
    if isinstance(value, dict) and set(value) == {"layers"}:
        layers = value["layers"]
        return (isinstance(layers, list) and len(layers) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
                and 0 <= layers[0] < layers[1])
    return False
