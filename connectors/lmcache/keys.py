"""LMCache object keys as kvkeep block keys.

LMCache names a stored object by (model name, KV rank, object group, cache salt, chunk hash).
kvkeep names a block by (16-byte scope fingerprint, Namespace(tenant, salt), block hash). The
mapping:

- fingerprint: a blake2b-128 digest of the model name, the plugin's `model_revision` and the
  object format below. Its canonical JSON carries `"kind": "lmcache-object"`, a field no
  `ModelFingerprint` has, so an LMCache scope never shares blocks with a vLLM connector's
  fingerprint. KV rank and object group are *not* part of it: they go into the block hash, so
  that every object of one model shares a scope and a batch is one request per daemon whatever
  ranks and groups it mixes (LMCache's own benchmark gives every key its own `kv_rank`; with
  the rank in the scope, a lookup of 32 keys was 32 round trips, 8 ms instead of 0.5).
  Mapping version 2: objects stored under version 1 (rank and group in the scope) are misses.
- namespace: the plugin's tenant (what its token may touch) and LMCache's cache salt. A salt
  that is already a valid kvkeep name is used as is; any other salt (LMCache allows 128
  characters of almost anything) becomes `h.` + a digest of it. Salts starting with `h.` are
  always digested, so two different salts can never map to the same namespace.
- block hash: LMCache's chunk hash (kept when it is at most 51 bytes, else a 51-byte digest of
  it), then the KV rank (8 bytes), the object group (4 bytes) and one byte saying which of the
  two the chunk hash is: a fixed-width tail, so the mapping is one-to-one (up to digest
  collisions among chunk hashes longer than 51 bytes).

Nothing here imports LMCache: `ObjectRef` carries the fields of its `ObjectKey`, and anything
with those fields (`ObjectName`, LMCache's `ObjectKey` itself) is mapped alike.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.errors import InvalidKey
from kvstore.keys import MAX_BLOCK_HASH_BYTES, BlockHash, BlockKey, Namespace

__all__ = ["OBJECT_FORMAT", "ObjectName", "ObjectRef", "ScopeMapper", "salt_name",
           "block_hash_of"]

OBJECT_FORMAT = "lmcache-bytes/1"
"""The frame layout id of an LMCache object stored in kvkeep (one raw segment)."""

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DIGEST_SALT_PREFIX = "h."
_MAPPING_VERSION = 2
MAPPED_KEYS_KEPT = 8192
"""Block keys a `ScopeMapper` remembers (about 4 MiB): LMCache maps the same object for its
store, then for every lookup and load of it, and one mapping costs 5.3 us (measured: the
block hash, a `BlockKey` and its blake2b digest) against 0.25 us to find it again."""
_TAIL_BYTES = 8 + 4 + 1
"""kv_rank (u64), object_group_id (u32), and whether the chunk hash was digested (one byte)."""
_MAX_RAW_CHUNK_HASH = MAX_BLOCK_HASH_BYTES - _TAIL_BYTES


class ObjectName(Protocol):
    """What names one LMCache object: an `ObjectRef`, or LMCache's own `ObjectKey` (the same
    fields), which the adapter passes as it is (building a copy of each cost 1.8 us)."""

    @property
    def chunk_hash(self) -> bytes: ...
    @property
    def model_name(self) -> str: ...
    @property
    def kv_rank(self) -> int: ...
    @property
    def object_group_id(self) -> int: ...
    @property
    def cache_salt(self) -> str: ...


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """The fields of one LMCache `ObjectKey`."""

    chunk_hash: bytes
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""


@dataclass(slots=True)
class ScopeMapper:
    """Maps `ObjectName`s to `BlockKey`s for one tenant; caches the per-scope work.

    Not frozen: it memoises fingerprints and namespaces (a few per process), and the block keys
    of the last `MAPPED_KEYS_KEPT` objects mapped (oldest out first). Thread-safe: a lookup of a
    remembered key takes no lock, an insert takes one.
    """

    tenant: str
    model_revision: str = ""
    _fingerprints: dict[str, bytes] = field(default_factory=dict, repr=False)
    _namespaces: dict[str, Namespace] = field(default_factory=dict, repr=False)
    _keys: OrderedDict[ObjectName, BlockKey] = field(default_factory=OrderedDict, repr=False)
    _inserting: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        Namespace(self.tenant)  # validates the tenant (raises InvalidKey)

    def key(self, ref: ObjectName) -> BlockKey:
        """The block key of one object; raises InvalidKey for an unusable LMCache key."""
        try:
            key = self._keys.get(ref)
        except (TypeError, ValueError):  # an unhashable chunk hash (a bytearray, a writable
            # memoryview): mapped every time
            return self._map(ref)
        if key is None:
            key = self._map(ref)
            with self._inserting:
                self._keys[ref] = key
                while len(self._keys) > MAPPED_KEYS_KEPT:
                    self._keys.popitem(last=False)
        return key

    def _map(self, ref: ObjectName) -> BlockKey:
        return BlockKey(self.fingerprint(ref.model_name), self.namespace(ref.cache_salt),
                        block_hash_of(ref.chunk_hash, ref.kv_rank, ref.object_group_id))

    def keys(self, refs: Sequence[ObjectName]) -> list[BlockKey]:
        return [self.key(ref) for ref in refs]

    def fingerprint(self, model_name: str) -> bytes:
        digest = self._fingerprints.get(model_name)
        if digest is None:
            if not model_name:
                raise InvalidKey("LMCache key without a model name")
            canonical = json.dumps(
                {"v": _MAPPING_VERSION, "kind": "lmcache-object", "model_name": model_name,
                 "model_revision": self.model_revision, "format": OBJECT_FORMAT},
                sort_keys=True, separators=(",", ":")).encode()
            digest = hashlib.blake2b(canonical, digest_size=16).digest()
            self._fingerprints[model_name] = digest
        return digest

    def namespace(self, cache_salt: str) -> Namespace:
        ns = self._namespaces.get(cache_salt)
        if ns is None:
            ns = Namespace(self.tenant, salt_name(cache_salt))
            self._namespaces[cache_salt] = ns
        return ns


def salt_name(cache_salt: str) -> str:
    """LMCache's cache salt as a valid, injective kvkeep salt ("" stays "")."""
    if not cache_salt:
        return ""
    if _NAME_RE.fullmatch(cache_salt) and not cache_salt.startswith(_DIGEST_SALT_PREFIX):
        return cache_salt
    digest = hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=24)
    return _DIGEST_SALT_PREFIX + digest.hexdigest()


def block_hash_of(chunk_hash: bytes, kv_rank: int = 0, object_group_id: int = 0
                  ) -> BlockHash:
    """LMCache's chunk hash, KV rank and object group as one kvkeep block hash (14-64 bytes)."""
    if not isinstance(chunk_hash, bytes | bytearray | memoryview):
        raise InvalidKey(f"LMCache chunk hash must be bytes, not {type(chunk_hash).__name__}")
    if not 0 <= kv_rank < 1 << 64 or not 0 <= object_group_id < 1 << 32:
        raise InvalidKey("LMCache kv_rank must be 0..2**64-1 and object_group_id 0..2**32-1")
    raw = bytes(chunk_hash)
    if not raw:
        raise InvalidKey("empty LMCache chunk hash")
    digested = len(raw) > _MAX_RAW_CHUNK_HASH
    if digested:
        raw = hashlib.blake2b(raw, digest_size=_MAX_RAW_CHUNK_HASH).digest()
    return BlockHash(raw + kv_rank.to_bytes(8, "big") + object_group_id.to_bytes(4, "big")
                     + (b"\x01" if digested else b"\x00"))
