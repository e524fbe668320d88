"""Where a session's conversation is kept between turns: its token ids, in the kvkeep store.

A record is a `ConversationRecord` (kvstore/manifest.py): a type of its own, not a KV session
manifest. Its bytes carry a kind and version tag and a checksum, it is bound to its key, and it
holds the scope, the session, the generation and the token ids with the router's MAC; no block
hashes and no model layout. The KV manifest decoder refuses its bytes and its decoder refuses a
manifest's (`CorruptBlock`), so neither can be read as the other. Its `token_ids` are the
conversation exactly as the worker processed it: the last prompt's ids plus the ids generated
for it, without a final stop token (the chat template marks the end of a turn its own way; a
stop token's KV is never computed, so dropping it costs no cache).

Why it is still filed under a `SessionKey` and stored by the daemons' manifest calls: those
are what the daemons, their tiers and the remote tier already have for a small, checksummed
record per session that replicates, repairs and never rolls back (the highest generation
wins), with per-tenant budgets. The daemons parse out of a record only its key (the tenant is
checked against the caller's token) and its generation (ordering, and a cap on how far ahead
of the clock it may be), the same checks for both kinds. The key's 16-byte fingerprint is a
key component of its own here (`SessionKey.conversation`): a digest of the record's scope,
personalised so it is never a `ModelFingerprint` digest. A conversation has no KV layout to
name; the scope is what a record is filed under, and the record carries it, so its key is
derived from what it holds and cannot disagree with it.

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
record's `mac`. A record without a valid MAC (forged, or moved to another session or tenant)
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

Records of the previous version (a `SessionManifest` under a made-up `ModelFingerprint`,
layout "conversation", MAC'd as v1) may still sit in a running store. They are under other
keys (that fingerprint's digest, not the scope's), so this version never looks them up: a
continuation of a session last recorded before the upgrade finds no record, a 409
`history_unavailable` (the client resends the whole conversation, which is recorded anew), and
the old records stay until the daemons' manifest budgets evict them. Should a manifest ever sit
under a conversation key (copied there by a store token holder), reading it is `CorruptBlock`
(`expect_kind`), also a 409, and a new turn still outranks its generation. Upgrade the daemons
first: an older daemon refuses a conversation record's bytes as a bad manifest, so the router's
writes fail and its continuations are 409s until it is upgraded, never a wrong history. Router
replicas of the two versions do not read each other's records (a 409 across them).
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
from dataclasses import replace
from typing import Protocol

from kvstore.errors import ForgedBlock
from kvstore.keys import Namespace, SessionId, SessionKey
from kvstore.mac import MacKey
from kvstore.manifest import ConversationRecord, expect_kind
from kvstore.store import TieredStore
from kvstore.store.aio import AsyncTieredStore
from kvstore.tiers.factory import RemoteSpec
from router.tenants import DEFAULT_TENANT

__all__ = ["Conversation", "ConversationRecords", "StoreRecords", "MemoryRecords", "RecordKey",
           "generation_after", "record_scope"]

log = logging.getLogger(__name__)

# v2: the MAC of a `ConversationRecord` under its scope's key; a v1 MAC (a record that was a
# SessionManifest under a made-up fingerprint) never verifies as one.
_MAC_PERSON = b"kvkeep-conversation-record/v2\x00"
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

    def sign(self, record: ConversationRecord) -> ConversationRecord:
        """`record` with this key's MAC."""
        return replace(record, mac=self.tag(record.key, record.scope, record.generation,
                                            record.token_ids))

    def check(self, record: ConversationRecord, scope: str) -> None:
        """ForgedBlock unless `record` carries this key's MAC for `scope`."""
        if not record.mac:
            raise ForgedBlock("the conversation record is not signed")
        expected = self.tag(record.key, scope, record.generation, record.token_ids)
        if not hmac.compare_digest(record.mac, expected):
            raise ForgedBlock("the conversation record's MAC does not verify under the "
                              "router's record key (forged, moved, or another key's)")


def record_scope(model: str, tenant: str) -> str:
    """What a conversation record is filed under: the served model and the API tenant that owns
    the session, so two tenants using the same session id never read each other's history
    (the router's store tenant, the daemons' namespace, is one for all API tenants)."""
    return model if tenant == DEFAULT_TENANT else f"{model}\x1ftenant={tenant}"


class Conversation:
    """A stored conversation: its token ids and the generation they were written with."""

    __slots__ = ("generation", "tokens")

    def __init__(self, tokens: tuple[int, ...], generation: int) -> None:
        self.tokens = tokens
        self.generation = generation


class ConversationRecords(Protocol):
    """Conversations by `scope` (`record_scope`: the served model and the API tenant) and
    session id."""

    async def get(self, scope: str, session: SessionId) -> Conversation | None: ...

    async def put(self, scope: str, session: SessionId, tokens: Sequence[int],
                  after: int = 0) -> int:
        """Store; returns the generation written (above `after` and the wall clock)."""
        ...

    async def delete(self, scope: str, session: SessionId) -> None: ...

    async def stored_generation(self, scope: str, session: SessionId) -> int:
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
    see the module docstring). `get` raises ForgedBlock for a record `key` did not sign, and
    CorruptBlock for anything under the key that is not a conversation record."""

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

    def _key(self, scope: str, session: SessionId) -> SessionKey:
        return SessionKey.conversation(scope, self._namespace, session)

    async def get(self, scope: str, session: SessionId) -> Conversation | None:
        found = await self._store.get_record(self._key(scope, session))
        record = expect_kind(found, ConversationRecord)
        if record is None:
            return None
        self._mac.check(record, scope)
        return Conversation(record.token_ids, record.generation)

    async def put(self, scope: str, session: SessionId, tokens: Sequence[int],
                  after: int = 0) -> int:
        generation = generation_after(after)
        await self._store.put_manifest(self._mac.sign(ConversationRecord(
            scope, self._namespace, session, generation, tuple(tokens))))
        return generation

    async def delete(self, scope: str, session: SessionId) -> None:
        await self._store.delete_manifest(self._key(scope, session))

    async def stored_generation(self, scope: str, session: SessionId) -> int:
        # Any kind: the daemons keep the higher generation whatever the kind of either.
        found = await self._store.get_record(self._key(scope, session))
        return 0 if found is None else found.generation

    async def close(self) -> None:
        await self._store.close()


class MemoryRecords:
    """Records in this process (tests; one replica, lost on restart)."""

    def __init__(self) -> None:
        self._records: dict[tuple[str, SessionId], Conversation] = {}

    async def get(self, scope: str, session: SessionId) -> Conversation | None:
        await asyncio.sleep(0)
        return self._records.get((scope, session))

    async def put(self, scope: str, session: SessionId, tokens: Sequence[int],
                  after: int = 0) -> int:
        generation = generation_after(after)
        self._records[(scope, session)] = Conversation(tuple(tokens), generation)
        return generation

    async def delete(self, scope: str, session: SessionId) -> None:
        self._records.pop((scope, session), None)

    async def stored_generation(self, scope: str, session: SessionId) -> int:
        found = self._records.get((scope, session))
        return 0 if found is None else found.generation

    async def close(self) -> None:
        self._records.clear()
