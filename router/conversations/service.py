"""Stateful continuation: a client sends only the new turn and its session id; the router
rebuilds the prompt from the session's conversation record (`records.py`) and the new turn
rendered by the model's own template (`render.py`), token for token what the worker's KV
holds, and records the conversation again at the end of every session turn.

Asked with `"continue_session": true` in the body or the `X-KVKeep-Continue: 1` header, on
`/v1/chat/completions` (the new messages) or `/v1/completions` (the new text or token ids).
A chat continuation goes to the worker as a chat request carrying the prompt's ids in
`kv_transfer_params.prompt_token_ids` (vLLM then skips templating and tokenizing, and still
answers, parses tools and streams as chat); a completions one with the ids as its prompt.

Every session turn that ends whole is recorded before its end reaches the client (a unary
reply's body, a stream's last bytes), so a continuation sent the moment the answer ends, to
any replica, finds it. A turn that cannot be recorded (no token ids, `n` > 1, the store
failing) leaves an empty record in its place (a tombstone, newer than the turn before; a
delete when even that cannot be written): the next continuation then gets a 409 rather than a
conversation that misses the turn.

A record is used only when it verifies under the router's record key (`records.py`: a forged
or moved record is a 409) and is not older than the last generation this replica wrote or read
for the session (a daemon that missed the last write, or a replayed old record, is a 409, not a
conversation that silently lacks a turn; trust-review H7). Another replica's knowledge is not
shared: a replica that has not seen the session takes the newest record the store gives.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from prometheus_client import Counter

from kvstore.errors import ForgedBlock, KVKeepError
from kvstore.keys import SessionId
from router.conversations.records import ConversationRecords, generation_after, record_scope
from router.conversations.render import TokenizeFailed, TurnRenderer, token_ids
from router.core import RouterCore
from router.errors import BadRequest, HistoryUnavailable, UpstreamError
from router.front.api import ClientRequest, Endpoint

__all__ = ["CONTINUE_HEADER", "CONTINUE_FIELD", "HISTORY_HEADER", "TurnEnd", "Continuations",
           "asks_continuation", "conversation_tokens"]

log = logging.getLogger(__name__)

CONTINUE_HEADER = "X-KVKeep-Continue"
CONTINUE_FIELD = "continue_session"
HISTORY_HEADER = "X-KVKeep-History-Tokens"
"""On a recorded turn's reply: the conversation's length in tokens, as recorded."""
_TRUE = frozenset({"1", "true", "yes"})
_MAX_GENERATIONS = 65536
_TOKENIZE_TRIES = 3


def asks_continuation(creq: ClientRequest, header: str | None) -> bool:
    """Whether the request asks to continue its session; removes the body field (it is the
    router's, never the worker's)."""
    field = creq.body.pop(CONTINUE_FIELD, None)
    if field is not None and not isinstance(field, bool):
        raise BadRequest(f"`{CONTINUE_FIELD}` must be a boolean", param=CONTINUE_FIELD)
    return bool(field) or (header is not None and header.strip().lower() in _TRUE)


@dataclass(frozen=True, slots=True)
class TurnEnd:
    """How the worker ended the answer (`finish_reason`, `stop_reason` of its first choice)."""

    finish_reason: str | None
    stop_reason: int | str | None = None

    @property
    def on_stop_token(self) -> bool:
        """Ended by a stop token (EOS or one of `stop_token_ids`), which vLLM returns as the
        last output id; a stop string leaves ordinary ids."""
        return self.finish_reason == "stop" and not isinstance(self.stop_reason, str)

    @classmethod
    def of_reply(cls, obj: dict[str, Any]) -> TurnEnd:
        choices = obj.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        if not isinstance(first, dict):
            return cls(None)
        stop = first.get("stop_reason")
        return cls(first.get("finish_reason"), stop if isinstance(stop, int | str) else None)


def conversation_tokens(prompt: Sequence[int], output: Sequence[int], end: TurnEnd
                        ) -> list[int]:
    """What a turn leaves of the conversation: prompt + answer, less a final stop token."""
    tokens = [*prompt, *output]
    if end.on_stop_token and output:
        tokens.pop()
    return tokens


class Continuations:
    """Rebuilds continuations and records turns for one router replica."""

    def __init__(self, records: ConversationRecords, core: RouterCore,
                 http: aiohttp.ClientSession) -> None:
        self.records = records
        self.core = core
        self.renderer = TurnRenderer(http)
        # The last generation seen per (scope, session), so a continuation's record outranks
        # the one it was rebuilt from even if this host's clock is behind the writer's, and an
        # older record than one seen is known to be stale.
        self._generations: OrderedDict[tuple[str, SessionId], int] = OrderedDict()
        registry = core.metrics.registry
        self.rebuilds = Counter("kvkeep_router_continuations",
                                "Stateful continuations, by outcome", ["outcome"],
                                registry=registry)
        self.writes = Counter("kvkeep_router_conversation_records",
                              "Conversation records at the end of session turns, by outcome",
                              ["outcome"], registry=registry)

    async def close(self) -> None:
        await self.records.close()

    # --- a continuation ---------------------------------------------------------------------
    async def rebuild(self, creq: ClientRequest) -> ClientRequest:
        """`creq` with the whole prompt: the recorded conversation + the new turn. Raises
        `HistoryUnavailable` (409) when there is no usable record."""
        sid = creq.session_id
        if sid is None:
            raise BadRequest("a continuation needs a session id (X-Session-Id or session_id)",
                             param="session_id")
        new_turn = self._new_turn(creq)
        scope = record_scope(creq.model, creq.tenant)
        try:
            record = await self.records.get(scope, sid)
        except ForgedBlock as exc:
            self.rebuilds.labels("forged").inc()
            log.warning("conversation record of %s refused: %s", sid, exc)
            raise HistoryUnavailable(
                f"the stored history of session {sid!r} is not one this router wrote (it "
                "fails its integrity check); resend the whole conversation") from exc
        except KVKeepError as exc:
            self.rebuilds.labels("store_error").inc()
            raise HistoryUnavailable(
                f"the history of session {sid!r} cannot be read from the store ({exc}); "
                "resend the whole conversation") from exc
        if record is None or not record.tokens:
            self.rebuilds.labels("no_history").inc()
            raise HistoryUnavailable(
                f"no history of session {sid!r} for model {creq.model!r} is stored (never "
                "recorded, expired or lost); resend the whole conversation")
        known = self._generations.get((scope, sid), 0)
        if record.generation < known:
            self.rebuilds.labels("stale").inc()
            raise HistoryUnavailable(
                f"the stored history of session {sid!r} is older than its last recorded turn "
                "(a store that missed a write); resend the whole conversation")
        self._remember(scope, sid, record.generation)
        suffix = await self._render(creq, sid, new_turn)
        prompt = (*record.tokens, *suffix)
        body = dict(creq.body)
        if creq.endpoint is Endpoint.COMPLETIONS:
            body["prompt"] = list(prompt)
        self.rebuilds.labels("rebuilt").inc()
        return replace(creq, body=body, prompt_tokens=prompt,
                       prompt_text=" ".join(map(str, prompt)))

    def _new_turn(self, creq: ClientRequest) -> Any:
        if creq.endpoint is Endpoint.CHAT:
            messages = creq.body["messages"]
            for message in messages:
                content = message.get("content")
                if isinstance(content, list) and any(
                        not isinstance(p, dict) or p.get("type") != "text" for p in content):
                    # vLLM renders messages with media itself, ignoring forwarded ids.
                    raise BadRequest("a continuation's messages may hold text only",
                                     param="messages")
            return messages
        prompt = creq.body.get("prompt")
        if isinstance(prompt, str) or token_ids(prompt) is not None:
            return prompt
        raise BadRequest("a completions continuation takes one prompt: a string or token ids",
                         param="prompt")

    async def _render(self, creq: ClientRequest, sid: SessionId, new_turn: Any) -> list[int]:
        if creq.endpoint is Endpoint.COMPLETIONS and not isinstance(new_turn, str):
            return list(new_turn)
        last = "no usable worker"
        for url in self._tokenizers(creq.model, sid)[:_TOKENIZE_TRIES]:
            try:
                if creq.endpoint is Endpoint.CHAT:
                    return await self.renderer.chat_suffix(url, creq.model, creq.body)
                return await self.renderer.text_tokens(url, creq.model, new_turn)
            except TokenizeFailed as exc:
                last = str(exc)
        raise UpstreamError(f"no worker could render the new turn ({last})")

    def _tokenizers(self, model: str, sid: SessionId) -> list[str]:
        """Workers to tokenize with: the session's own first (its template is the one that
        will run), then any usable worker serving the model."""
        bound = self.core.session(sid)
        states = [s for s in self.core.workers()
                  if model in s.info.models and self.core.usable(s)]
        states.sort(key=lambda s: bound is None or s.worker_id != bound.worker_id)
        return [s.info.url for s in states]

    # --- the end of a turn ------------------------------------------------------------------
    async def record(self, creq: ClientRequest, prompt: Sequence[int] | None,
                     output: Sequence[int] | None, end: TurnEnd) -> int | None:
        """Record the session's conversation after a whole turn; the tokens recorded, or None
        (no session, or the record was deleted because this turn cannot be recorded)."""
        sid = creq.session_id
        if sid is None:
            return None
        n = creq.body.get("n")
        scope = record_scope(creq.model, creq.tenant)
        if prompt is None or output is None or (isinstance(n, int) and n > 1):
            await self._forget(scope, sid, "unrecordable")
            return None
        tokens = conversation_tokens(prompt, output, end)
        try:
            generation = await self.records.put(scope, sid, tokens,
                                                after=await self._after(scope, sid))
        except KVKeepError as exc:
            log.warning("conversation of %s not recorded: %s", sid, exc)
            await self._forget(scope, sid, "failed")
            return None
        self._remember(scope, sid, generation)
        self.writes.labels("written").inc()
        return len(tokens)

    async def _after(self, scope: str, sid: SessionId) -> int:
        """The generation a new record must pass: the last this replica saw, or for a session
        it has not seen, the stored record's (one read), so a record written by a replica
        whose clock runs ahead, or a forged one, cannot make the daemons keep it over this
        turn's (they keep the higher generation) while the client is told it was recorded."""
        known = self._generations.get((scope, sid))
        if known is not None:
            return known
        try:
            return await self.records.stored_generation(scope, sid)
        except KVKeepError as exc:  # the put will say whether the store is there
            log.info("conversation of %s: stored generation unknown (%s)", sid, exc)
            return 0

    async def _forget(self, scope: str, sid: SessionId, outcome: str) -> None:
        """Leave no record of the session older than now usable: an empty one (a tombstone:
        it outranks, and is repaired over, any copy a daemon kept), else a delete; and never
        accept an older one here again."""
        self.writes.labels(outcome).inc()
        # A store that just failed a write is not asked again for what it holds.
        after = self._generations.get((scope, sid), 0) if outcome == "failed" \
            else await self._after(scope, sid)
        try:
            generation = await self.records.put(scope, sid, (), after=after)
        except KVKeepError as exc:
            generation = generation_after(after)
            log.warning("conversation of %s: no tombstone written (%s); deleting", sid, exc)
            try:
                await self.records.delete(scope, sid)
            except KVKeepError as exc2:
                log.warning("stale conversation of %s not deleted: %s", sid, exc2)
        self._remember(scope, sid, generation)

    def _remember(self, scope: str, sid: SessionId, generation: int) -> None:
        key = (scope, sid)
        self._generations[key] = max(generation, self._generations.get(key, 0))
        self._generations.move_to_end(key)
        if len(self._generations) > _MAX_GENERATIONS:
            self._generations.popitem(last=False)
