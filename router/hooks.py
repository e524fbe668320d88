"""What happens around a request, outside the decision: hooks run by the router core.

Like the Gateway API Inference Extension's plugin interfaces, bookkeeping is a list of small
plugins rather than lines scattered over the proxy: a `PreRequest` hook runs when a request is
placed (before it is sent), a `PostResponse` hook when the attempt ends, successful or not,
exactly once per placement. Both are the core's, so every front (the HTTP proxy and ext_proc
alike) runs them.

A `ResponseStreaming` hook (the Inference Extension's ResponseStreaming and ResponseComplete)
sees a stream the request director relays (`router/front/director.py`): every chunk as the client
gets it, and the stream's end when it ended whole, before its last bytes are sent. The
director's only one today records a session's conversation at the end of its turn
(`director.ConversationRecorder`); the ext_proc front has none (Envoy relays its streams).

The defaults:
- `LoadAccounting` (both): charges the pick to its worker at once (optimistic accounting: a
  burst between two scrapes spreads out) and releases it when the attempt ends. One object,
  so the charge and its release cannot disagree.
- `HistoryRecorder` (pre): teaches the approximate prefix index which worker got the prompt.
  At pick time, as llm-d's approximate prefix plugin does in its PreRequest: a burst of
  requests sharing a prefix sees the first one's placement before it has answered.
- `SessionTokens` (post): keeps a session's prompt + output token-block keys, the precise
  prefix of its next turn.
- `BindingSettler` (post): after a success on a moved session's new worker, clears the restore
  hint and renews the binding's TTL when due (a state-backend write, deferred).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from router.decision import Placement
from router.indexer.history import RoutingHistory, SessionBlocks, session_scope
from router.indexer.keys import token_block_keys
from router.membership.workers import WorkerPool
from router.state.sessions import SessionTable
from router.streaming.state import StreamState

__all__ = ["Outcome", "FAILED", "PreRequest", "PostResponse", "ResponseStreaming",
           "LoadAccounting", "HistoryRecorder", "SessionTokens", "BindingSettler", "Defer"]

Defer = Callable[[Coroutine[Any, Any, Any]], None]
"""Runs a coroutine after the caller returns (an event-loop task) or at once (`run_now`)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one attempt ended. `ok`: the worker's answer reached the client whole (a unary
    2xx JSON reply, a stream to its end). Token ids are the prompt's and the output's, where
    the worker returned them."""

    ok: bool
    prompt_tokens: Sequence[int] | None = None
    output_tokens: Sequence[int] | None = None


FAILED = Outcome(ok=False)


class PreRequest(Protocol):
    def pre_request(self, placement: Placement) -> None: ...


class PostResponse(Protocol):
    def post_response(self, placement: Placement, outcome: Outcome) -> None: ...


class ResponseStreaming(Protocol):
    """A stream's observer, one per director (the stream's request is `state.request`)."""

    def on_chunk(self, state: StreamState, data: bytes) -> None:
        """The worker's events that were just written to the client (`data`, as written:
        one write may carry several events), with what the stream has delivered so far."""

    async def on_end(self, state: StreamState) -> dict[str, Any]:
        """The stream ended whole (never after an error event); what it returns joins the
        stream's summary comment. Its last bytes are sent once every hook returned."""


@dataclass(frozen=True, slots=True)
class LoadAccounting:
    pool: WorkerPool

    def pre_request(self, placement: Placement) -> None:
        self.pool.charge(placement.worker, placement.route.tokens)

    def post_response(self, placement: Placement, outcome: Outcome) -> None:
        self.pool.release(placement.worker, placement.route.tokens)


@dataclass(frozen=True, slots=True)
class HistoryRecorder:
    history: RoutingHistory

    def pre_request(self, placement: Placement) -> None:
        keys = placement.route.prefix_keys
        if keys:
            self.history.record(keys, placement.worker)


@dataclass(frozen=True, slots=True)
class SessionTokens:
    blocks: SessionBlocks
    block_size: int

    def post_response(self, placement: Placement, outcome: Outcome) -> None:
        sid = placement.route.session_id
        if not outcome.ok or sid is None or not outcome.prompt_tokens:
            return
        tokens = list(outcome.prompt_tokens) + list(outcome.output_tokens or ())
        route = placement.route
        self.blocks.put(session_scope(route.tenant, sid),
                        token_block_keys(tokens, self.block_size, route.key_root))


@dataclass(frozen=True, slots=True)
class BindingSettler:
    sessions: SessionTable
    defer: Defer

    def post_response(self, placement: Placement, outcome: Outcome) -> None:
        binding = placement.binding
        if outcome.ok and binding is not None and binding.worker_id == placement.worker and \
                self.sessions.needs_touch(binding, settle=True):
            self.defer(self.sessions.touch(binding, settle=True))
