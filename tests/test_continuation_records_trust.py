"""Conversation records protected (issue 16 item 6, trust-review H7), with real kvstore
daemons: a record the router did not sign (written straight to the daemons by a store-token
holder), signed with another key or moved from another session, or older than the router's
last write for the session, is never used: the continuation is a 409 `history_unavailable`
and the worker sees no forged history. A turn that cannot be recorded leaves a tombstone that
outranks a daemon's stale copy. A record the previous version wrote (a SessionManifest), or a
manifest under a record's key, is never history either. The config refuses the connectors'
store tenant. The router is a real replica over a fake vLLM worker (token-id completions need
no tokenizer)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from deploy.local.daemons import DaemonProcess, start_daemon
from deploy.local.services import free_port
from kvstore.commands.kvkeep import build_parser
from kvstore.errors import ConfigError, ForgedBlock
from kvstore.etcd import EtcdSpec
from kvstore.keys import BlockHash, ModelFingerprint, Namespace, SessionId, SessionKey
from kvstore.manifest import ConversationRecord, SessionManifest, SessionRecord, expect_kind
from kvstore.tiers.factory import RemoteSpec
from router.commands import config_from_args
from router.config import RouterConfig, StaticWorker
from router.conversations import StoreRecords
from router.conversations.config import ContinuationConfig
from router.conversations.records import RecordKey, record_scope
from router.front.proxy import build_app
from router.membership.workers import WorkerId
from router.service import RouterService
from tests.router_harness import FakeWorker, LoopThread, fake_generate, wait_until

STORE_TENANT = "conversations"
SCOPE = record_scope("fake", "default")
SECRET = bytes(range(32))
TIMEOUT = 5.0
DAY_US = 86_400 * 10 ** 6


def _ahead(days: int) -> int:
    """A generation `days` ahead of the clock (µs; daemons refuse more than 30 days ahead)."""
    return time.time_ns() // 1000 + days * DAY_US


@dataclass
class Env:
    lt: LoopThread
    worker: FakeWorker
    daemons: list[DaemonProcess]
    url: str
    metrics: Any

    def key(self, sid: str) -> SessionKey:
        return SessionKey.conversation(SCOPE, Namespace(STORE_TENANT), SessionId(sid))

    def stored(self, sid: str) -> list[ConversationRecord | None]:
        return [expect_kind(d.client().get_manifest(self.key(sid), timeout=TIMEOUT),
                            ConversationRecord) for d in self.daemons]

    def put_everywhere(self, record: SessionRecord) -> None:
        for d in self.daemons:
            client = d.client()
            client.delete_manifest(record.key, timeout=TIMEOUT)
            client.put_manifest(record, timeout=TIMEOUT)

    def outcome(self, name: str, outcome: str) -> float:
        return self.metrics.get_sample_value(name, {"outcome": outcome}) or 0.0


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    base = tmp_path_factory.mktemp("records")
    daemons = [start_daemon(base, f"d{i}") for i in range(2)]
    lt = LoopThread()
    worker = FakeWorker()
    lt.run(worker.start())
    records = StoreRecords(RemoteSpec(daemons=tuple((d.node_id, d.address) for d in daemons),
                                      replicas=2, timeout_s=TIMEOUT, name="conversations"),
                           STORE_TENANT, key=RecordKey(SECRET))
    config = RouterConfig(port=free_port(), static_workers=(
        StaticWorker(WorkerId("w1"), worker.url),))
    service = RouterService(config, records=records)
    runner = web.AppRunner(build_app(service), access_log=None)

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", config.port).start()

    lt.run(start())
    url = f"http://127.0.0.1:{config.port}"
    wait_until(lambda: any(w["usable"] for w in httpx.get(f"{url}/kvkeep/workers").json()),
               timeout=10)
    try:
        yield Env(lt, worker, daemons, url, service.metrics.registry)
    finally:
        lt.run(runner.cleanup())
        lt.run(worker.stop())
        lt.close()
        for d in daemons:
            for c in d.clients:
                c.close()
            d.kill()


def _complete(env: Env, sid: str, prompt: list[int], *, cont: bool = False,
              **extra: Any) -> httpx.Response:
    body = {"model": "fake", "prompt": prompt, "max_tokens": 3, **extra}
    headers = {"X-Session-Id": sid, **({"X-KVKeep-Continue": "1"} if cont else {})}
    return httpx.post(f"{env.url}/v1/completions", json=body, headers=headers, timeout=30)


def _refused(r: httpx.Response, words: str) -> None:
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["type"] == "history_unavailable" and words in error["message"]


def test_a_record_is_signed_and_continues(env: Env) -> None:
    assert _complete(env, "h7-ok", [5, 6, 7]).status_code == 200
    history = (5, 6, 7, *fake_generate([5, 6, 7], 3))
    for record in env.stored("h7-ok"):  # on both daemons, with the router's MAC
        assert record is not None and record.token_ids == history and record.mac
        assert record.scope == SCOPE
    assert _complete(env, "h7-ok", [8], cont=True).status_code == 200
    assert env.worker.requests[-1]["prompt"] == [*history, 8]


@pytest.mark.parametrize("forgery", ["unsigned", "another key", "moved"])
def test_a_forged_record_is_refused_with_a_409(env: Env, forgery: str) -> None:
    """The review's probe (a): a store-token holder writes a generation far ahead (the review
    used 2**62; daemons now refuse more than 30 days ahead) with injected history straight to
    both daemons; the next continuation is refused, never built on it."""
    sid = f"h7-forged-{forgery.replace(' ', '-')}"
    assert _complete(env, sid, [5, 6, 7]).status_code == 200
    injected: tuple[int, ...] = (66, 66, 66, 66)
    key, generation = env.key(sid), _ahead(20)
    mac = b""
    if forgery == "another key":
        mac = RecordKey(bytes(32)).tag(key, SCOPE, generation, injected)
    elif forgery == "moved":  # a genuine record of another session, copied over this one
        assert _complete(env, f"{sid}-donor", [66, 66]).status_code == 200
        donor = env.stored(f"{sid}-donor")[0]
        assert donor is not None
        injected, generation, mac = donor.token_ids, donor.generation + 1, donor.mac
    before = env.outcome("kvkeep_router_continuations_total", "forged")
    env.put_everywhere(ConversationRecord(SCOPE, key.namespace, key.session_id, generation,
                                          injected, mac))
    requests = len(env.worker.requests)
    _refused(_complete(env, sid, [8], cont=True), "integrity")
    assert len(env.worker.requests) == requests  # no worker saw the injected history
    assert env.outcome("kvkeep_router_continuations_total", "forged") == before + 1


def test_a_record_older_than_the_last_write_is_refused(env: Env) -> None:
    """The review's probe (b), replayed: turn 2 was recorded, but the daemons give back turn
    1's record (genuine, signed: a daemon that missed the write, or a replay). The router
    knows it wrote a newer one: 409, not a prompt that silently lacks turn 2."""
    sid = "h7-stale"
    assert _complete(env, sid, [5, 6, 7]).status_code == 200
    turn1 = env.stored(sid)[0]
    assert turn1 is not None
    history = [*turn1.token_ids, 9]
    assert _complete(env, sid, history).status_code == 200  # turn 2, whole history
    turn2 = env.stored(sid)[0]
    assert turn2 is not None and turn2.generation > turn1.generation
    env.put_everywhere(turn1)
    _refused(_complete(env, sid, [8], cont=True), "older")
    assert env.outcome("kvkeep_router_continuations_total", "stale") >= 1
    # Once the store holds the newest again, the session continues.
    env.put_everywhere(turn2)
    assert _complete(env, sid, [8], cont=True).status_code == 200


def test_an_unrecordable_turn_leaves_a_tombstone_over_stale_copies(env: Env) -> None:
    """A turn with `n: 2` cannot be recorded: the record becomes an empty, newer, signed one
    (not only a delete a daemon can miss), so a daemon holding the old copy does not win,
    on this replica or any other (a fresh reader sees the tombstone too)."""
    sid = "h7-tombstone"
    assert _complete(env, sid, [5, 6, 7]).status_code == 200
    old = env.stored(sid)[0]
    assert old is not None and old.token_ids
    assert _complete(env, sid, [*old.token_ids, 4], n=2).status_code == 200
    tombs = env.stored(sid)
    assert all(t is not None and t.token_ids == () and t.generation > old.generation
               for t in tombs)
    # d1 missed the tombstone: it still holds the old record.
    client = env.daemons[1].client()
    client.delete_manifest(old.key, timeout=TIMEOUT)
    client.put_manifest(old, timeout=TIMEOUT)
    _refused(_complete(env, sid, [8], cont=True), "no history")

    async def fresh_reader() -> Any:
        reader = StoreRecords(RemoteSpec(daemons=tuple((d.node_id, d.address)
                                                       for d in env.daemons),
                                         replicas=2, timeout_s=TIMEOUT),
                              STORE_TENANT, key=RecordKey(SECRET))
        try:
            return await reader.get(SCOPE, SessionId(sid))
        finally:
            await reader.close()

    seen = asyncio.run(fresh_reader())
    assert seen is not None and seen.tokens == ()


def test_a_reader_without_the_key_refuses_every_record(env: Env) -> None:
    """Records signed under the shared key are refused by a process with a key of its own
    (no --store-record-key-file): a 409, never trust without the key."""
    assert _complete(env, "h7-keyless", [1, 2]).status_code == 200

    async def keyless() -> None:
        reader = StoreRecords(RemoteSpec(daemons=tuple((d.node_id, d.address)
                                                       for d in env.daemons),
                                         replicas=2, timeout_s=TIMEOUT), STORE_TENANT)
        try:
            with pytest.raises(ForgedBlock):
                await reader.get(SCOPE, SessionId("h7-keyless"))
        finally:
            await reader.close()

    asyncio.run(keyless())


def _config(*flags: str) -> RouterConfig:
    return config_from_args(build_parser().parse_args(["router", "serve", *flags]))


def test_a_store_etcd_of_its_own_keeps_the_routers_etcd_credentials(tmp_path: Path) -> None:
    """`--store-etcd URL` names another etcd, reached with the router's etcd TLS and
    credentials, not in plain text without them (trust review L7)."""
    ca, password = tmp_path / "ca.pem", tmp_path / "etcd.password"
    ca.write_text("unused: only named here")
    password.write_text("secret\n")
    config = _config("--etcd", "https://etcd-a:2379", "--etcd-ca", str(ca), "--etcd-user",
                     "kvkeep-router", "--etcd-password-file", str(password), "--continuation",
                     "--store-etcd", "https://etcd-b:2379")
    assert config.continuation is not None
    etcd = config.continuation.remote.etcd
    assert isinstance(etcd, EtcdSpec)
    assert (etcd.url, etcd.ca_file, etcd.user) == ("https://etcd-b:2379", ca, "kvkeep-router")
    mine = _config("--etcd", "https://etcd-a:2379", "--etcd-ca", str(ca),
                   "--continuation").continuation
    assert mine is not None and isinstance(mine.remote.etcd, EtcdSpec)
    assert (mine.remote.etcd.url, mine.remote.etcd.ca_file) == ("https://etcd-a:2379", ca)


def test_a_key_on_the_command_line_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """`--api-key KEY` is readable by every local user (`ps`): accepted, with a warning that
    says where keys belong (trust review L7); keys from a file or the environment are not."""
    with caplog.at_level("WARNING", logger="kvkeep.router"):
        config = _config("--api-key", "key-in-argv-0123456789")
    assert config.api_keys is not None and config.api_keys.tenant_of("key-in-argv-0123456789")
    assert any("--api-key puts a key in the command line" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvkeep.router"):
        _config()
    assert not any("command line" in r.message for r in caplog.records)


def test_the_records_need_a_store_tenant_of_their_own(tmp_path: Path) -> None:
    base = ("--continuation", "--store-daemon", "d0=127.0.0.1:7400")
    for shared in ("default", "*"):
        with pytest.raises(ConfigError, match="store tenant of their own"):
            _config(*base, "--store-tenant", shared)
    with pytest.raises(ConfigError, match="store tenant of their own"):
        ContinuationConfig(RemoteSpec(daemons=(("d0", "127.0.0.1:1"),)), tenant="default")
    config = _config(*base)
    assert config.continuation is not None
    assert config.continuation.tenant == "conversations"  # the default is their own
    assert config.continuation.record_key is None
    key_file = tmp_path / "records.key"
    key_file.write_text(SECRET.hex() + "\n")
    keyed = _config(*base, "--store-record-key-file", str(key_file)).continuation
    assert keyed is not None and keyed.record_key is not None
    scope = record_scope("m", "alice")
    sid = SessionKey.conversation(scope, Namespace(STORE_TENANT), SessionId("s"))
    assert keyed.record_key.tag(sid, scope, 1, (1, 2)) == \
        RecordKey(SECRET).tag(sid, scope, 1, (1, 2))  # the file's key, as every replica's
    short = tmp_path / "short.key"
    short.write_text("nope")
    with pytest.raises(ConfigError):
        _config(*base, "--store-record-key-file", str(short))
    with pytest.raises(ConfigError, match="need --continuation"):
        _config("--store-record-key-file", str(key_file))


def test_the_mac_binds_tenant_session_generation_and_tokens() -> None:
    key = RecordKey(SECRET)
    alice, bob = record_scope("m", "alice"), record_scope("m", "bob")
    sk = SessionKey.conversation(alice, Namespace(STORE_TENANT), SessionId("s"))
    other = SessionKey.conversation(alice, Namespace(STORE_TENANT), SessionId("t"))
    base = key.tag(sk, alice, 5, (1, 2, 3))
    assert base != key.tag(sk, bob, 5, (1, 2, 3))
    assert base != key.tag(other, alice, 5, (1, 2, 3))
    assert base != key.tag(sk, alice, 6, (1, 2, 3))
    assert base != key.tag(sk, alice, 5, (1, 2, 4))
    assert base != key.tag(sk, alice, 5, (12, 3))
    record = key.sign(ConversationRecord(alice, Namespace(STORE_TENANT), SessionId("s"), 5,
                                         (1, 2, 3)))
    assert record.key == sk and record.mac == base
    decoded = ConversationRecord.decode(record.encode(), sk)
    assert decoded.mac == base
    key.check(decoded, alice)
    with pytest.raises(ForgedBlock):
        key.check(decoded, bob)
    with pytest.raises(ForgedBlock, match="not signed"):
        key.check(ConversationRecord(alice, Namespace(STORE_TENANT), SessionId("s"), 5,
                                     (1, 2, 3)), alice)


def test_a_record_from_a_clock_ahead_does_not_swallow_a_new_turn(env: Env) -> None:
    """The review's case (c): a genuine record with a generation far ahead (another replica
    whose clock runs fast) is stored; a replica that has not seen the session records a
    whole-history turn. The daemons keep the higher generation, so without reading it first
    the new turn would be silently dropped and the next continuation built on the old one."""
    sid = "h7-clock"
    key = env.key(sid)
    scope = record_scope("fake", "default")
    ahead, old = _ahead(10), (1, 2, 3)
    env.put_everywhere(RecordKey(SECRET).sign(ConversationRecord(
        scope, key.namespace, key.session_id, ahead, old)))
    turn = [5, 6, 7]
    assert _complete(env, sid, turn).status_code == 200  # this replica never saw the session
    history = [*turn, *fake_generate(turn, 3)]
    for record in env.stored(sid):
        assert record is not None and list(record.token_ids) == history
        assert record.generation > ahead
    assert _complete(env, sid, [8], cont=True).status_code == 200
    assert env.worker.requests[-1]["prompt"] == [*history, 8]


def _legacy_key(scope: str, sid: str) -> SessionKey:
    """Where the previous version filed a record: a made-up fingerprint, layout "conversation"."""
    fingerprint = ModelFingerprint(model_id=scope, weights_digest="kvkeep-router-conversation/v1",
                                   dtype="token-ids", num_layers=1, num_kv_heads=1, head_size=1,
                                   block_size=1, layout_id="conversation", codec="token-ids")
    return SessionKey.of(fingerprint, Namespace(STORE_TENANT), SessionId(sid))


def test_a_previous_versions_record_is_a_409_then_recorded_anew(env: Env) -> None:
    """Migration: a record the previous version wrote (a SessionManifest with its MAC, under
    its made-up fingerprint) still sits in both daemons. The router never reads it: the
    continuation is a 409 (no history), the client resends the whole conversation, and that
    turn is recorded as a ConversationRecord the next continuation builds on."""
    sid = "h7-legacy"
    legacy = SessionManifest(_legacy_key(SCOPE, sid), (), 3, generation=_ahead(0),
                             token_ids=(1, 2, 3))
    env.put_everywhere(legacy)
    requests = len(env.worker.requests)
    _refused(_complete(env, sid, [8], cont=True), "no history")
    assert len(env.worker.requests) == requests
    turn = [1, 2, 3, 4]
    assert _complete(env, sid, turn).status_code == 200
    assert _complete(env, sid, [8], cont=True).status_code == 200
    assert env.worker.requests[-1]["prompt"] == [*turn, *fake_generate(turn, 3), 8]
    for d in env.daemons:  # the old record is left as it was, for the budgets to evict
        assert d.client().get_manifest(legacy.key, timeout=TIMEOUT) == legacy


def test_a_manifest_under_a_records_key_is_a_409_and_is_outranked(env: Env) -> None:
    """A KV manifest written under a conversation key (by a store token holder), with a
    generation ahead: reading it as a record is CorruptBlock, a 409 with no history sent to
    the worker; the next whole-history turn outranks it (the router reads its generation)
    and the session continues."""
    sid = "h7-wrong-kind"
    key = env.key(sid)
    ahead = _ahead(5)
    env.put_everywhere(SessionManifest(key, (BlockHash(b"x" * 32),), 16, generation=ahead,
                                       token_ids=(66,) * 16))
    before = env.outcome("kvkeep_router_continuations_total", "store_error")
    requests = len(env.worker.requests)
    _refused(_complete(env, sid, [8], cont=True), "not a ConversationRecord")
    assert len(env.worker.requests) == requests
    assert env.outcome("kvkeep_router_continuations_total", "store_error") == before + 1
    turn = [5, 6]
    assert _complete(env, sid, turn).status_code == 200
    for record in env.stored(sid):
        assert record is not None and record.generation > ahead
    assert _complete(env, sid, [8], cont=True).status_code == 200
    assert env.worker.requests[-1]["prompt"] == [*turn, *fake_generate(turn, 3), 8]
