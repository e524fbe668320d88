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

Who may write them (trust-review H7). The daemons believe any holder of the records' store
token, and every daemon (they hold `*`), so a record is believed only under the router's own
key (`RecordKey`, `--store-record-key-file`): an HMAC-SHA256 over the store key, the record's
scope (model and API tenant), the session id, the generation and the token ids, kept in the
manifest's `mac`. A record without a valid MAC (forged, or moved to another session or tenant)
is `ForgedBlock`: never used, the continuation is a 409 `history_unavailable`. The key must be
the same on every replica (a file); without one each process draws its own, and then a
continuation that reaches another replica, or this one after a restart, is a 409 (the client
resends the whole conversation), never a record the router cannot vouch for. The records live
under a store tenant of their own (`config.py` refuses the connectors' `default`). The MAC
vouches for who wrote a record, not that it is the latest: a store token holder can still
replay an older record of the same session, or delete one; `Continuations` refuses a record
older than the last this replica wrote or read, and a turn that cannot be recorded leaves a
newer, empty record (a tombstone) rather than only a delete that an unreachable daemon misses.
The token ids are not encrypted: a store token holder can still read them.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Protocol

from kvstore.errors import ForgedBlock
from kvstore.keys import ModelFingerprint, Namespace, SessionId, SessionKey
from kvstore.mac import MacKey
from kvstore.manifest import SessionManifest
from kvstore.store import TieredStore
from kvstore.store.aio import AsyncTieredStore
from kvstore.tiers.factory import RemoteSpec
from router.tenants import DEFAULT_TENANT

__all__ = ["Conversation", "ConversationRecords", "StoreRecords", "MemoryRecords", "RecordKey",
           "conversation_fingerprint", "generation_after", "record_scope"]

log = logging.getLogger(__name__)

_MAC_PERSON = b"kvkeep-conversation-record/v1\x00"
_DUMPS = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True).encode


class RecordKey:
    """The router's secret that conversation records are signed with (kvstore/mac.py's key
    file format: hex or raw bytes, at least 32)."""

    __slots__ = ("_secret", "generated")

    def __init__(self, secret: bytes, *, generated: bool = False) -> None:
        self._secret = MacKey(secret).secret  # the same length checks as the frames' keys
        self.generated = generated

    @classmethod
    def generate(cls) -> RecordKey:
        """A key of this process alone (no key file): records it writes are believed by it
        only, until it restarts."""
        return cls(os.urandom(32), generated=True)

    def __repr__(self) -> str:
        return f"RecordKey(generated={self.generated})"

    def tag(self, key: SessionKey, scope: str, generation: int, tokens: Sequence[int]) -> bytes:
        """The MAC binding a record to its store key, scope (model and API tenant), session,
        generation and token ids."""
        mac = hmac.new(self._secret, _MAC_PERSON, hashlib.sha256)
        mac.update(_DUMPS([key.fingerprint.hex(), key.namespace.label, key.session_id, scope,
                           generation]).encode())
        mac.update(b"\x00")
        mac.update(_DUMPS(list(tokens)).encode())
        return mac.digest()

    def check(self, manifest: SessionManifest, scope: str) -> None:
        """ForgedBlock unless `manifest` carries this key's MAC for `scope`."""
        if not manifest.mac:
            raise ForgedBlock("the conversation record is not signed")
        expected = self.tag(manifest.key, scope, manifest.generation, manifest.token_ids)
        if not hmac.compare_digest(manifest.mac, expected):
            raise ForgedBlock("the conversation record's MAC does not verify under the "
                              "router's record key (forged, moved, or another key's)")


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

    async def stored_generation(self, model: str, session: SessionId) -> int:
        """The generation of the record stored now (0: none), signed or not: a write must
        outrank it to be kept, whoever wrote it and whatever clock they had."""
        ...

    async def close(self) -> None: ...


def generation_after(after: int) -> int:
    """A record's generation: above `after` and the wall clock (µs)."""
    return max(after + 1, time.time_ns() // 1000)


class StoreRecords:
    """Records in kvstore daemons (a remote tier: found through etcd or listed, R replicas),
    under the router's store tenant, signed with `key` (None: a key of this process only,
    see the module docstring). `get` raises ForgedBlock for a record `key` did not sign."""

    def __init__(self, spec: RemoteSpec, tenant: str, *, key: RecordKey | None = None) -> None:
        self._namespace = Namespace(tenant)
        self._store = AsyncTieredStore(TieredStore.from_specs([spec]))
        if key is None:
            log.warning("conversation records: no --store-record-key-file, so this process "
                        "signs them with a key of its own: a continuation that reaches another "
                        "replica, or this one after a restart, is a 409 (give every replica "
                        "the same key file)")
            key = RecordKey.generate()
        self._mac = key

    def _key(self, model: str, session: SessionId) -> SessionKey:
        return SessionKey.of(conversation_fingerprint(model), self._namespace, session)

    async def get(self, model: str, session: SessionId) -> Conversation | None:
        manifest = await self._store.get_manifest(self._key(model, session))
        if manifest is None:
            return None
        self._mac.check(manifest, model)
        return Conversation(manifest.token_ids, manifest.generation)

    async def put(self, model: str, session: SessionId, tokens: Sequence[int],
                  after: int = 0) -> int:
        generation = generation_after(after)
        ids = tuple(tokens)
        key = self._key(model, session)
        await self._store.put_manifest(SessionManifest(
            key=key, block_hashes=(), token_count=len(ids), generation=generation,
            token_ids=ids, mac=self._mac.tag(key, model, generation, ids)))
        return generation

    async def delete(self, model: str, session: SessionId) -> None:
        await self._store.delete_manifest(self._key(model, session))

    async def stored_generation(self, model: str, session: SessionId) -> int:
        manifest = await self._store.get_manifest(self._key(model, session))
        return 0 if manifest is None else manifest.generation

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
        generation = generation_after(after)
        self._records[(model, session)] = Conversation(tuple(tokens), generation)
        return generation

    async def delete(self, model: str, session: SessionId) -> None:
        self._records.pop((model, session), None)

    async def stored_generation(self, model: str, session: SessionId) -> int:
        found = self._records.get((model, session))
        return 0 if found is None else found.generation

    async def close(self) -> None:
        self._records.clear()
