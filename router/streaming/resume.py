"""A stream's life after its headers: relayed to its end, and continued on another worker
when the one producing it breaks (connection lost, engine error event, silence past the idle
timeout, or no first bytes before the time-to-first-byte deadline: the last a soft failure of
the worker, which may only be busy).

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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from router.api import ClientRequest, Endpoint
from router.decision import Placement
from router.dispatch import Attempt, Dispatcher
from router.errors import RouterError
from router.hooks import Outcome
from router.streaming.relay import EventTooLarge, FirstByteTimeout, StreamBroken, note, pump, sse
from router.streaming.replay import Replay, ReplayMismatch, replay_refusal, replays
from router.streaming.state import StreamOverrun, StreamState
from router.upstream import kv_transfer_params, upstream_body
from router.workers import WorkerId

__all__ = ["relay_stream", "resume_body", "SAMPLING_FIELDS"]

log = logging.getLogger(__name__)

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
    body.update(model=req.model, prompt=state.prompt_ids + state.generated, stream=True,
                return_token_ids=True)
    body["max_tokens"] = state.remaining_max_tokens()
    min_tokens = req.body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 0:
        body["min_tokens"] = max(0, min_tokens - len(state.generated))
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


def _delivered(state: StreamState) -> Outcome:
    return Outcome(ok=True, prompt_tokens=state.prompt_ids, output_tokens=state.generated)


async def relay_stream(dispatcher: Dispatcher, creq: ClientRequest, attempt: Attempt,
                       out: web.StreamResponse, tried: set[WorkerId], *, max_resumes: int,
                       on_end: Callable[[StreamState], Awaitable[dict[str, Any]]] | None = None
                       ) -> None:
    """Relay the open stream of `attempt` to `out` (already prepared) until its end,
    resuming it elsewhere up to `max_resumes` times, and end `out`.

    A stream that cannot be resumed (not resumable, too many breaks, no worker left) ends with
    an error event. A client that leaves ends it at once (its exception propagates) and frees
    the worker. `on_end` runs when the stream ended whole, before its last bytes are sent
    (stateful continuation records the conversation there); what it returns joins the
    summary comment.
    """
    metrics = dispatcher.core.metrics
    limits = dispatcher.limits
    state = StreamState(creq, token_cap=limits.max_stream_tokens)
    # Structured outputs and tool calls resume by replaying the request (`replay.py`).
    replay = Replay() if replays(creq) else None
    resumed_on: list[str] = []
    failed: str | None = None
    failed_type, failed_code = "upstream_error", 502
    end: list[bytes] = []  # the stream's last bytes, sent with its end in one write
    try:
        while True:
            assert attempt.resp is not None
            try:
                end.append(await pump(attempt.resp, out, state, limits.max_event_bytes,
                                      first_byte_by=attempt.first_byte_by,
                                      idle_s=dispatcher.idle_timeout_s, replay=replay))
                break
            except ReplayMismatch as exc:
                # Not the replaying worker's fault (decoding was not deterministic after all):
                # it is closed, not marked. The client has only what agreed with the replay.
                log.warning("replay of a stream on %s differs: %s", attempt.worker, exc)
                dispatcher.close(attempt)
                failed = f"worker failed mid-stream and the answer could not be resumed: {exc}"
                metrics.resumptions.labels("failed").inc()
                break
            except StreamOverrun as exc:
                log.warning("stream from %s overran: %s", attempt.worker, exc)
                metrics.upstream_oversize.labels("tokens").inc()
                if exc.bounded:
                    # Past the limit the request itself set, read as vLLM reads it: the
                    # worker's doing, but counted soft: a misreading of the request here must
                    # never bench an honest worker (trust review H1).
                    dispatcher.failed(attempt, tried, hard=False)
                    failed = f"worker failed mid-stream: {exc}"
                else:  # the client set no limit and the answer passed the router's cap
                    dispatcher.close(attempt)
                    failed = f"{exc}; set `max_tokens` to bound the answer"
                    failed_type, failed_code = "invalid_request_error", 413
                break
            except StreamBroken as exc:
                log.warning("stream from %s broke after %d tokens: %s",
                            attempt.worker, len(state.generated), exc)
                if isinstance(exc, EventTooLarge):
                    metrics.upstream_oversize.labels("event").inc()
                # Silent before its first bytes: busy (queued, prefilling), not known dead.
                hard = not isinstance(exc, FirstByteTimeout)
                if state.finish_reason is not None:  # only the end was lost: finish it here
                    dispatcher.finish(attempt, _delivered(state))
                    dispatcher.failed(attempt, tried, hard=hard)
                    break
                dispatcher.failed(attempt, tried, hard=hard)
                why = state.resumable_now() if replay is None else replay_refusal(creq)
                if not (creq.resumable or replay is not None) or len(resumed_on) >= max_resumes \
                        or why is not None:
                    failed = f"worker failed mid-stream: {exc}" + (f" ({why})" if why else "")
                    metrics.resumptions.labels("refused").inc()
                    break
                nxt = await (_continue(dispatcher, creq, state, tried, broken=attempt.worker)
                             if replay is None else
                             _replay(dispatcher, creq, replay, tried, broken=attempt.worker))
                if nxt is None:
                    failed = f"worker failed mid-stream and no other could resume: {exc}"
                    metrics.resumptions.labels("failed").inc()
                    break
                attempt = nxt
                resumed_on.append(attempt.worker)
                metrics.resumptions.labels("resumed").inc()
                await out.write(note({"resumed_on": attempt.worker,
                                      "after_tokens": state.completion_tokens,
                                      **({"replay": True} if replay is not None else {})}))
        if failed is not None:
            end.append(sse({"error": {"message": failed, "type": failed_type,
                                      "param": None, "code": failed_code}}))
        else:
            if creq.include_usage and not state.usage_sent and state.chunk_id is not None:
                end.append(sse(state.usage_chunk()))
            extra = await on_end(state) if on_end is not None else {}
            end.append(note({"worker": attempt.worker, "route": attempt.placement.label,
                             "resumed_on": resumed_on, "failover": bool(tried),
                             "completion_tokens": state.completion_tokens,
                             "choice_tokens": [state.choice_tokens.get(i, 0) for i in
                                               range(max(state.choice_tokens, default=-1) + 1)],
                             **extra}))
            dispatcher.finish(attempt, _delivered(state))
        end.append(b"data: [DONE]\n\n")
        # One write (and one wake-up of the client) for the summary, [DONE] and the
        # chunked-encoding terminator; the client's last byte is the stream's end.
        await out.write_eof(b"".join(end))
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client left a stream from %s", attempt.worker)
        raise
    finally:
        dispatcher.close(attempt, reuse=state.done)


async def _continue(dispatcher: Dispatcher, creq: ClientRequest, state: StreamState,
                    tried: set[WorkerId], *, broken: WorkerId) -> Attempt | None:
    """Open the continuation of `state` on another worker; None when none can take it."""
    def body_for(placement: Placement) -> tuple[str, dict[str, Any]]:
        if state.prompt_ids is None:  # nothing known to resume from: the original again
            return creq.endpoint.value, upstream_body(creq, placement)
        return Endpoint.COMPLETIONS.value, resume_body(state, kv_transfer_params(
            creq, placement, resumed_from=broken))

    try:
        attempt = await dispatcher.send(creq, tried, stream=True, body_for=body_for)
    except RouterError as exc:
        log.warning("no worker can continue a stream of %s: %s", broken, exc)
        return None
    if attempt.resp is None:  # the worker's verdict on the continuation (a 4xx): no stream
        dispatcher.finish(attempt)
        return None
    if state.prompt_ids is not None:
        state.continue_here()
    else:  # nothing reached the client (`resumable_now`): the stream starts again
        state.restarted = True
    return attempt



async def _replay(dispatcher: Dispatcher, creq: ClientRequest, replay: Replay,
                  tried: set[WorkerId], *, broken: WorkerId) -> Attempt | None:
    """Send the client's request again to another worker, whose stream `replay` cuts to what
    the client has not been sent (`replay.py`); None when no worker can take it."""
    def body_for(placement: Placement) -> tuple[str, dict[str, Any]]:
        body = upstream_body(creq, placement)
        hint = kv_transfer_params(creq, placement, resumed_from=broken)
        if hint is not None:  # the session's KV is where `broken` left it: restore it
            body["kv_transfer_params"] = {**body.get("kv_transfer_params", {}), **hint}
        return creq.endpoint.value, body

    try:
        attempt = await dispatcher.send(creq, tried, stream=True, body_for=body_for)
    except RouterError as exc:
        log.warning("no worker can replay a stream of %s: %s", broken, exc)
        return None
    if attempt.resp is None:
        dispatcher.finish(attempt)
        return None
    replay.begin(attempt.worker)
    return attempt
