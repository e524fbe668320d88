"""Session floods and memory bounds (issue 13, item 8): a binding is written only once a worker
accepted the request, sessions are capped per tenant and in total, and every structure that
grows with traffic or with what a worker sends is bounded, one test per bound.

Fake workers over real sockets (a hostile one among them), the router core directly for the
index bounds.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from kvstore.commands.kvkeep import build_parser
from kvstore.errors import ConfigError
from kvstore.keys import SessionId
from router.commands import config_from_args
from router.core import RouterCore
from router.decision import RequestFeatures
from router.errors import TooManySessions
from router.hooks import Outcome
from router.indexer.history import SessionBlocks
from router.limits import METRICS_MAX_BYTES, Limits, TokenBucket
from router.membership.scraper import Scraper
from router.membership.workers import WorkerId, WorkerInfo, WorkerPool
from router.policy import build_policy
from router.state.sessions import SessionTable
from router.tasks import run_now
from router.tenants import ApiKeys
from tests.router_harness import (
    FakeWorker,
    LoopThread,
    RouterHandle,
    fake_generate,
    fake_router_config,
    fake_tokenize,
    loop_thread,
    running_fakes,
    wait_until,
)

MODEL = "fake"
KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789ab"}


def text_of(tokens: list[int]) -> str:
    return "".join(f" w{t}" for t in tokens)


class Env:
    def __init__(self, lt: LoopThread, a: FakeWorker, b: FakeWorker, router: RouterHandle
                 ) -> None:
        self.lt, self.a, self.b, self.router = lt, a, b, router
        self.http = httpx.Client(base_url=router.url, timeout=30)

    @property
    def service(self) -> Any:
        assert self.router.service is not None
        return self.router.service

    def metric(self, name: str, labels: dict[str, str]) -> float:
        return self.service.metrics.registry.get_sample_value(name, labels) or 0.0

    def post(self, who: str, sid: str | None = None, **body: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEYS[who]}"}
        if sid is not None:
            headers["X-Session-Id"] = sid
        return self.http.post("/v1/completions", headers=headers,
                              json={"model": MODEL, "prompt": "p", "max_tokens": 2, **body})


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    with loop_thread() as lt, running_fakes(lt, MODEL) as fakes:
        a, b = fakes["a"], fakes["b"]
        config = fake_router_config(
            fakes, stream_idle_timeout_s=5.0, api_keys=ApiKeys.load(keys),
            limits=Limits(max_sessions=6, max_sessions_per_tenant=4,
                          max_response_bytes=256 << 10, max_event_bytes=64 << 10))
        router = RouterHandle(lt, config).start()
        e = Env(lt, a, b, router)
        wait_until(lambda: {w.worker_id for w in e.service.core.workers()
                            if e.service.core.usable(w)} == {"a", "b"})
        yield e
        e.http.close()
        router.stop()


@pytest.fixture(autouse=True)
def reset(env: Env) -> Iterator[None]:
    yield
    for fake in (env.a, env.b):
        fake.status = fake.break_after = None
        fake.extra_tokens = 0
        fake.endless_line = False
        fake.endless_body = False
    for state in env.service.core.workers():
        state.suspect_until = 0.0
        state.consecutive_failures = 0
    backend = env.service.backend
    for sid in list(backend._bindings):  # a clean session table for the next test
        del backend._bindings[sid]
    env.service.core.sessions.reset([])


def test_a_binding_is_written_only_after_a_worker_accepts(env: Env) -> None:
    """A request no worker takes (here every worker refuses it with a 400, as vLLM refuses a
    malformed one) creates no binding; an accepted one does, stream or not."""
    env.a.status = env.b.status = 400
    for i in range(20):
        assert env.post("alice", f"junk-{i}").status_code == 400
        assert env.post("alice", f"junk-s-{i}", stream=True).status_code == 400
    assert len(env.service.core.sessions) == 0
    assert env.service.backend._bindings == {}
    env.a.status = env.b.status = None
    r = env.post("alice", "real", stream=True)
    assert r.status_code == 200
    binding = env.service.core.session(SessionId("real"))
    assert binding is not None and binding.worker_id == r.headers["X-KVKeep-Worker"]
    assert binding.binding.owner == "alice"
    assert env.post("alice", "real").headers["X-KVKeep-Route"] == "sticky"


def test_sessions_are_capped_per_tenant_and_in_total(env: Env) -> None:
    for i in range(4):
        assert env.post("alice", f"a-{i}").status_code == 200
    over = env.post("alice", "a-4")
    assert over.status_code == 429 and "Retry-After" in over.headers
    err = over.json()["error"]
    assert err["type"] == "rate_limit_error" and "'alice'" in err["message"]
    assert "max_sessions_per_tenant 4" in err["message"]
    # her sessions and her stateless requests still go
    assert env.post("alice", "a-0").headers["X-KVKeep-Route"] == "sticky"
    assert env.post("alice").status_code == 200
    for i in range(2):
        assert env.post("bob", f"b-{i}").status_code == 200
    full = env.post("bob", "b-2")
    assert full.status_code == 429 and "max_sessions 6" in full.json()["error"]["message"]
    assert env.metric("kvkeep_router_sessions_refused_total", {"limit": "tenant"}) >= 1
    assert env.metric("kvkeep_router_sessions_refused_total", {"limit": "total"}) >= 1


def test_an_endless_answer_body_is_cut_off_and_refused(env: Env) -> None:
    """A worker streaming a never-ending unary body is cut off at `max_response_bytes` and
    counted. A 2xx answer over the cap is what the client sized (`n`, `max_tokens`,
    `logprobs`: trust review H1), so it is the client's 413, not tried again elsewhere, and the
    worker is not marked: its next answer is served."""
    r0 = env.post("alice", "endless")
    name = r0.headers["X-KVKeep-Worker"]
    home = env.a if name == "a" else env.b
    home.endless_body = True
    before = env.metric("kvkeep_router_upstream_oversize_total", {"what": "body"})
    r = env.post("alice", "endless", max_tokens=4)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert env.metric("kvkeep_router_upstream_oversize_total", {"what": "body"}) == before + 1
    assert all(env.service.core.usable(w) for w in env.service.core.workers())
    home.endless_body = False
    r = env.post("alice", "endless", max_tokens=4)
    assert r.status_code == 200 and r.headers["X-KVKeep-Worker"] == name
    assert r.json()["choices"][0]["text"] == text_of(fake_generate(fake_tokenize("p"), 4))


def test_an_endless_sse_line_breaks_the_stream_and_it_resumes(env: Env) -> None:
    """One SSE event that never ends (no newline, ever) is cut at `max_event_bytes`: the
    router's line buffer stays bounded, the stream continues on the other worker."""
    r0 = env.post("alice", "giant")
    first = r0.headers["X-KVKeep-Worker"]
    (env.a if first == "a" else env.b).endless_line = True
    r = env.post("alice", "giant", max_tokens=12, stream=True)
    assert r.status_code == 200
    lines = [json.loads(x[6:]) for x in r.text.splitlines()
             if x.startswith("data: ") and x != "data: [DONE]"]
    text = "".join(c.get("text", "") for e in lines for c in e.get("choices", []))
    assert text == text_of(fake_generate(fake_tokenize("p"), 12))
    assert env.metric("kvkeep_router_upstream_oversize_total", {"what": "event"}) == 1


def test_a_worker_sending_more_tokens_than_asked_is_cut_off(env: Env) -> None:
    env.a.extra_tokens = env.b.extra_tokens = 50
    r = env.post("alice", max_tokens=10, stream=True)
    events = [json.loads(x[6:]) for x in r.text.splitlines()
              if x.startswith("data: ") and x != "data: [DONE]"]
    assert events[-1]["error"]["code"] == 502
    text = "".join(c.get("text", "") for e in events[:-1] for c in e.get("choices", []))
    assert text == text_of(fake_generate(fake_tokenize("p"), 10))
    assert env.metric("kvkeep_router_upstream_oversize_total", {"what": "tokens"}) == 1


# --- the bounds of the router core's structures -----------------------------------------------
def _core(**limits: Any) -> RouterCore:
    core = RouterCore(build_policy("kvkeep", rng=random.Random(0)), block_size=4,
                      limits=Limits(**limits))
    for i in range(3):
        core.add_worker(WorkerInfo(WorkerId(f"w{i}"), f"sim://w{i}", ("m",)))
    return core


def test_routing_history_is_bounded() -> None:
    core = _core(history_keys=500)
    for i in range(200):
        text = f"prompt {i} " + "x" * 300  # 4+ chunks of 64 characters each
        p = core.place_now(core.route(RequestFeatures("m", prompt_text=text)))
        core.finish(p, Outcome(ok=True))
    assert len(core.history) == 500


def test_session_token_keys_are_bounded_in_all() -> None:
    core = _core(session_block_keys=1000)
    for i in range(50):
        features = RequestFeatures("m", SessionId(f"s{i}"), tuple(range(400)))
        p = core.place_now(core.route(features))
        core.finish(p, Outcome(ok=True, prompt_tokens=range(400), output_tokens=range(40)))
    assert core.session_blocks.total_keys <= 1000 and len(core.session_blocks) == 9
    blocks = SessionBlocks(max_keys=10_000, max_keys_per_session=16)
    blocks.put("long", tuple(range(1000)))
    assert blocks.get("long") == tuple(range(16))  # its prefix, which is what matches


def test_sessions_are_capped_in_the_core_too() -> None:
    """Without HTTP (a simulator), the same limits hold, counted per tenant."""
    core = _core(max_sessions=3, max_sessions_per_tenant=2)
    for i in range(2):
        core.place_now(core.route(RequestFeatures("m", SessionId(f"x{i}"), tenant="x")))
    with pytest.raises(TooManySessions, match="max_sessions_per_tenant 2"):
        core.place_now(core.route(RequestFeatures("m", SessionId("x2"), tenant="x")))
    core.place_now(core.route(RequestFeatures("m", SessionId("y0"), tenant="y")))
    with pytest.raises(TooManySessions, match="max_sessions 3"):
        core.place_now(core.route(RequestFeatures("m", SessionId("y1"), tenant="y")))
    core.expire()
    assert len(core.sessions) == 3 and core.sessions.owned_by("x") == 2


def test_a_pending_session_is_bound_on_accept_and_a_lost_race_follows_the_winner() -> None:
    core = RouterCore(build_policy("kvkeep", rng=random.Random(0)), bind_on_accept=True,
                      limits=Limits(max_sessions=2, max_sessions_per_tenant=2))
    for i in range(3):
        core.add_worker(WorkerInfo(WorkerId(f"w{i}"), f"sim://w{i}", ("m",)))
    sid = SessionId("raced")
    placement = core.place_now(core.route(RequestFeatures("m", sid, tenant="t")))
    assert placement.pending and core.session(sid) is None
    # pending sessions count against the limits meanwhile
    core.place_now(core.route(RequestFeatures("m", SessionId("other"), tenant="t")))
    with pytest.raises(TooManySessions, match="max_sessions 2"):
        core.place_now(core.route(RequestFeatures("m", SessionId("third"), tenant="t")))
    # another replica binds the session first (same backend, its own table)
    rival = SessionTable(core.backend, clock=core.sessions.clock)
    winner = WorkerId("w2" if placement.worker != "w2" else "w1")

    run_now(rival.bind(sid, winner, "m", expected=None, reason="new", restore_from=None,
                       owner="t"))
    kept, after = run_now(core.accepted(placement))
    assert not kept and after.binding is not None and after.binding.worker_id == winner
    core.finish(after, Outcome(ok=False))
    again = core.place_now(core.route(RequestFeatures("m", sid, tenant="t")))
    assert again.worker == winner and not again.pending


def test_token_bucket() -> None:
    now = [0.0]
    bucket = TokenBucket(10, 20, clock=lambda: now[0])
    assert bucket.take(20) and not bucket.take(1)
    now[0] = 0.5
    assert bucket.take(5) and not bucket.take(1)
    now[0] = 100.0
    assert bucket.take(20) and not bucket.take(1)  # never more than the burst


def test_limits_from_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("limits: {max_sessions: 100, max_event_bytes: 65536}\n"
                    "workers: {allow: ['10.0.0.0/8:8000']}\n")
    parse = build_parser().parse_args
    config = config_from_args(parse(["router", "serve", "--policy-config", str(path),
                                     "--max-sessions-per-tenant", "7"]))
    assert config.limits == Limits(max_sessions=100, max_event_bytes=65536,
                                   max_sessions_per_tenant=7)
    assert config.workers_allow.url_refusal("http://10.1.1.1:8000") is None
    assert config.workers_allow.url_refusal("http://127.0.0.1:8000") is not None
    path.write_text("limits: {max_sessions: 0}\n")
    with pytest.raises(ConfigError, match=r"limits\.max_sessions must be > 0"):
        config_from_args(parse(["router", "serve", "--policy-config", str(path)]))
    path.write_text("workers: {allow: ['not a host']}\n")
    with pytest.raises(ConfigError, match="allow-list"):
        config_from_args(parse(["router", "serve", "--policy-config", str(path)]))


def test_a_giant_metrics_page_is_a_failed_scrape() -> None:
    """The scraper reads at most `METRICS_MAX_BYTES` of a worker's /metrics: past that the
    scrape fails (counted as the worker's failure), and its load is not taken from it."""
    async def scenario(lt_worker: FakeWorker) -> tuple[int, int, int]:
        await lt_worker.start()
        pool = WorkerPool()
        pool.upsert(WorkerInfo(WorkerId("w"), lt_worker.url, ("m",)))
        state = pool.get(WorkerId("w"))
        assert state is not None
        try:
            async with aiohttp.ClientSession() as http:
                scraper = Scraper(pool, http)
                lt_worker.running = 7
                await scraper._scrape(state)
                ok = state.load.running
                lt_worker.running, lt_worker.metrics_padding = 3, METRICS_MAX_BYTES + 1
                await scraper._scrape(state)
                return ok, state.load.running, state.consecutive_failures
        finally:
            await lt_worker.stop()

    assert asyncio.run(scenario(FakeWorker(MODEL))) == (7, 7, 1)
