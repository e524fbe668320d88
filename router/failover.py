"""Failover: rebinding a dead worker's sessions, and the request that resumes a broken stream.

Rebinding runs when the worker's registration disappears (lease expired or revoked). Every
replica sees that DELETE and tries to move each session the dead worker held; the
compare-and-swap on each binding lets exactly one move win, and the others adopt it through
their watch. Moved bindings carry `restore_from`, so the session's next request (on any
replica) tells the new worker's connector to restore the KV from the store.

Sessions are spread over the survivors with the same scheduler that routes requests, each
placement charged as if a request had gone there, so a hundred orphaned sessions do not all
land on the single least-loaded worker.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from router.api import ClientRequest
from router.decision import RouteReason, RouteRequest
from router.errors import RouterError
from router.metrics import RouterMetrics
from router.scheduler import Scheduler
from router.sessions import SessionTable
from router.streaming import StreamState
from router.workers import WorkerId

__all__ = ["Rebinder", "resume_body", "SAMPLING_FIELDS"]

log = logging.getLogger(__name__)

# Fields a continuation keeps from the original request (what decides the next tokens).
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens",
    "spaces_between_special_tokens", "bad_words", "allowed_token_ids", "logit_bias",
    "include_stop_str_in_output", "user", "priority", "cache_salt",
)
_YIELD_EVERY = 256


def resume_body(state: StreamState, kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """The `/v1/completions` request that continues `state`'s stream on another worker.

    Greedy decoding makes the continuation token-for-token what the original worker would have
    produced: the new worker prefills prompt + delivered tokens (restoring their KV from the
    store where it can) and decodes the rest.
    """
    req: ClientRequest = state.request
    assert state.prompt_ids is not None, "resumption needs the prompt's token ids"
    body: dict[str, Any] = {k: req.body[k] for k in SAMPLING_FIELDS if k in req.body}
    body.update(model=req.model, prompt=state.prompt_ids + state.generated, stream=True,
                return_token_ids=True)
    remaining = state.remaining_max_tokens()
    if remaining is not None:
        body["max_tokens"] = remaining
    min_tokens = req.body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 0:
        body["min_tokens"] = max(0, min_tokens - len(state.generated))
    if req.logprobs is not None:
        body["logprobs"] = req.logprobs  # rewritten into the client's format on the way back
    if req.include_usage:
        body["stream_options"] = {"include_usage": True}
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    return body


@dataclass(slots=True)
class Rebinder:
    scheduler: Scheduler
    sessions: SessionTable
    metrics: RouterMetrics
    _tasks: set[asyncio.Task[int]] = field(default_factory=set)

    def worker_gone(self, worker: WorkerId) -> None:
        """Registry callback: schedule the rebinding of `worker`'s sessions."""
        task = asyncio.get_running_loop().create_task(self.rebind(worker),
                                                      name=f"rebind-{worker}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def rebind(self, worker: WorkerId) -> int:
        """Move every session bound to `worker`; returns how many this replica moved."""
        moved = 0
        charged: list[WorkerId] = []
        pool = self.scheduler.pool
        try:
            for i, sid in enumerate(self.sessions.bound_to(worker)):
                if i % _YIELD_EVERY == _YIELD_EVERY - 1:
                    await asyncio.sleep(0)  # keep serving requests meanwhile
                current = self.sessions.get(sid)
                if current is None or current.worker_id != worker:
                    continue  # expired, or another replica already moved it
                request = RouteRequest(model=current.binding.model, session_id=sid)
                try:
                    decision = self.scheduler.decide(request, worker)
                except RouterError as exc:
                    log.warning("cannot rebind sessions of %s: %s", worker, exc)
                    break
                pool.charge(decision.worker, 0)
                charged.append(decision.worker)
                try:
                    won, _ = await self.sessions.bind(
                        sid, decision.worker, current.binding.model, expected=current,
                        reason=RouteReason.FAILOVER.value, restore_from=worker)
                except RouterError as exc:
                    log.warning("rebinding %s failed: %s", sid, exc)
                    continue
                if won:
                    moved += 1
                    self.metrics.rebinds.labels(RouteReason.FAILOVER.value).inc()
                else:
                    self.metrics.cas_conflicts.inc()
        finally:
            for w in charged:
                pool.release(w, 0)
        if moved:
            log.warning("rebound %d sessions of dead worker %s", moved, worker)
        return moved

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
