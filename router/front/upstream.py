"""What goes to a worker and what comes back from it: the request body (with the connector's
`kv_transfer_params`), the failures that count as the worker's, and a unary reply's facts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from router.decision import Placement
from router.front.api import ClientRequest, Endpoint
from router.front.kv_params import client_kv_params
from router.membership.workers import WorkerId

__all__ = ["UPSTREAM_ERRORS", "RETRYABLE_STATUS", "kv_transfer_params", "upstream_body",
           "UnaryReply", "absorb_unary"]

UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, OSError)
"""A worker that cannot be reached or read from: its failure, never the client's."""
RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
"""Answers that say the worker is failing, not that the request is wrong: tried elsewhere."""


def kv_transfer_params(creq: ClientRequest, placement: Placement, *,
                       resumed_from: WorkerId | None = None) -> dict[str, Any] | None:
    """What the worker's KV connector gets (`connectors/vllm/params.py` is the contract).

    `{"session_id", "restore": "auto", "session_epoch"}`, plus, when the session's KV is
    elsewhere (migrated, failed over, resumed), `"restore_reason"` and `"previous_worker"`:
    the restore hint. "auto" lets the connector restore whatever prefix the store holds, so it
    is right for sticky requests too (it loads only what the local cache misses). Of a
    client's own fields only those it may set are kept (`router/front/admission.py`: `restore`).
    """
    params = client_kv_params(creq.body.get("kv_transfer_params"))
    restore_from = resumed_from or placement.restore_from
    if creq.session_id is not None:
        params["session_id"] = creq.session_id
    elif resumed_from is None:
        return params or None
    params.setdefault("restore", "auto")
    if restore_from is not None:
        params["restore_reason"] = "resumed" if resumed_from else placement.label
        params["previous_worker"] = restore_from
    if placement.binding is not None:
        params["session_epoch"] = placement.binding.binding.epoch
    return params


def upstream_body(creq: ClientRequest, placement: Placement) -> dict[str, Any]:
    """The client's request as the worker gets it."""
    body = dict(creq.body)
    if (creq.stream or creq.session_id is not None) and not _echoes_prompt_text(creq):
        # Token ids let a broken stream resume exactly, count every choice of a stream
        # against its limit (`streaming/state.py`), and give the next turn a precise prefix;
        # they are stripped from the reply unless the client asked.
        body["return_token_ids"] = True
    params = kv_transfer_params(creq, placement)
    if creq.endpoint is Endpoint.CHAT and creq.prompt_tokens is not None:
        # A stateful continuation (router/conversations/): vLLM takes the rebuilt prompt's ids
        # as they are instead of rendering `messages`.
        params = {**(params or {}), "prompt_token_ids": list(creq.prompt_tokens)}
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def _echoes_prompt_text(creq: ClientRequest) -> bool:
    """A completions request with `echo` whose client did not ask for token ids: vLLM 0.32
    echoes the prompt's text only without `return_token_ids` (with them it sends the prompt's
    ids and no text), so the router does not ask for them. Such a stream is never resumed
    (`api._NOT_RESUMABLE`) and needs none; its choices go uncounted against their limit."""
    return creq.endpoint is Endpoint.COMPLETIONS and bool(creq.body.get("echo")) \
        and not creq.wants_token_ids


@dataclass(slots=True)
class UnaryReply:
    """A non-streaming answer's token ids (for the post-response hooks) and the headers that
    tell the client what was reused."""

    prompt_tokens: list[int] | None = None
    output_tokens: list[int] | None = None
    headers: dict[str, str] = field(default_factory=dict)


def absorb_unary(creq: ClientRequest, obj: dict[str, Any]) -> UnaryReply:
    """Read a worker's JSON answer, removing the token ids the client did not ask for."""
    keep = creq.wants_token_ids
    reply = UnaryReply()
    choices = obj.get("choices") or []
    prompt = obj.get("prompt_token_ids") if keep else obj.pop("prompt_token_ids", None)
    output: list[int] | None = None
    for i, choice in enumerate(choices):
        if not isinstance(choice, dict):
            continue
        p = choice.get("prompt_token_ids") if keep else choice.pop("prompt_token_ids", None)
        ids = choice.get("token_ids") if keep else choice.pop("token_ids", None)
        if i == 0:
            prompt, output = p if p is not None else prompt, ids
    reply.prompt_tokens, reply.output_tokens = prompt, output
    usage = obj.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        prompt_tokens = usage.get("prompt_tokens")
        if isinstance(cached, int) and isinstance(prompt_tokens, int):
            reply.headers["X-KVKeep-Cached-Tokens"] = str(cached)
            reply.headers["X-KVKeep-Recomputed-Tokens"] = str(max(0, prompt_tokens - cached))
    returned = obj.get("kv_transfer_params")
    if isinstance(returned, dict):  # what the kvkeep connector reports back
        for name, header in (("restored_tokens", "X-KVKeep-Restored-Tokens"),
                             ("checkpointed_tokens", "X-KVKeep-Checkpointed-Tokens")):
            if isinstance(returned.get(name), int):
                reply.headers[header] = str(returned[name])
    return reply
