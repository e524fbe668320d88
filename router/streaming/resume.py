"""Resuming a broken stream on another worker: what the new worker is sent, and what the
stream's record does once it took it. The relay and the decision to resume are the request
director's (`router/front/director.py`), which sends what this module builds through the dispatcher
(not to be confused with `router/conversations/`, stateful conversations: a client sending only
its new turn).

A stream breaks when the worker producing it does (connection lost, engine error event,
silence past the idle timeout, or no first bytes before the time-to-first-byte deadline: the
last a soft failure of the worker, which may only be busy).

What the client sized is never the worker's failure (trust review H1): a choice past the
request's own per-choice limit (read as vLLM reads it) ends the stream with an error event and
counts softly against the worker; one past the router's cap when the request set no limit ends
it with a 413 error event and counts nothing.

The continuation is a `/v1/completions` request with prompt = the prompt's token ids + the
tokens already delivered and `max_tokens` = what is left. Greedy decoding makes it
token-for-token what the original worker would have produced: the new worker prefills the
resent tokens (restoring their KV from the store where it can) and decodes the rest. Its chunks
are rewritten into the original stream (`StreamState`), and what happened is told in SSE
comments (`: kvkeep {...}`): a resumption when it happens, a summary at the end.

Stop strings are the router's across the break (`stops.py`): the continuation is asked to keep
them in its text, and the router holds back and finds them over the whole answer. A stream
whose worker returned no token ids is never continued from the start of the answer once any of
it reached the client (it would be sent twice): it is restarted only if nothing had, and ends
with an error event otherwise.

Structured outputs and tool calls cannot be continued from a prefix: they resume by replaying
the client's request (`replay.py`), cut to what the client has not been sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.decision import Placement
from router.front.api import ClientRequest, Endpoint
from router.front.dispatch import BodyFor
from router.front.upstream import kv_transfer_params, upstream_body
from router.membership.workers import WorkerId
from router.streaming.replay import Replay
from router.streaming.state import StreamState

__all__ = ["Resume", "resumption", "resume_body", "SAMPLING_FIELDS"]

# Fields a continuation keeps from the original request (what decides the next tokens).
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens",
    "spaces_between_special_tokens", "bad_words", "allowed_token_ids", "logit_bias",
    "include_stop_str_in_output", "user", "priority", "cache_salt",
)


def resume_body(state: StreamState, kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """The `/v1/completions` request that continues `state`'s stream on another worker."""
    req: ClientRequest = state.request
    assert state.prompt_ids is not None, "resumption needs the prompt's token ids"
    body: dict[str, Any] = {k: req.body[k] for k in SAMPLING_FIELDS if k in req.body}
    # n > 1: a batch of prompts, one per unfinished choice (`StreamState.continuation_prompt`)
    body.update(model=req.model, prompt=state.continuation_prompt(), stream=True,
                return_token_ids=True)
    body["max_tokens"] = state.remaining_max_tokens()
    min_tokens = req.body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 0:
        # No more than this round's `max_tokens` (vLLM refuses more); a later round asks the
        # rest.
        body["min_tokens"] = min(state.remaining_min_tokens(min_tokens), body["max_tokens"])
    frequency = req.body.get("frequency_penalty")
    if isinstance(frequency, int | float) and frequency and state.generated:
        body["logit_bias"] = _frequency_bias(req.body.get("logit_bias"), frequency,
                                             state.generated)
    if req.logprobs is not None:
        body["logprobs"] = req.logprobs  # rewritten into the client's format on the way back
    if req.include_usage:
        body["stream_options"] = {"include_usage": True}
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    return body


def _frequency_bias(client: Any, penalty: float, sent: list[int]) -> dict[str, float]:
    """The client's `logit_bias` plus what the frequency penalty of the tokens already sent
    would subtract (vLLM counts only the continuation's own output: `api._penalties_carry`).
    vLLM clamps a bias to [-100, 100], so it is exact while penalty x count stays within."""
    bias: dict[str, float] = {}
    if isinstance(client, dict):
        bias.update({str(k): float(v) for k, v in client.items()
                     if isinstance(v, int | float) and not isinstance(v, bool)})
    counts: dict[int, int] = {}
    for token in sent:
        counts[token] = counts.get(token, 0) + 1
    for token, count in counts.items():
        key = str(token)
        bias[key] = bias.get(key, 0.0) - penalty * count
    return bias


@dataclass(frozen=True, slots=True)
class Resume:
    """How one broken stream resumes: `body_for` is what each placement is sent, `begin`
    what the stream's record does once a worker took it; `how` names it for logs."""

    body_for: BodyFor
    begin: Callable[[WorkerId], None]
    how: str


def resumption(creq: ClientRequest, state: StreamState, replay: Replay | None, *,
               broken: WorkerId | None) -> Resume:
    """The resumption of `state`'s stream, broken on `broken` (None: not broken, another round
    of a continuation, `StreamState.owes_more`): a replay of the request when
    `replay` records it, else a continuation from the tokens delivered (or, when nothing is
    known to resume from, the original request again: `StreamState.resumable_now` allows that
    only while nothing reached the client)."""
    if replay is not None:
        def replayed(placement: Placement) -> tuple[str, dict[str, Any]]:
            body = upstream_body(creq, placement)
            hint = kv_transfer_params(creq, placement, resumed_from=broken)
            if hint is not None:  # the session's KV is where `broken` left it: restore it
                body["kv_transfer_params"] = {**body.get("kv_transfer_params", {}), **hint}
            return creq.endpoint.value, body

        return Resume(replayed, replay.begin, "replay")

    def continued(placement: Placement) -> tuple[str, dict[str, Any]]:
        if state.prompt_ids is None:  # nothing known to resume from: the original again
            return creq.endpoint.value, upstream_body(creq, placement)
        return Endpoint.COMPLETIONS.value, resume_body(state, kv_transfer_params(
            creq, placement, resumed_from=broken))

    def begin(_: WorkerId) -> None:
        if state.prompt_ids is not None:
            state.continue_here()
        else:  # nothing reached the client (`resumable_now`): the stream starts again
            state.restarted = True

    return Resume(continued, begin, "continue")
