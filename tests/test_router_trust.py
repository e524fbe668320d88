"""What the router believes and whom it serves (issue 13, items 2 and 3): worker registrations
are checked against an allow-list, a worker's KV-event intake is bounded, API keys name
tenants that own their sessions and get their own cache salt, a client sets only the
`kv_transfer_params` it may, and without keys the router listens on loopback only.

Fake workers and real sockets (a second fake worker on 127.0.0.2 plays a host outside the
allow-list), real etcd for a rogue registration; the real-vLLM half of the tenant isolation is
in `tests/test_router_vllm.py`.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aetcd  # type: ignore[import-untyped]
import httpx
import msgpack  # type: ignore[import-untyped]
import pytest

from deploy.local.services import EtcdServer, free_port
from kvstore.commands.kvkeep import build_parser
from kvstore.errors import ConfigError
from router.commands import config_from_args
from router.config import RouterConfig, StaticWorker
from router.core import RouterCore
from router.decision import RequestFeatures
from router.errors import SessionNotFound
from router.front.kv_params import client_kv_params
from router.indexer import BlockStored, KVBlockIndex
from router.indexer.subscriber import KVEventSubscriber
from router.limits import Limits
from router.membership.allowlist import AllowEntry, WorkerAllowList
from router.membership.workers import WorkerId, WorkerInfo
from router.policy import Thresholds, build_policy, policy_preset
from router.state import EtcdBackend
from router.tasks import cancel_and_wait
from router.tenants import ApiKeys
from tests.router_harness import FakeWorker, LoopThread, RouterHandle, loop_thread, wait_until

MODEL = "fake"
KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789ab",
        "ops": "operator-key-0123456789"}
# The router's tenants as ApiKeys: the salts a router loading the key file computes.
TENANT_KEYS = ApiKeys({KEYS["alice"]: "alice", KEYS["bob"]: "bob", KEYS["ops"]: "*"})


def cache_salt_for(tenant: str) -> str:
    return TENANT_KEYS.cache_salt("*" if tenant == "ops" else tenant)


def _auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def _key_file(tmp_path: Path) -> Path:
    path = tmp_path / "api-keys"
    path.write_text("# key tenant\n"
                    f"{KEYS['alice']} alice\n{KEYS['bob']} bob\n{KEYS['ops']} *\n")
    return path


def _config(**changes: Any) -> RouterConfig:
    base = RouterConfig(port=free_port(), scrape_interval_s=0.05, static_ttl_s=1.0,
                        policy=replace(policy_preset("kvkeep"),
                                       thresholds=Thresholds(migrate_cooldown_s=0.0)))
    return replace(base, **changes)


def _registered(router: RouterHandle) -> set[str]:
    assert router.service is not None
    return {w.worker_id for w in router.service.core.workers()}


def _refused(router: RouterHandle, reason: str) -> float:
    assert router.service is not None
    value = router.service.metrics.registry.get_sample_value(
        "kvkeep_router_worker_registrations_refused_total", {"reason": reason})
    return value or 0.0


# --- item 2: registrations are claims ---------------------------------------------------------
def test_allow_list_entries() -> None:
    allow = WorkerAllowList.parse(["10.0.0.0/8:8000-8100,fd00::/8", "vllm-0.svc:8000",
                                   "*.vllm.svc.cluster.local", "[::1]:9000"])
    assert allow.configured
    ok = ["http://10.8.3.17:8000", "http://10.0.0.1:8100", "https://[fd00::5]:443",
          "http://vllm-0.svc:8000", "http://w-3.vllm.svc.cluster.local:1234",
          "http://[::1]:9000", "http://[::ffff:10.1.2.3]:8000"]
    refused = ["http://10.8.3.17:9000", "http://11.0.0.1:8000", "http://vllm-0.svc:8001",
               "http://vllm.svc.cluster.local:1", "http://evil.com:8000",
               "http://[::1]:9001", "ftp://10.0.0.1:8000", "http://u:p@10.0.0.1:8000",
               "http://10.0.0.1:8000/?x=1", "http://2130706433:8000", "http://0x7f.1:8000",
               "http://10.1:8000", "not a url"]
    for url in ok:
        assert allow.url_refusal(url) is None, url
    for url in refused:
        assert allow.url_refusal(url) is not None, url
    # KV events: tcp only, matched by host (a worker's event port is not its HTTP port)
    assert allow.events_refusal("tcp://10.8.3.17:5557") is None
    assert allow.events_refusal("tcp://w.vllm.svc.cluster.local:5557") is None
    for endpoint in ("tcp://11.0.0.1:5557", "ipc:///tmp/x", "tcp://*:5557",
                     "tcp://10.0.0.1;11.0.0.1:5557", "tcp://10.0.0.1"):
        assert allow.events_refusal(endpoint) is not None, endpoint
    # the default: loopback only
    default = WorkerAllowList.parse([])
    assert not default.configured
    assert default.url_refusal("http://127.0.0.2:8000") is None
    assert default.url_refusal("http://localhost:8000") is None
    assert default.url_refusal("http://[::1]:8000") is None
    assert default.url_refusal("http://10.0.0.1:8000") is not None
    assert default.url_refusal("http://localhost.evil.com:8000") is not None
    assert WorkerAllowList.parse(["*"]).url_refusal("http://anything:1") is None
    for bad in ("10.0.0.0/8:0", "10.0.0.0/8:9-1", "host name", "[::1", ":80"):
        with pytest.raises(ConfigError):
            AllowEntry.parse(bad)


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    with loop_thread() as loop:
        yield loop


def test_registrations_outside_the_allow_list_are_ignored_and_counted(lt: LoopThread) -> None:
    """A worker registered (as anyone who can write the workers prefix could) with a URL the
    allow-list does not name gets no prompts, however attractive it looks; the refusal is
    counted. Its KV-event endpoint is not subscribed to either."""
    good = FakeWorker(MODEL)
    evil = FakeWorker(MODEL, host="127.0.0.2")  # loopback, but not what the operator allowed
    lt.run(good.start())
    lt.run(evil.start())
    good.running = 6  # the rogue looks idle, the real worker busy
    router = RouterHandle(lt, _config(
        static_workers=(StaticWorker(WorkerId("good"), good.url),),
        workers_allow=WorkerAllowList.parse(["127.0.0.1"]))).start()
    try:
        assert router.service is not None
        backend = router.service.backend
        wait_until(lambda: _registered(router) == {"good"})
        lt.run(backend.register_worker(WorkerInfo(WorkerId("evil"), evil.url, (MODEL,)), 60))
        lt.run(backend.register_worker(WorkerInfo(
            WorkerId("spy"), good.url.replace("127.0.0.1", "127.0.0.1"), (MODEL,),
            kv_events="tcp://10.66.0.1:5557"), 60))
        wait_until(lambda: "spy" in _registered(router))
        with httpx.Client(base_url=router.url, timeout=10) as http:
            for i in range(8):
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": f"p{i}",
                                                       "max_tokens": 2})
                assert r.status_code == 200
                assert r.headers["X-KVKeep-Worker"] in {"good", "spy"}
        assert evil.requests == []
        assert "evil" not in _registered(router)
        assert _refused(router, "url") >= 1 and _refused(router, "events") >= 1
        subscriber = router.service.subscriber
        assert subscriber is not None and WorkerId("spy") not in subscriber._feeds
        # a known worker re-registered with a refused URL leaves
        lt.run(backend.register_worker(WorkerInfo(WorkerId("spy"), evil.url, (MODEL,)), 60))
        wait_until(lambda: "spy" not in _registered(router))
    finally:
        router.stop()
        lt.run(good.stop())
        lt.run(evil.stop())


def test_without_an_allow_list_only_loopback_workers_are_believed(lt: LoopThread) -> None:
    near = FakeWorker(MODEL)
    lt.run(near.start())
    router = RouterHandle(lt, _config()).start()
    try:
        assert router.service is not None
        backend = router.service.backend
        lt.run(backend.register_worker(WorkerInfo(WorkerId("near"), near.url, (MODEL,)), 60))
        lt.run(backend.register_worker(
            WorkerInfo(WorkerId("far"), "http://10.1.2.3:8000", (MODEL,)), 60))
        lt.run(backend.register_worker(
            WorkerInfo(WorkerId("meta"), "http://169.254.169.254", (MODEL,)), 60))
        wait_until(lambda: "near" in _registered(router))
        assert _registered(router) == {"near"}
        assert _refused(router, "url") == 2
    finally:
        router.stop()
        lt.run(near.stop())


def test_a_rogue_etcd_record_is_not_a_worker(etcd_server: EtcdServer) -> None:
    """Raw JSON written under the workers prefix in a real etcd, as an attacker with etcd
    access would: the router's watch sees it, and ignores it."""
    async def scenario() -> None:
        core = RouterCore(build_policy("kvkeep", rng=random.Random(0)),
                          allow=WorkerAllowList.parse(["127.0.0.1"]))
        backend = EtcdBackend(etcd_server.url, "/rogue")
        await backend.start()
        task = asyncio.create_task(backend.follow_workers(core.registry))
        client = aetcd.Client(host="127.0.0.1", port=etcd_server.port)
        try:
            lease = await client.lease(60)  # lease-less records are refused anyway (H2)
            for wid, url in (("evil", "http://203.0.113.9:80"), ("ok", "http://127.0.0.1:9")):
                await client.put(f"/rogue/workers/{wid}".encode(), json.dumps(
                    {"id": wid, "url": url, "models": ["m"]}).encode(), lease=lease)
            for _ in range(200):
                if core.pool.get(WorkerId("ok")) is not None:
                    break
                await asyncio.sleep(0.02)
            assert {w.worker_id for w in core.workers()} == {"ok"}
            assert core.registry.refused == 1
        finally:
            await cancel_and_wait([task])
            await client.close()
            await backend.close()

    asyncio.run(scenario())


def _batch(events: list[dict[str, Any]], seq: int) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), msgpack.packb([0.0, events, None])]


def test_a_workers_kv_event_intake_is_bounded() -> None:
    """A worker flooding its event stream gets its budget's worth applied, the rest dropped
    and counted: by bytes, by blocks per second, and by index entries per worker."""
    index = KVBlockIndex(block_size=1)
    drops: dict[str, int] = {}
    sub = KVEventSubscriber(index, Limits(kv_event_blocks_per_s=1000, kv_event_burst_s=2.0,
                                          kv_event_bytes_per_s=1 << 20),
                            on_drop=lambda why, n: drops.__setitem__(why, drops.get(why, 0) + n))
    flood = [{"type": "BlockStored", "block_hashes": list(range(i * 500, i * 500 + 500)),
              "parent_block_hash": None if i == 0 else i * 500 - 1,
              "token_ids": list(range(i * 500, i * 500 + 500)), "block_size": 1}
             for i in range(10)]
    sub.handle(WorkerId("w"), _batch(flood, 0))
    assert len(index) == 2000  # the 2 s burst of a 1000 blocks/s budget
    assert drops["rate"] == 3000 and sub.dropped["rate"] == 3000
    padded = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
              "token_ids": [7], "block_size": 1, "pad": b"x" * (3 << 20)}
    sub.handle(WorkerId("w2"), _batch([padded], 0))
    assert drops["bytes"] == 1 and index.held_by(WorkerId("w2")) == 0
    # index entries per worker, whatever the rate
    core = RouterCore(build_policy("kvkeep", rng=random.Random(0)), block_size=1,
                      limits=Limits(kv_blocks_per_worker=3000))
    tokens = list(range(5000))
    core.apply_kv_events(WorkerId("w"), [BlockStored(tokens, None, tokens, 1)])
    assert core.blocks.held_by(WorkerId("w")) == 3000
    assert core.metrics.registry.get_sample_value(
        "kvkeep_router_kv_events_dropped_total", {"reason": "index-cap"}) == 2000


def test_the_default_index_cap_holds_a_flood() -> None:
    """The defaults bound a worker's index entries (a flood of 300k announced blocks)."""
    core = RouterCore(build_policy("kvkeep", rng=random.Random(0)), block_size=1)
    tokens = list(range(300_000))
    core.apply_kv_events(WorkerId("w"), [BlockStored(tokens, None, tokens, 1)])
    assert len(core.blocks) <= Limits().kv_blocks_per_worker


# --- item 3: tenants --------------------------------------------------------------------------
def test_api_key_file() -> None:
    keys = ApiKeys({"k" * 16: "alice", "o" * 16: "*"})
    assert keys.tenant_of("k" * 16) == "alice" and keys.tenant_of("o" * 16) == "*"
    assert keys.tenant_of("k" * 15) is None and keys.tenant_of(None) is None
    with pytest.raises(ConfigError):
        ApiKeys({"short": "alice"})
    with pytest.raises(ConfigError):
        ApiKeys({"k" * 16: "../etc"})
    assert keys.cache_salt("alice") == keys.cache_salt("alice") != keys.cache_salt("*")


def test_serve_refuses_a_network_listen_without_api_keys(tmp_path: Path) -> None:
    parse = build_parser().parse_args
    with pytest.raises(ConfigError, match="loopback only"):
        config_from_args(parse(["router", "serve", "--listen", "0.0.0.0:8000"]))
    with pytest.raises(ConfigError, match="loopback only"):
        config_from_args(parse(["router", "serve", "--listen", ":8000"]))
    config = config_from_args(parse(["router", "serve", "--listen", "0.0.0.0:8000",
                                     "--api-keys", str(_key_file(tmp_path))]))
    assert config.api_keys is not None and config.api_keys.tenant_of(KEYS["bob"]) == "bob"
    assert config_from_args(parse(["router", "serve", "--listen", "127.0.0.1:8000"])).host \
        == "127.0.0.1"
    bad = tmp_path / "bad"
    bad.write_text("only-one-field\n")
    with pytest.raises(ConfigError, match="expected"):
        config_from_args(parse(["router", "serve", "--api-keys", str(bad)]))


@pytest.fixture
def tenants(lt: LoopThread, tmp_path: Path) -> Iterator[tuple[RouterHandle, FakeWorker]]:
    """One worker keeping a prefix cache per cache salt, behind a router with three keys."""
    worker = FakeWorker(MODEL, prefix_cache=True)
    lt.run(worker.start())
    router = RouterHandle(lt, _config(
        static_workers=(StaticWorker(WorkerId("w"), worker.url),),
        api_keys=ApiKeys.load(_key_file(tmp_path)))).start()
    assert router.service is not None
    wait_until(lambda: _registered(router) == {"w"})
    yield router, worker
    router.stop()
    lt.run(worker.stop())


def test_a_session_belongs_to_the_tenant_that_created_it(
        tenants: tuple[RouterHandle, FakeWorker]) -> None:
    router, _ = tenants
    with httpx.Client(base_url=router.url, timeout=10) as http:
        body = {"model": MODEL, "prompt": "secret plans", "max_tokens": 2}
        r = http.post("/v1/completions", json=body, headers={**_auth("alice"),
                                                            "X-Session-Id": "s-1"})
        assert r.status_code == 200 and r.headers["X-KVKeep-Route"] == "new"
        r = http.post("/v1/completions", json=body, headers={**_auth("bob"),
                                                            "X-Session-Id": "s-1"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "session_id"
        r = http.post("/v1/completions", json={**body, "stream": True},
                      headers={**_auth("bob"), "X-Session-Id": "s-1"})
        assert r.status_code == 404
        assert http.get("/kvkeep/sessions/s-1", headers=_auth("bob")).status_code == 404
        mine = http.get("/kvkeep/sessions/s-1", headers=_auth("alice"))
        assert mine.status_code == 200 and mine.json()["owner"] == "alice"
        assert http.get("/kvkeep/sessions/s-1", headers=_auth("ops")).status_code == 200
        r = http.post("/v1/completions", json=body, headers={**_auth("alice"),
                                                            "X-Session-Id": "s-1"})
        assert r.status_code == 200 and r.headers["X-KVKeep-Route"] == "sticky"
        # worker addresses are an operator's
        assert http.get("/kvkeep/workers", headers=_auth("bob")).status_code == 403
        assert http.get("/kvkeep/workers", headers=_auth("ops")).status_code == 200
        assert http.get("/v1/models").status_code == 401
        assert http.get("/health").status_code == 200


def test_tenants_get_their_own_cache_salt_and_see_only_their_cache(
        tenants: tuple[RouterHandle, FakeWorker]) -> None:
    """A prompt alice has cached shows as cached to her, never to bob (his requests carry
    his own salt, and a salt he sets himself is replaced): `X-KVKeep-Cached-Tokens` tells
    nobody about another tenant's prompts."""
    router, worker = tenants
    prompt = " ".join(f"t{i}" for i in range(64))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    with httpx.Client(base_url=router.url, timeout=10) as http:
        def cached(who: str, **extra: Any) -> int:
            r = http.post("/v1/completions", json={**body, **extra}, headers=_auth(who))
            assert r.status_code == 200
            return int(r.headers["X-KVKeep-Cached-Tokens"])

        assert cached("alice") == 0
        assert cached("alice") == 64
        assert worker.requests[-1]["cache_salt"] == cache_salt_for("alice")
        assert cached("bob") == 0
        assert cached("bob", cache_salt=cache_salt_for("alice")) == 64  # his own cache
        assert worker.requests[-1]["cache_salt"] == cache_salt_for("bob")
        assert cached("ops", cache_salt=cache_salt_for("alice")) == 0


def test_one_tenants_cached_prefix_does_not_steer_anothers_routing() -> None:
    """The router's own indexes are keyed by the salt as vLLM's cache is: KV events of
    alice's salted blocks (vLLM publishes the salt in the first block's extra keys) and her
    routing history score for her prompts only, so where bob's request goes (a header he sees)
    says nothing about alice's prompts."""
    core = RouterCore(build_policy("kvkeep", rng=random.Random(0)), block_size=4)
    workers = [WorkerId(f"w{i}") for i in range(4)]
    for w in workers:
        core.add_worker(WorkerInfo(w, f"sim://{w}", ("m",)))
        core.set_load(w, running=1, waiting=0, kv_usage=0.1)
    prompt = tuple(range(100, 132))
    salt = {t: cache_salt_for(t) for t in ("alice", "bob")}
    core.apply_kv_events(workers[2], [BlockStored(
        list(range(1, 9)), None, prompt, 4, extra_keys=[(salt["alice"],)] + [None] * 7)])

    def features(tenant: str, **extra: Any) -> RequestFeatures:
        return RequestFeatures("m", prompt_tokens=prompt, tenant=tenant,
                               cache_salt=salt[tenant], **extra)

    alice = core.route(features("alice"))
    assert core.blocks.match(alice.block_keys) == {workers[2]: 8.0}
    for _ in range(5):
        assert core.place_now(alice).worker == workers[2]
    bob = core.route(features("bob"))
    assert core.blocks.match(bob.block_keys) == {}
    assert core.history.match(bob.prefix_keys) == {}  # alice's history is hers too
    assert core.history.match(alice.prefix_keys) == {workers[2]: len(alice.prefix_keys)}
    # and a session id is its creator's
    core.place_now(core.route(features("alice", session_id="shared-name")))
    with pytest.raises(SessionNotFound):
        core.place_now(core.route(features("bob", session_id="shared-name")))


def test_clients_set_only_restore_in_kv_transfer_params(
        tenants: tuple[RouterHandle, FakeWorker]) -> None:
    router, worker = tenants
    forged = {"session_id": "someone-else", "session_epoch": 99, "previous_worker": "w9",
              "restore_reason": "failover", "namespace": "bob", "tenant": "bob",
              "restore": "none", "do_remote_prefill": True}
    with httpx.Client(base_url=router.url, timeout=10) as http:
        r = http.post("/v1/completions", headers={**_auth("alice"), "X-Session-Id": "kvp"},
                      json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                            "kv_transfer_params": forged})
        assert r.status_code == 200
        assert worker.requests[-1]["kv_transfer_params"] == {
            "session_id": "kvp", "restore": "none"}  # a new session: epoch 0 not yet bound
        r = http.post("/v1/completions", headers={**_auth("alice"), "X-Session-Id": "kvp"},
                      json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                            "kv_transfer_params": forged})
        assert worker.requests[-1]["kv_transfer_params"] == {
            "session_id": "kvp", "restore": "none", "session_epoch": 0}
        r = http.post("/v1/completions", headers=_auth("alice"), json={
            "model": MODEL, "prompt": "x", "max_tokens": 1, "kv_transfer_params": forged})
        assert worker.requests[-1]["kv_transfer_params"] == {"restore": "none"}
        r = http.post("/v1/completions", headers=_auth("alice"), json={
            "model": MODEL, "prompt": "x", "max_tokens": 1,
            "kv_transfer_params": {"restore": {"layers": [2, 1]}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    assert client_kv_params({"restore": {"layers": [0, 2]}, "x": 1}) == {
        "restore": {"layers": [0, 2]}}
    assert client_kv_params("nonsense") == {}
