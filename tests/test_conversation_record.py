"""Conversation records (issue 20): a record type of their own, not a KV session manifest under
a made-up fingerprint. Unit tests of the type (round trip, checksum, key binding, each decoder
refusing the other's bytes, the previous version's records) and, with a real kvstore daemon
(memory and nvme tiers), that the daemons' session-record calls store, order, check and serve
it as they do manifests."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from deploy.local.daemons import DaemonProcess, running_daemon
from kvstore.errors import ConfigError, CorruptBlock, InvalidKey, TierError
from kvstore.keys import (
    BlockHash,
    ModelFingerprint,
    Namespace,
    SessionId,
    SessionKey,
    conversation_scope_digest,
)
from kvstore.manifest import (
    CONVERSATION_TAG,
    ConversationRecord,
    SessionManifest,
    decode_session_record,
    expect_kind,
)
from kvstore.store import TieredStore
from kvstore.tiers.factory import RemoteSpec

TENANT = Namespace("conversations")
SCOPE = "fake-model\x1ftenant=alice"
TOKEN = "token-conversations-0123456789"
OTHER_TOKEN = "token-other-tenant-0123456789"
TIMEOUT = 5.0


def _record(sid: str = "s1", tokens: tuple[int, ...] = (1, 2, 3), generation: int = 7,
            mac: bytes = b"\x01" * 32) -> ConversationRecord:
    return ConversationRecord(SCOPE, TENANT, SessionId(sid), generation, tokens, mac)


def _manifest(key: SessionKey, generation: int = 7) -> SessionManifest:
    return SessionManifest(key, (BlockHash(b"a" * 32),), token_count=16, generation=generation,
                           token_ids=tuple(range(16)))


def _legacy_fingerprint(scope: str) -> ModelFingerprint:
    """The made-up fingerprint the previous version filed records under."""
    return ModelFingerprint(model_id=scope, weights_digest="kvkeep-router-conversation/v1",
                            dtype="token-ids", num_layers=1, num_kv_heads=1, head_size=1,
                            block_size=1, layout_id="conversation", codec="token-ids")


def _legacy_bytes(key: SessionKey, tokens: tuple[int, ...], generation: int) -> bytes:
    """A record as the previous version encoded it: a SessionManifest with a "mac" field."""
    body = json.dumps({"v": 1, "fingerprint": key.fingerprint.hex(),
                       "namespace": key.namespace.label, "session_id": key.session_id,
                       "block_hashes": [], "token_count": len(tokens), "generation": generation,
                       "updated_at": 1.0, "token_ids": list(tokens), "mac": "ab" * 32},
                      separators=(",", ":")).encode()
    return xxhash.xxh3_64_digest(body) + body


def _sealed(fields: dict[str, object], version: int = 1) -> bytes:
    """A conversation record's bytes around any body, checksummed as the encoder does."""
    body = json.dumps(fields, separators=(",", ":")).encode()
    return CONVERSATION_TAG + bytes([version]) + xxhash.xxh3_64_digest(body) + body


def _fields(record: ConversationRecord) -> dict[str, object]:
    return {"scope": record.scope, "namespace": record.namespace.label,
            "session_id": record.session_id, "generation": record.generation,
            "token_ids": list(record.token_ids), "mac": record.mac.hex()}


# --- the type ----------------------------------------------------------------------------------

def test_a_record_round_trips_with_its_mac_and_as_a_tombstone() -> None:
    for record in (_record(), _record(tokens=(), mac=b"")):
        encoded = record.encode()
        assert encoded.startswith(CONVERSATION_TAG)
        decoded = ConversationRecord.decode(encoded, record.key)
        assert decoded == record and decoded.key == record.key
        assert decode_session_record(encoded, record.key) == record
    assert _sealed(_fields(_record())) == _record().encode()  # the helper is the real layout


def test_its_key_is_derived_from_its_scope_never_a_model_fingerprint() -> None:
    record = _record()
    assert record.key == SessionKey.conversation(SCOPE, TENANT, "s1")
    assert record.key.fingerprint == conversation_scope_digest(SCOPE)
    assert conversation_scope_digest("fake-model") != conversation_scope_digest(SCOPE)
    # Not the digest the previous version used, nor any model's (a model named like the scope).
    legacy = _legacy_fingerprint(SCOPE)
    assert record.key != SessionKey.of(legacy, TENANT, "s1")
    assert len(record.key.fingerprint) == len(legacy.digest) == 16
    with pytest.raises(InvalidKey):
        conversation_scope_digest("")
    with pytest.raises(InvalidKey):
        ConversationRecord(SCOPE, TENANT, SessionId("../etc"), 1)


def test_every_flipped_byte_is_refused() -> None:
    encoded = _record().encode()
    for position in range(len(encoded)):
        flipped = bytearray(encoded)
        flipped[position] ^= 0x01
        with pytest.raises(CorruptBlock):
            ConversationRecord.decode(bytes(flipped))
        with pytest.raises(CorruptBlock):
            decode_session_record(bytes(flipped))
    for cut in (0, 5, len(CONVERSATION_TAG) + 1, len(encoded) - 1):
        with pytest.raises(CorruptBlock):
            ConversationRecord.decode(encoded[:cut])


def test_it_is_bound_to_its_key() -> None:
    record = _record()
    for other in (SessionKey.conversation(SCOPE, TENANT, "s2"),
                  SessionKey.conversation("fake-model", TENANT, "s1"),
                  SessionKey.conversation(SCOPE, Namespace("elsewhere"), "s1")):
        with pytest.raises(CorruptBlock, match="different session key"):
            ConversationRecord.decode(record.encode(), other)
        with pytest.raises(CorruptBlock):
            decode_session_record(record.encode(), other)
    # Re-sealed with another scope (a checksum anyone can compute): bound to another key.
    moved = _fields(record) | {"scope": "fake-model"}
    with pytest.raises(CorruptBlock, match="different session key"):
        ConversationRecord.decode(_sealed(moved), record.key)


def test_the_two_decoders_refuse_each_others_bytes() -> None:
    record = _record()
    manifest = _manifest(record.key)  # even under the record's own key
    with pytest.raises(CorruptBlock, match="a conversation record, not a session manifest"):
        SessionManifest.decode(record.encode())
    with pytest.raises(CorruptBlock, match="not a conversation record"):
        ConversationRecord.decode(manifest.encode())
    assert decode_session_record(manifest.encode(), record.key) == manifest
    assert expect_kind(decode_session_record(record.encode()), ConversationRecord) == record
    with pytest.raises(CorruptBlock, match="holds a SessionManifest, not a ConversationRecord"):
        expect_kind(manifest, ConversationRecord)
    with pytest.raises(CorruptBlock, match="holds a ConversationRecord, not a SessionManifest"):
        expect_kind(record, SessionManifest)
    assert expect_kind(None, ConversationRecord) is None


def test_a_previous_versions_record_is_never_read_as_a_conversation_record() -> None:
    """What the router wrote before this type: a SessionManifest with a MAC under the made-up
    fingerprint. It decodes as the manifest it is (its "mac" ignored), never as a record."""
    key = SessionKey.of(_legacy_fingerprint(SCOPE), TENANT, "s1")
    legacy = _legacy_bytes(key, (1, 2, 3), 7)
    with pytest.raises(CorruptBlock):
        ConversationRecord.decode(legacy)
    with pytest.raises(CorruptBlock):
        ConversationRecord.decode(legacy, _record().key)
    as_manifest = SessionManifest.decode(legacy, key)
    assert as_manifest.token_ids == (1, 2, 3) and as_manifest.block_hashes == ()
    with pytest.raises(CorruptBlock):
        expect_kind(decode_session_record(legacy), ConversationRecord)
    assert b'"mac"' not in _manifest(key).encode()  # KV manifests carry no MAC field any more


@pytest.mark.parametrize("change", [
    {"generation": "7"}, {"generation": 7.5}, {"generation": True}, {"token_ids": [1, "2"]},
    {"token_ids": 3}, {"mac": "zz"}, {"scope": ""}, {"scope": 5}, {"namespace": "bad/ns"},
    {"session_id": ""},
])
def test_a_malformed_body_is_refused(change: dict[str, object]) -> None:
    with pytest.raises(CorruptBlock, match="malformed conversation record"):
        ConversationRecord.decode(_sealed(_fields(_record()) | change))


def test_a_missing_field_or_another_version_is_refused() -> None:
    for name in ("scope", "namespace", "session_id", "generation", "token_ids", "mac"):
        fields = _fields(_record())
        del fields[name]
        with pytest.raises(CorruptBlock, match="malformed"):
            ConversationRecord.decode(_sealed(fields))
    with pytest.raises(CorruptBlock, match="unknown version"):
        ConversationRecord.decode(_sealed(_fields(_record()), version=2))
    with pytest.raises(CorruptBlock):
        decode_session_record(_sealed(_fields(_record()), version=2))


# --- in a real daemon --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("conversation-records")
    tokens = tmp / "tokens"
    tokens.write_text(f"{TOKEN} conversations\n{OTHER_TOKEN} other\n")
    with running_daemon(tmp, "conv", token_file=tokens) as d:
        yield d


def _now() -> int:
    return time.time_ns() // 1000


def _store(daemon: DaemonProcess, tmp_path: Path) -> TieredStore:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    return TieredStore.from_specs([RemoteSpec(daemons=((daemon.node_id, daemon.address),),
                                              replicas=1, timeout_s=TIMEOUT,
                                              token_file=str(token))])


def test_a_daemon_stores_and_serves_a_record(daemon: DaemonProcess) -> None:
    client = daemon.client(TOKEN)
    record = _record("d-1", generation=_now())
    client.put_manifest(record, timeout=TIMEOUT)
    got = client.get_manifest(record.key, timeout=TIMEOUT)
    assert isinstance(got, ConversationRecord) and got == record
    # An older generation does not replace it; a newer one does.
    client.put_manifest(_record("d-1", tokens=(9,), generation=record.generation - 1),
                        timeout=TIMEOUT)
    assert client.get_manifest(record.key, timeout=TIMEOUT) == record
    newer = _record("d-1", tokens=(), generation=record.generation + 1)
    client.put_manifest(newer, timeout=TIMEOUT)
    assert client.get_manifest(record.key, timeout=TIMEOUT) == newer
    assert client.delete_manifest(record.key, timeout=TIMEOUT)
    assert client.get_manifest(record.key, timeout=TIMEOUT) is None


def test_a_record_outlives_a_daemon_restart_on_disk(daemon: DaemonProcess) -> None:
    """After a restart the memory tier is empty: the record comes back from the nvme tier's
    file, decoded by its tag. (A drain, not a kill: the nvme copy is written behind.)"""
    record = _record("d-restart", tokens=tuple(range(500)), generation=_now())
    daemon.client(TOKEN).put_manifest(record, timeout=TIMEOUT)
    daemon.close_clients()
    assert daemon.terminate() == 0
    daemon.spawn()
    daemon.wait_healthy()
    assert daemon.client(TOKEN).get_manifest(record.key, timeout=TIMEOUT) == record


def test_the_daemon_checks_a_record_as_it_checks_a_manifest(daemon: DaemonProcess) -> None:
    """Tenant and generation checks apply to both kinds; damaged bytes of either are refused."""
    client = daemon.client(TOKEN)
    with pytest.raises(ConfigError, match="PERMISSION_DENIED"):
        daemon.client(OTHER_TOKEN).put_manifest(_record("d-tenant", generation=_now()),
                                                timeout=TIMEOUT)
    ahead = _now() + 40 * 86_400 * 10 ** 6
    for far in (_record("d-ahead", generation=ahead),
                _manifest(SessionKey.conversation(SCOPE, TENANT, "d-ahead"), ahead)):
        with pytest.raises(TierError, match="ahead of this daemon's clock"):
            client.put_manifest(far, timeout=TIMEOUT)
    assert client.get_manifest(SessionKey.conversation(SCOPE, TENANT, "d-ahead"),
                               timeout=TIMEOUT) is None

    class Damaged:  # a record whose bytes were damaged on their way
        key = _record().key
        generation = 1

        def encode(self) -> bytes:
            raw = bytearray(_record("d-damaged", generation=_now()).encode())
            raw[-2] ^= 0x20
            return bytes(raw)

    with pytest.raises(TierError, match=r"INVALID_ARGUMENT.*conversation record checksum"):
        client.put_manifest(Damaged(), timeout=TIMEOUT)  # type: ignore[arg-type]


def test_a_typed_read_refuses_the_other_kind_and_generations_span_kinds(
        daemon: DaemonProcess, tmp_path: Path) -> None:
    """A manifest under a conversation key (a store token holder's, or a bug) is CorruptBlock
    to a conversation reader, never history; and since the daemons keep the higher generation
    whatever the kinds, `get_record` shows it to a writer, which must outrank it."""
    store = _store(daemon, tmp_path)
    try:
        key = SessionKey.conversation(SCOPE, TENANT, "d-kinds")
        manifest = _manifest(key, generation=_now() + 10 ** 6)
        store.put_manifest(manifest)
        assert store.get_record(key) == manifest
        assert store.get_manifest(key) == manifest
        with pytest.raises(CorruptBlock, match="not a ConversationRecord"):
            expect_kind(store.get_record(key), ConversationRecord)
        store.put_manifest(_record("d-kinds", generation=manifest.generation - 1))
        assert store.get_record(key) == manifest  # the older record lost to it
        record = _record("d-kinds", generation=manifest.generation + 1)
        store.put_manifest(record)
        assert store.get_record(key) == record
        with pytest.raises(CorruptBlock, match="not a SessionManifest"):
            store.get_manifest(key)
        assert expect_kind(store.get_record(key), ConversationRecord) == record
    finally:
        store.close()


def test_a_previous_versions_record_in_a_daemon_is_a_miss(daemon: DaemonProcess,
                                                          tmp_path: Path) -> None:
    """A record the previous version wrote (a SessionManifest under the made-up fingerprint)
    still sits in a running daemon: the daemon keeps serving it as the manifest it is, and the
    new type's key never reaches it."""
    legacy_key = SessionKey.of(_legacy_fingerprint(SCOPE), TENANT, "d-legacy")
    legacy = SessionManifest.decode(_legacy_bytes(legacy_key, (4, 5, 6), _now()), legacy_key)
    client = daemon.client(TOKEN)
    client.put_manifest(legacy, timeout=TIMEOUT)
    store = _store(daemon, tmp_path)
    try:
        assert store.get_record(SessionKey.conversation(SCOPE, TENANT, "d-legacy")) is None
        assert store.get_manifest(legacy_key) == legacy
    finally:
        store.close()
