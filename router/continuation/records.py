"""Where a session's conversation is kept between turns: its token ids, in the kvkeep store.

A record is a `SessionManifest` (checksummed, bound to its key, ordered by generation) under a
fingerprint of the router's own (`conversation_fingerprint`: the model name, layout
"conversation"), so it can never be mistaken for KV blocks or for the connector's manifests.
Its `token_ids` are the conversation exactly as the worker processed it: the last prompt's ids
plus the ids generated for it, without a final stop token (the chat template marks the end of
a turn its own way; a stop token's KV is never computed, so dropping it costs no cache).

Why the router writes its own record rather than reading the connector's manifest: the
connector keys its manifest by a fingerprint the router cannot know (it depends on the
engine's KV layout and weights; streamed answers carry no `kv_transfer_params` to learn it
from), writes it only when a full block is checkpointed (the end of an answer is missing), and
writes it after the answer reached the client (a turn sent at once would find the previous
one). The router knows the exact ids at the end of every turn and writes them before the
client sees that end, so the next turn, on any replica, finds them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Protocol

from kvstore.keys import ModelFingerprint, Namespace, SessionId, SessionKey
from kvstore.manifest import SessionManifest
from kvstore.store import TieredStore
from kvstore.store.aio import AsyncTieredStore
from kvstore.tiers.factory import RemoteSpec
from router.tenants import DEFAULT_TENANT

__all__ = ["Conversation", "ConversationRecords", "StoreRecords", "MemoryRecords",
           "conversation_fingerprint", "record_scope"]


def record_scope(model: str, tenant: str) -> str:
    """What a conversation record is filed under: the served model and the API tenant that owns
    the session, so two tenants using the same session id never read each other's history
    (the router's store tenant, the daemons' namespace, is one for all API tenants)."""
    return model if tenant == DEFAULT_TENANT else f"{model}\x1ftenant={tenant}"


def conversation_fingerprint(model: str) -> ModelFingerprint:
    """The fingerprint a model's conversation records are keyed by: its served name only (the
    tokenizer is the model's), and a layout no KV block has."""
    return ModelFingerprint(model_id=model, weights_digest="kvkeep-router-conversation/v1",
                            dtype="token-ids", num_layers=1, num_kv_heads=1, head_size=1,
                            block_size=1, layout_id="conversation", codec="token-ids")


class Conversation:
    """A stored conversation: its token ids and the generation they were written with."""

    __slots__ = ("generation", "tokens")

    def __init__(self, tokens: tuple[int, ...], generation: int) -> None:
        self.tokens = tokens
        self.generation = generation


class ConversationRecords(Protocol):
    async def get(self, model: str, session: SessionId) -> Conversation | None: ...

    async def put(self, model: str, session: SessionId, tokens: Sequence[int],
                  after: int = 0) -> int:
        """Store; returns the generation written (above `after` and the wall clock)."""
        ...

    async def delete(self, model: str, session: SessionId) -> None: ...

    async def close(self) -> None: ...


def _generation(after: int) -> int:
    return max(after + 1, time.time_ns() // 1000)


class StoreRecords:
    """Records in kvstore daemons (a remote tier: found through etcd or listed, R replicas),
    under the router's store tenant."""

    def __init__(self, spec: RemoteSpec, tenant: str) -> None:
        self._namespace = Namespace(tenant)
        self._store = AsyncTieredStore(TieredStore.from_specs([spec]))

    def _key(self, model: str, session: SessionId) -> SessionKey:
        return SessionKey.of(conversation_fingerprint(model), self._namespace, session)

    async def get(self, model: str, session: SessionId) -> Conversation | None:
        manifest = await self._store.get_manifest(self._key(model, session))
        return None if manifest is None else Conversation(manifest.token_ids,
                                                          manifest.generation)

    async def put(self, model: str, session: SessionId, tokens: Sequence[int],
                  after: int = 0) -> int:
        generation = _generation(after)
        ids = tuple(tokens)
        await self._store.put_manifest(SessionManifest(
            key=self._key(model, session), block_hashes=(), token_count=len(ids),
            generation=generation, token_ids=ids))
        return generation

    async def delete(self, model: str, session: SessionId) -> None:
        await self._store.delete_manifest(self._key(model, session))

    async def close(self) -> None:
        await self._store.close()


class MemoryRecords:
    """Records in this process (tests; one replica, lost on restart)."""

    def __init__(self) -> None:
        self._records: dict[tuple[str, SessionId], Conversation] = {}

    async def get(self, model: str, session: SessionId) -> Conversation | None:
        await asyncio.sleep(0)
        return self._records.get((model, session))

    async def put(self, model: str, session: SessionId, tokens: Sequence[int],
                  after: int = 0) -> int:
        generation = _generation(after)
        self._records[(model, session)] = Conversation(tuple(tokens), generation)
        return generation

    async def delete(self, model: str, session: SessionId) -> None:
        self._records.pop((model, session), None)

    async def close(self) -> None:
        self._records.clear()
