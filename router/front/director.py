"""The request director: one generation request's whole life, from admission to its record.

Like the Gateway API Inference Extension's `requestcontrol/director.go`, one object owns what
happens to a request once it is admitted (parsed, its tenant's salt and `kv_transfer_params`
set: `router/front/admission.py`), in order:

1. the model is one the pool serves (else 404);
2. a stateful continuation is rebuilt (`router/conversations/`: the recorded conversation +
   the new turn; 409 without a usable record, 400 with continuation off);
3. placed and sent (`Dispatcher.send`, the one place / send / classify / retry loop: the core
   places, the core's pre-request hooks run, a worker that fails before anything reached the
   client is marked and the request placed again);
4. relayed: a unary answer absorbed into a reply (`Reply`, with the router's headers), or a
   stream written to the client's `StreamSink` event by event (`router/streaming/relay.py`);
5. a broken stream resumed on another worker (`router/streaming/resume.py` says what it is
   sent; it goes through `Dispatcher.send` again, from here, so every attempt is placed and
   finished the same way), at most `max_resumes` times;
6. finished: the core's post-response hooks run exactly once per attempt (`Dispatcher.finish`),
   with the outcome (what reached the client whole, and its token ids);
7. the session's conversation recorded (stateful continuation on): a unary turn before its
   reply is returned, a stream's by a `ResponseStreaming` hook (`ConversationRecorder`) before
   its last bytes, so a continuation sent the moment an answer ends finds it.

A Responses API request (`/v1/responses`) lives the same life up to its relay, which is its
own (`router/streaming/responses_api.py`): its events pass through as the worker sent them, a
break before any reached the client sends the request to another worker, a later one ends the
stream with the API's failure events (never resumed), and nothing is recorded (the Responses
API keeps its own conversation, `previous_response_id`, in the worker's memory: the session's
binding, by `X-Session-Id`, is what keeps such a conversation on the worker that has it).

Fronts are adapters over it: the HTTP proxy (`router/front/proxy.py`) parses a request, calls
`generate` and writes what it returns.

The ext_proc front (`router/extproc/`) does not go through the director, and should not: there
Envoy sends the request and relays the answer, so of this life the router owns only the
decision (`RouterCore.place`, plus ranked fallbacks that Envoy dials itself) and its end
(`RouterCore.finish`, once, when Envoy reports the response or the stream closes). Steps 3-7
above are Envoy's or impossible (no resume, no conversation record: the router never sees the
answer's tokens). Both fronts share what decides and what is finished, the core's `place` and
`finish` with their hooks, which is where a placement's bookkeeping lives; a director entry
point for "place only" would be the core's `place` under another name.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from router.conversations import (
    CONTINUE_FIELD,
    HISTORY_HEADER,
    Continuations,
    TurnEnd,
    asks_continuation,
)
from router.decision import Placement
from router.errors import BadRequest, ContinuationUnsupported, ModelNotFound, RouterError
from router.front.api import ClientRequest, Endpoint
from router.front.dispatch import Attempt, BodyFor, Dispatcher
from router.front.upstream import absorb_unary, upstream_body
from router.hooks import FAILED, Outcome, ResponseStreaming
from router.membership.workers import WorkerId
from router.streaming.relay import EventTooLarge, FirstByteTimeout, StreamBroken, note, pump, sse
from router.streaming.replay import Replay, ReplayMismatch, replay_refusal, replays
from router.streaming.responses_api import EventStream, failure_events, pump_events
from router.streaming.resume import resumption
from router.streaming.sink import Sink, StreamSink
from router.streaming.state import StreamOverrun, StreamState

__all__ = ["RequestDirector", "Reply", "ConversationRecorder", "route_headers"]

log = logging.getLogger(__name__)

_DUMPS = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_STREAM_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole answer for the front to write: the worker's status and content type, the body
    to send and the router's headers."""

    status: int
    body: bytes
    content_type: str
    headers: dict[str, str]


class ConversationRecorder:
    """Records a session's conversation at the end of a streamed turn (stateful
    continuation); what it recorded is the summary's `history_tokens`."""

    __slots__ = ("continuations",)

    def __init__(self, continuations: Continuations) -> None:
        self.continuations = continuations

    def on_chunk(self, state: StreamState, data: bytes) -> None:
        pass  # the record needs the whole turn: its token ids are in `state` at the end

    async def on_end(self, state: StreamState) -> dict[str, Any]:
        history = await self.continuations.record(
            state.request, state.prompt_ids, state.generated,
            TurnEnd(state.finish_reason, state.stop_reason))
        return {} if history is None else {"history_tokens": history}


class _Observed:
    """The client's sink as the relay writes it: every write shown to the streaming hooks."""

    __slots__ = ("hooks", "sink", "state")

    def __init__(self, sink: Sink, hooks: Sequence[ResponseStreaming], state: StreamState
                 ) -> None:
        self.sink, self.hooks, self.state = sink, hooks, state

    async def write(self, data: bytes) -> None:
        await self.sink.write(data)
        for hook in self.hooks:
            hook.on_chunk(self.state, data)


class RequestDirector:
    """See the module docstring. `streaming`: `ResponseStreaming` hooks every stream runs,
    after the conversation recorder (present when `continuations` is)."""

    __slots__ = ("continuations", "dispatcher", "max_resumes", "streaming")

    def __init__(self, dispatcher: Dispatcher, continuations: Continuations | None = None, *,
                 max_resumes: int, streaming: Sequence[ResponseStreaming] = ()) -> None:
        self.dispatcher = dispatcher
        self.continuations = continuations
        self.max_resumes = max_resumes
        hooks: list[ResponseStreaming] = [] if continuations is None \
            else [ConversationRecorder(continuations)]
        self.streaming: list[ResponseStreaming] = [*hooks, *streaming]
        """Run on every stream, in order; append your own."""

    # --- entry points ----------------------------------------------------------------------
    async def generate(self, creq: ClientRequest, sink: StreamSink, *,
                       continue_header: str | None = None) -> Reply | None:
        """Serve an admitted request (steps 1-7 of the module docstring). Returns the reply
        to write, or None when the answer was streamed to `sink` (prepared and ended here).
        A stream the worker refused before streaming (its own 4xx) is a reply, and `sink`
        stays untouched. Raises a `RouterError` for the front to answer with (nothing was
        written then)."""
        core = self.dispatcher.core
        if creq.model not in core.models():
            raise ModelNotFound(f"The model `{creq.model}` does not exist.", param="model")
        if asks_continuation(creq, continue_header):
            if creq.endpoint is Endpoint.RESPONSES:
                raise BadRequest("a Responses API request continues a conversation with "
                                 "`previous_response_id`, not the router's stateful "
                                 "continuation", param=CONTINUE_FIELD)
            if self.continuations is None:
                raise ContinuationUnsupported("stateful continuation is off on this router "
                                              "(--continuation); send the whole history")
            creq = await self.continuations.rebuild(creq)
        started = time.perf_counter()
        try:
            if creq.stream:
                return await self.stream(creq, sink)
            return await self.unary(creq)
        finally:
            core.metrics.request_seconds.labels(
                creq.endpoint.value, str(creq.stream).lower()).observe(
                time.perf_counter() - started)

    async def unary(self, creq: ClientRequest) -> Reply:
        """Place, send and absorb a non-streaming request; its turn recorded before the
        reply is returned."""
        dispatcher = self.dispatcher
        tried: set[WorkerId] = set()
        if creq.endpoint is Endpoint.RESPONSES:
            return await self._unary_response(creq, tried)
        attempt = await dispatcher.send(creq, tried, stream=False)
        headers = route_headers(creq, attempt.placement, failover=bool(tried))
        data, outcome = attempt.data, FAILED
        end: TurnEnd | None = None
        try:
            if attempt.status == 200 and attempt.content_type == "application/json":
                try:
                    obj = json.loads(data)
                except ValueError:
                    obj = None
                if isinstance(obj, dict):
                    reply = absorb_unary(creq, obj)
                    headers.update(reply.headers)
                    data = _DUMPS(obj).encode()
                    outcome = Outcome(ok=True, prompt_tokens=reply.prompt_tokens,
                                      output_tokens=reply.output_tokens)
                    end = TurnEnd.of_reply(obj)
        finally:
            dispatcher.finish(attempt, outcome)
        continuations = self.continuations
        if end is not None and continuations is not None:
            # Before the reply: a continuation sent the moment it arrives finds this turn.
            history = await continuations.record(creq, outcome.prompt_tokens,
                                                 outcome.output_tokens, end)
            if history is not None:
                headers[HISTORY_HEADER] = str(history)
        return _reply(attempt, data, headers)

    async def stream(self, creq: ClientRequest, sink: StreamSink) -> Reply | None:
        """Place and send a streaming request, then relay it to `sink` to its end (resumed
        where it breaks). A reply when the worker answered without a stream."""
        dispatcher = self.dispatcher
        tried: set[WorkerId] = set()
        events = creq.endpoint is Endpoint.RESPONSES
        attempt = await dispatcher.send(creq, tried, stream=True,
                                        body_for=_responses_body(creq) if events else None)
        headers = route_headers(creq, attempt.placement, failover=bool(tried))
        if attempt.resp is None:
            # The worker's own verdict on the request (400 and the like): passed through.
            dispatcher.finish(attempt)
            return _reply(attempt, attempt.data, headers)
        headers.update(_STREAM_HEADERS)
        try:
            await sink.prepare(headers)
        except BaseException:
            dispatcher.close(attempt)
            raise
        if events:
            await self._relay_events(creq, attempt, sink, tried)
        else:
            await self._relay(creq, attempt, sink, tried)
        return None

    # --- the Responses API -----------------------------------------------------------------
    async def _unary_response(self, creq: ClientRequest, tried: set[WorkerId]) -> Reply:
        """A non-streaming Responses API request: the worker's answer passed on as it is (no
        token ids to strip: none were asked), with the router's headers."""
        dispatcher = self.dispatcher
        attempt = await dispatcher.send(creq, tried, stream=False,
                                        body_for=_responses_body(creq))
        headers = route_headers(creq, attempt.placement, failover=bool(tried))
        outcome = FAILED
        try:
            if attempt.status == 200 and attempt.content_type == "application/json":
                try:
                    obj = json.loads(attempt.data)
                except ValueError:
                    obj = None
                if isinstance(obj, dict):
                    headers.update(_response_usage_headers(obj))
                    outcome = Outcome(ok=True)
        finally:
            dispatcher.finish(attempt, outcome)
        return _reply(attempt, attempt.data, headers)

    async def _relay_events(self, creq: ClientRequest, attempt: Attempt, sink: StreamSink,
                            tried: set[WorkerId]) -> None:
        """Relay a Responses API stream to `sink` (prepared) to its terminal event and end
        `sink` (`streaming/responses_api.py`). A worker that breaks it is marked as for the
        other streams; before any event reached the client the request goes to another
        worker (at most `max_resumes` times), after that the stream ends with the API's
        `error` and `response.failed` events."""
        dispatcher = self.dispatcher
        metrics = dispatcher.core.metrics
        limits = dispatcher.limits
        stream = EventStream()
        restarted_on: list[str] = []
        failed: str | None = None
        tail = b""
        try:
            while True:
                assert attempt.resp is not None
                try:
                    tail = await pump_events(attempt.resp, sink, stream, limits.max_event_bytes,
                                             first_byte_by=attempt.first_byte_by,
                                             idle_s=dispatcher.idle_timeout_s,
                                             registered=dispatcher.registered(attempt.worker))
                    break
                except StreamBroken as exc:
                    log.warning("responses stream from %s broke after %d events: %s",
                                attempt.worker, stream.events, exc)
                    if isinstance(exc, EventTooLarge):
                        metrics.upstream_oversize.labels("event").inc()
                    dispatcher.failed(attempt, tried, hard=not isinstance(exc, FirstByteTimeout))
                    if stream.events == 0 and len(restarted_on) < self.max_resumes:
                        nxt = await self._restart(creq, tried, broken=attempt.worker)
                        if nxt is not None:
                            attempt = nxt
                            restarted_on.append(attempt.worker)
                            metrics.resumptions.labels("resumed").inc()
                            await sink.write(note({"restarted_on": attempt.worker}))
                            continue
                    failed = f"worker failed mid-stream: {exc} (a Responses API stream is " \
                        "not resumed: its response and item ids and sequence numbers are the " \
                        "broken worker's; send the request again)"
                    metrics.resumptions.labels("refused").inc()
                    break
            if failed is not None:
                end = failure_events(stream, failed)
            else:
                end = tail + note({"worker": attempt.worker, "route": attempt.placement.label,
                                   "restarted_on": restarted_on, "failover": bool(tried),
                                   "events": stream.events})
                dispatcher.finish(attempt, Outcome(ok=True))
            await sink.write_eof(end)
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client left a responses stream from %s", attempt.worker)
            raise
        finally:
            dispatcher.close(attempt, reuse=stream.done)

    async def _restart(self, creq: ClientRequest, tried: set[WorkerId], *, broken: WorkerId
                       ) -> Attempt | None:
        """Send a stream that broke before any of it reached the client to another worker,
        from the start; None when none can take it."""
        dispatcher = self.dispatcher
        try:
            attempt = await dispatcher.send(creq, tried, stream=True,
                                            body_for=_responses_body(creq))
        except RouterError as exc:
            log.warning("no worker can restart a stream of %s: %s", broken, exc)
            return None
        if attempt.resp is None:  # the worker's verdict on the request (a 4xx): no stream
            dispatcher.finish(attempt)
            return None
        return attempt

    # --- a stream's life after its headers -------------------------------------------------
    async def _relay(self, creq: ClientRequest, attempt: Attempt, sink: StreamSink,
                     tried: set[WorkerId]) -> None:
        """Relay the open stream of `attempt` to `sink` (prepared) until its end, resuming it
        elsewhere up to `max_resumes` times, and end `sink`.

        A stream that cannot be resumed (not resumable, too many breaks, no worker left) ends
        with an error event. A client that leaves ends it at once (its exception propagates)
        and frees the worker. The streaming hooks' `on_end` runs when the stream ended whole,
        before its last bytes are sent; what they return joins the summary comment.
        """
        dispatcher = self.dispatcher
        metrics = dispatcher.core.metrics
        limits = dispatcher.limits
        state = StreamState(creq, token_cap=limits.max_stream_tokens)
        hooks = self.streaming
        out: Sink = _Observed(sink, hooks, state) if hooks else sink
        # Structured outputs and tool calls resume by replaying the request (`replay.py`).
        replay = Replay() if replays(creq) else None
        resumed_on: list[str] = []
        failed: str | None = None
        failed_type, failed_code = "upstream_error", 502
        end: list[bytes] = []  # the stream's last bytes, sent with its end in one write
        tail = b""  # the worker's last events, read with its [DONE]
        rounds = 0  # continuations opened for choices a continuation left owing tokens
        try:
            while True:
                assert attempt.resp is not None
                try:
                    tail = await pump(attempt.resp, out, state, limits.max_event_bytes,
                                      first_byte_by=attempt.first_byte_by,
                                      idle_s=dispatcher.idle_timeout_s, replay=replay,
                                      registered=dispatcher.registered(attempt.worker))
                    if state.owes_more() and rounds < state.expected:
                        # n > 1 continued: vLLM ended every choice at the least any still
                        # owed, and some owe more. Another round (no worker failed).
                        rounds += 1
                        if tail:
                            await out.write(tail)
                        nxt = await self._next_round(creq, state, attempt, tried)
                        if nxt is None:
                            failed = "no worker could continue the answer's unfinished choices"
                            metrics.resumptions.labels("failed").inc()
                            break
                        attempt = nxt
                        continue
                    end.append(tail)
                    break
                except ReplayMismatch as exc:
                    # Not the replaying worker's fault (decoding was not deterministic after
                    # all): it is closed, not marked. The client has only what agreed with the
                    # replay.
                    log.warning("replay of a stream on %s differs: %s", attempt.worker, exc)
                    dispatcher.close(attempt)
                    failed = "worker failed mid-stream and the answer could not be resumed: " \
                        f"{exc}"
                    metrics.resumptions.labels("failed").inc()
                    break
                except StreamOverrun as exc:
                    log.warning("stream from %s overran: %s", attempt.worker, exc)
                    metrics.upstream_oversize.labels("tokens").inc()
                    if exc.bounded:
                        # Past the limit the request itself set, read as vLLM reads it: the
                        # worker's doing, but counted soft: a misreading of the request here
                        # must never bench an honest worker (trust review H1).
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
                    if state.finish_reason is not None:  # only the end was lost: finish it
                        dispatcher.finish(attempt, _delivered(state))
                        dispatcher.failed(attempt, tried, hard=hard)
                        break
                    dispatcher.failed(attempt, tried, hard=hard)
                    why = state.resumable_now() if replay is None else replay_refusal(creq)
                    if not (creq.resumable or replay is not None) \
                            or len(resumed_on) >= self.max_resumes or why is not None:
                        failed = f"worker failed mid-stream: {exc}" + (f" ({why})" if why else "")
                        metrics.resumptions.labels("refused").inc()
                        break
                    nxt = await self._resume(creq, state, replay, tried, broken=attempt.worker)
                    if nxt is None:
                        failed = f"worker failed mid-stream and no other could resume: {exc}"
                        metrics.resumptions.labels("failed").inc()
                        break
                    attempt = nxt
                    resumed_on.append(attempt.worker)
                    metrics.resumptions.labels("resumed").inc()
                    await sink.write(note({"resumed_on": attempt.worker,
                                           "after_tokens": state.completion_tokens,
                                           **({"replay": True} if replay is not None else {})}))
            if failed is not None:
                end.append(sse({"error": {"message": failed, "type": failed_type,
                                          "param": None, "code": failed_code}}))
            else:
                if tail:  # sent with the end below, but chunks of the answer all the same
                    for hook in hooks:
                        hook.on_chunk(state, tail)
                if creq.include_usage and not state.usage_sent and state.chunk_id is not None:
                    end.append(sse(state.usage_chunk()))
                extra: dict[str, Any] = {}
                for hook in hooks:
                    extra.update(await hook.on_end(state))
                end.append(note({"worker": attempt.worker, "route": attempt.placement.label,
                                 "resumed_on": resumed_on, "failover": bool(tried),
                                 "completion_tokens": state.completion_tokens,
                                 **({"rounds": rounds} if rounds else {}),
                                 "choice_tokens": [state.choice_tokens.get(i, 0) for i in
                                                   range(max(state.choice_tokens, default=-1)
                                                         + 1)],
                                 **extra}))
                dispatcher.finish(attempt, _delivered(state))
            end.append(b"data: [DONE]\n\n")
            # The worker's connection goes back to the pool (its terminator read in the
            # background) before the client is answered: it waits on no slow client, and
            # whoever has read the stream's end finds the deferred read already there.
            dispatcher.close(attempt, reuse=state.done)
            # One write (and one wake-up of the client) for the summary, [DONE] and the
            # chunked-encoding terminator; the client's last byte is the stream's end.
            await sink.write_eof(b"".join(end))
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client left a stream from %s", attempt.worker)
            raise
        finally:
            dispatcher.close(attempt, reuse=state.done)

    async def _next_round(self, creq: ClientRequest, state: StreamState, done: Attempt,
                          tried: set[WorkerId]) -> Attempt | None:
        """Close `done` (its [DONE] came; a round ends as a failed attempt does, its outcome
        not the answer's) and open the next round of the continuation: most likely on the
        same worker, which holds the prefix's KV."""
        self.dispatcher.close(done, reuse=True)
        state.done = False
        return await self._resume(creq, state, None, tried, broken=None)

    async def _resume(self, creq: ClientRequest, state: StreamState, replay: Replay | None,
                      tried: set[WorkerId], *, broken: WorkerId | None) -> Attempt | None:
        """Open the resumption of `state`'s stream on another worker (`resume.resumption`:
        a continuation, or a replay); None when none can take it."""
        dispatcher = self.dispatcher
        how = resumption(creq, state, replay, broken=broken)
        try:
            attempt = await dispatcher.send(creq, tried, stream=True, body_for=how.body_for)
        except RouterError as exc:
            log.warning("no worker can %s a stream (broken on %s): %s", how.how,
                        broken or "no worker", exc)
            return None
        if attempt.resp is None:  # the worker's verdict on the resumption (a 4xx): no stream
            dispatcher.finish(attempt)
            return None
        how.begin(attempt.worker)
        return attempt


def _responses_body(creq: ClientRequest) -> BodyFor:
    """A Responses API request's path and body: the other endpoints', less `return_token_ids`
    (its events carry no token ids, and vLLM would ignore the field)."""
    def body_for(placement: Placement) -> tuple[str, dict[str, Any]]:
        body = upstream_body(creq, placement)
        body.pop("return_token_ids", None)
        return creq.endpoint.value, body
    return body_for


def _response_usage_headers(obj: dict[str, Any]) -> dict[str, str]:
    """`X-KVKeep-Cached-Tokens` / `-Recomputed-Tokens` from a Responses API answer's usage
    (`input_tokens`, `input_tokens_details.cached_tokens`)."""
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return {}
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt = usage.get("input_tokens")
    if not isinstance(cached, int) or not isinstance(prompt, int):
        return {}
    return {"X-KVKeep-Cached-Tokens": str(cached),
            "X-KVKeep-Recomputed-Tokens": str(max(0, prompt - cached))}


def _delivered(state: StreamState) -> Outcome:
    return Outcome(ok=True, prompt_tokens=state.prompt_ids, output_tokens=state.generated)


def _reply(attempt: Attempt, body: bytes, headers: dict[str, str]) -> Reply:
    """The worker's answer (its status and content type), with the router's headers."""
    return Reply(attempt.status, body, attempt.content_type or "application/json", headers)


def route_headers(creq: ClientRequest, placement: Placement, *, failover: bool
                  ) -> dict[str, str]:
    """The router's response headers: where the request went, and why."""
    label = placement.label
    headers = {
        "X-KVKeep-Worker": placement.worker,
        "X-KVKeep-Route": label,
        "X-KVKeep-Restore": "1" if placement.restore_from is not None else "0",
        "X-KVKeep-Failover": "1" if failover or label in ("failover", "resumed") else "0",
        "X-KVKeep-Migrated": "1" if label == "migrated" else "0",
    }
    if creq.session_id is not None:
        headers["X-KVKeep-Session"] = creq.session_id
    return headers
