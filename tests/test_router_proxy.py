"""The HTTP proxy against fake workers: API, errors, headers, retries, stream resumption,
stickiness, migration and failover. Real sockets, in-process state; no model."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

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


class Env:
    def __init__(self, lt: LoopThread, a: FakeWorker, b: FakeWorker, router: RouterHandle
                 ) -> None:
        self.lt, self.a, self.b, self.router = lt, a, b, router
        self.http = httpx.Client(base_url=router.url, timeout=30)
        self.fakes = {"a": a, "b": b}

    def usable(self) -> set[str]:
        return {w["id"] for w in self.http.get("/kvkeep/workers").json() if w["usable"]}

    def idle(self) -> bool:
        workers = self.http.get("/kvkeep/workers").json()
        return len(workers) == 2 and all(w["usable"] and w["queue"] == 0 for w in workers)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with loop_thread() as lt, running_fakes(lt, MODEL) as fakes:
        a, b = fakes["a"], fakes["b"]
        config = fake_router_config(fakes, max_body_bytes=64 << 10)
        router = RouterHandle(lt, config).start()
        e = Env(lt, a, b, router)
        wait_until(lambda: e.usable() == {"a", "b"})
        yield e
        e.http.close()
        router.stop()


@pytest.fixture(autouse=True)
def reset(env: Env) -> Iterator[None]:
    yield
    for fake in (env.a, env.b):
        fake.break_after = fake.status = fake.stall_after = None
        fake.running = fake.waiting = 0
        fake.kv_usage = 0.0
        fake.cached_tokens = 0
        fake.returned_params = None
        fake.delay_s = fake.eof_delay_s = 0.0
        fake.healthy = True
    assert env.router.service is not None
    for state in env.router.service.core.workers():
        state.suspect_until = 0.0
        state.consecutive_failures = 0
    wait_until(env.idle)


def text_of(tokens: list[int]) -> str:
    return "".join(f" w{t}" for t in tokens)


def sse_events(body: str) -> tuple[list[dict[str, Any]], list[str]]:
    events, comments = [], []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
        elif line.startswith(":"):
            comments.append(line)
    assert body.rstrip().endswith("data: [DONE]")
    return events, comments


def stream_text(events: list[dict[str, Any]], chat: bool) -> str:
    out = []
    for e in events:
        for c in e.get("choices", []):
            out.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text", ""))
    return "".join(out)


# --- plain endpoints ---------------------------------------------------------------------------
def test_health_models_metrics(env: Env) -> None:
    h = env.http.get("/health").json()
    assert h["status"] == "ok" and h["workers"] == {"registered": 2, "usable": 2}
    assert h["state"] == "memory"
    assert env.http.get("/v1/models").json()["data"][0]["id"] == MODEL
    env.http.post("/v1/completions", json={"model": MODEL, "prompt": "m"})
    metrics = env.http.get("/metrics").text
    assert "kvkeep_router_requests_total" in metrics
    assert 'kvkeep_router_workers{state="usable"} 2.0' in metrics


# --- non-streaming -----------------------------------------------------------------------------
def test_completion_strips_ids_and_forwards_kv_params(env: Env) -> None:
    r = env.http.post("/v1/completions", headers={"X-Session-Id": "u1"},
                      json={"model": MODEL, "prompt": "one two three", "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    expected = fake_generate(fake_tokenize("one two three"), 5)
    assert body["choices"][0]["text"] == text_of(expected)
    assert "token_ids" not in body["choices"][0] and "prompt_token_ids" not in body["choices"][0]
    worker = r.headers["X-KVKeep-Worker"]
    assert r.headers["X-KVKeep-Route"] == "new" and r.headers["X-KVKeep-Session"] == "u1"
    assert r.headers["X-KVKeep-Restore"] == "0" and r.headers["X-KVKeep-Failover"] == "0"
    assert r.headers["X-KVKeep-Cached-Tokens"] == "0"
    sent = env.fakes[worker].requests[-1]
    assert sent["kv_transfer_params"]["session_id"] == "u1"
    assert sent["kv_transfer_params"]["restore"] == "auto"
    assert "restore_reason" not in sent["kv_transfer_params"]
    assert sent["return_token_ids"] is True and "session_id" not in sent
    # the body field names the same session; the second request sticks
    r2 = env.http.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                "session_id": "u1", "return_token_ids": True})
    assert r2.headers["X-KVKeep-Worker"] == worker and r2.headers["X-KVKeep-Route"] == "sticky"
    assert "token_ids" in r2.json()["choices"][0]  # asked for: kept


def test_what_the_connector_reports_becomes_headers(env: Env) -> None:
    """vLLM's cached tokens and the kvkeep connector's returned kv_transfer_params tell the
    client how much of its prompt was reused, restored from the store, and checkpointed."""
    prompt = " ".join(f"w{i}" for i in range(100))
    for fake in (env.a, env.b):
        fake.cached_tokens = 64
        fake.returned_params = {"session_id": "told", "restored_tokens": 48,
                                "checkpointed_tokens": 96, "manifest_generation": 3}
    r = env.http.post("/v1/completions", headers={"X-Session-Id": "told"},
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200
    assert r.headers["X-KVKeep-Cached-Tokens"] == "64"
    assert r.headers["X-KVKeep-Recomputed-Tokens"] == str(len(fake_tokenize(prompt)) - 64)
    assert r.headers["X-KVKeep-Restored-Tokens"] == "48"
    assert r.headers["X-KVKeep-Checkpointed-Tokens"] == "96"
    # A worker without the connector returns nothing of the kind: no such headers.
    for fake in (env.a, env.b):
        fake.returned_params = None
    r = env.http.post("/v1/completions", headers={"X-Session-Id": "told"},
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert "X-KVKeep-Restored-Tokens" not in r.headers
    assert "X-KVKeep-Checkpointed-Tokens" not in r.headers


def test_stateless_requests_carry_no_kv_params(env: Env) -> None:
    r = env.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.headers["X-KVKeep-Route"] == "stateless"
    sent = env.fakes[r.headers["X-KVKeep-Worker"]].requests[-1]
    assert "kv_transfer_params" not in sent and "return_token_ids" not in sent


def test_retry_on_5xx_before_the_response(env: Env) -> None:
    r = env.http.post("/v1/completions", headers={"X-Session-Id": "retry1"},
                      json={"model": MODEL, "prompt": "p", "max_tokens": 2})
    first = r.headers["X-KVKeep-Worker"]
    other = "b" if first == "a" else "a"
    env.fakes[first].status = 503
    r = env.http.post("/v1/completions", headers={"X-Session-Id": "retry1"},
                      json={"model": MODEL, "prompt": "p", "max_tokens": 2})
    assert r.status_code == 200
    assert r.headers["X-KVKeep-Worker"] == other and r.headers["X-KVKeep-Failover"] == "1"
    assert r.headers["X-KVKeep-Restore"] == "1"
    sent = env.fakes[other].requests[-1]["kv_transfer_params"]
    assert sent["restore_reason"] == "failover" and sent["previous_worker"] == first
    # the kvkeep connector accepts exactly what the router sends
    params = pytest.importorskip("connectors.vllm.params").parse_params(sent)
    assert params.session_id == "retry1" and params.mode == "auto"


def test_worker_4xx_passes_through(env: Env) -> None:
    env.a.status = env.b.status = 400
    r = env.http.post("/v1/completions", json={"model": MODEL, "prompt": "p"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "injected"
    r = env.http.post("/v1/completions", json={"model": MODEL, "prompt": "p", "stream": True})
    assert r.status_code == 400


# --- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "status"), [
    (b"{not json", 400),
    (b"[1, 2]", 400),
    (b'{"prompt": "x"}', 400),
    (b'{"model": "nope", "prompt": "x"}', 404),
    (b'{"model": "fake", "prompt": "x", "session_id": "has space"}', 400),
    (b'{"model": "fake", "prompt": "x", "n": "2"}', 400),
])
def test_openai_style_errors(env: Env, body: bytes, status: int) -> None:
    r = env.http.post("/v1/completions", content=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status


def test_oversized_body_is_413(env: Env) -> None:
    r = env.http.post("/v1/completions", content=b'{"model":"fake","prompt":"' +
                      b"x" * (70 << 10) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_bad_session_header_unknown_route_and_method(env: Env) -> None:
    r = env.http.post("/v1/completions", headers={"X-Session-Id": "-bad"},
                      json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"
    assert env.http.get("/v1/nothing").status_code == 404
    assert env.http.get("/v1/completions").status_code == 405


def test_saturated_is_429_with_retry_after(env: Env) -> None:
    env.a.waiting = env.b.waiting = 60
    time.sleep(0.3)  # a few scrapes
    r = env.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"


def test_no_usable_worker_is_503(env: Env) -> None:
    assert env.router.service is not None
    for state in env.router.service.core.workers():
        state.suspect_until = time.monotonic() + 60
    r = env.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 503 and "Retry-After" in r.headers


def test_api_keys(env: Env) -> None:
    """Keys given without a tenant (`--api-key`, `KVKEEP_API_KEYS`) are the `default`
    tenant's; probes need none."""
    assert env.router.service is not None
    svc = env.router.service
    key = "sekret-0123456789"
    svc.config = replace(svc.config, api_keys=ApiKeys.of_keys([key]))
    try:
        assert env.http.get("/v1/models").status_code == 401
        assert env.http.get("/v1/models", headers={"Authorization": "Bearer nope"}
                            ).status_code == 401
        assert env.http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}
                            ).status_code == 200
        assert env.http.get("/health").status_code == 200  # probes need no key
    finally:
        svc.config = replace(svc.config, api_keys=None)


# --- streaming ---------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True])
def test_stream_passthrough(env: Env, chat: bool) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "stream": True,
                            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": "tell me"}]
        prompt = fake_tokenize("user: tell me ")
    else:
        body["prompt"] = "tell me"
        prompt = fake_tokenize("tell me")
    r = env.http.post("/v1/chat/completions" if chat else "/v1/completions", json=body,
                      headers={"X-Session-Id": f"st-{chat}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events, comments = sse_events(r.text)
    assert stream_text(events, chat) == text_of(fake_generate(prompt, 8))
    assert not any("token_ids" in json.dumps(e) for e in events)
    assert events[-1]["usage"]["completion_tokens"] == 8
    summary = json.loads(comments[-1].split(" ", 2)[2])
    assert summary["worker"] == r.headers["X-KVKeep-Worker"] and summary["resumed_on"] == []


def test_streams_reuse_worker_connections(env: Env) -> None:
    """A finished stream's connection to the worker goes back to the pool, even when the end
    of the response comes after the [DONE] the client has already been answered with:
    sequential streams of one session share one connection instead of paying a new one each."""
    worker = env.fakes[env.http.post("/v1/completions", headers={"X-Session-Id": "reuse"},
                                     json={"model": MODEL, "prompt": "r", "max_tokens": 1}
                                     ).headers["X-KVKeep-Worker"]]
    worker.eof_delay_s = 0.02
    before = len(worker.peers)
    service = env.router.service
    assert service is not None
    for _ in range(6):
        r = env.http.post("/v1/completions", headers={"X-Session-Id": "reuse"},
                          json={"model": MODEL, "prompt": "r", "max_tokens": 3, "stream": True})
        assert sse_events(r.text)[0][-1]["choices"][0]["finish_reason"] == "length"
        # The terminator after [DONE] is read in the background: wait until the attempt is
        # finished (its keep-alive read deferred) and every deferred task has ended, so the
        # next stream finds the connection back in the pool however slow the machine is.
        wait_until(lambda: env.idle() and len(service.background) == 0)
    assert len(set(worker.peers[before:])) <= 2


@pytest.mark.parametrize("chat", [False, True])
def test_stream_resumes_on_another_worker(env: Env, chat: bool) -> None:
    sid = f"resume-{chat}"
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 40, "stream": True,
                            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": "a long story"}]
        prompt = fake_tokenize("user: a long story ")
    else:
        body["prompt"] = "a long story"
        prompt = fake_tokenize("a long story")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    first = env.http.post(path, json={**body, "stream": False, "max_tokens": 1},
                          headers={"X-Session-Id": sid}).headers["X-KVKeep-Worker"]
    other = "b" if first == "a" else "a"
    env.fakes[first].break_after = 12  # the worker dies after 12 chunks
    r = env.http.post(path, json=body, headers={"X-Session-Id": sid})
    assert r.status_code == 200 and r.headers["X-KVKeep-Worker"] == first
    events, comments = sse_events(r.text)
    assert stream_text(events, chat) == text_of(fake_generate(prompt, 40))  # nothing lost/doubled
    assert {e["id"] for e in events} == {events[0]["id"]}  # one stream, one id
    assert events[-1]["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 40,
                                   "total_tokens": len(prompt) + 40}
    note = json.loads(comments[0].split(" ", 2)[2])
    assert note["resumed_on"] == other and note["after_tokens"] == (11 if chat else 12)
    cont = env.fakes[other].requests[-1]
    delivered = note["after_tokens"]
    assert cont["prompt"] == prompt + fake_generate(prompt, 40)[:delivered]
    assert cont["max_tokens"] == 40 - delivered
    assert cont["kv_transfer_params"] == {"session_id": sid, "restore": "auto",
                                          "restore_reason": "resumed",
                                          "previous_worker": first, "session_epoch": 1}
    # the session now lives on the worker that finished the stream
    assert env.http.get(f"/kvkeep/sessions/{sid}").json()["worker"] == other


@pytest.mark.parametrize("chat", [False, True])
def test_a_resumed_stream_keeps_its_logprobs(env: Env, chat: bool) -> None:
    """Logprobs asked by the client come back for every token, in the client's format, as an
    unbroken stream gives them: chat entries rebuilt from the continuation's completions
    logprobs, completions text offsets carried on past the break."""
    sid = f"logprobs-{chat}"
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 30, "stream": True}
    if chat:
        body.update(messages=[{"role": "user", "content": "tell me"}], logprobs=True,
                    top_logprobs=2)
    else:
        body.update(prompt="tell me", logprobs=2)
    path = "/v1/chat/completions" if chat else "/v1/completions"

    def logprobs_of(events: list[dict[str, Any]]) -> list[Any]:
        out: list[Any] = []
        for event in events:
            for choice in event["choices"]:
                lp = choice.get("logprobs")
                if lp is not None:
                    out.extend(lp["content"] if chat else [
                        (o, t, v, tp) for o, t, v, tp in zip(
                            lp["text_offset"], lp["tokens"], lp["token_logprobs"],
                            lp["top_logprobs"], strict=True)])
        return out

    unbroken, _ = sse_events(env.http.post(path, json=body,
                                           headers={"X-Session-Id": sid}).text)
    first = env.http.post(path, json={**body, "stream": False, "max_tokens": 1},
                          headers={"X-Session-Id": sid}).headers["X-KVKeep-Worker"]
    other = "b" if first == "a" else "a"
    env.fakes[first].break_after = 9
    events, comments = sse_events(env.http.post(path, json=body,
                                                headers={"X-Session-Id": sid}).text)
    assert json.loads(comments[0].split(" ", 2)[2])["resumed_on"] == other
    assert env.fakes[other].requests[-1]["logprobs"] == 2  # asked of the continuation
    assert stream_text(events, chat) == stream_text(unbroken, chat)
    expected = logprobs_of(unbroken)
    assert len(expected) == 30
    assert logprobs_of(events) == expected


def test_hung_worker_stream_resumes_after_idle_timeout(env: Env) -> None:
    r0 = env.http.post("/v1/completions", headers={"X-Session-Id": "hung"},
                       json={"model": MODEL, "prompt": "h", "max_tokens": 1})
    first = r0.headers["X-KVKeep-Worker"]
    env.fakes[first].stall_after, env.fakes[first].stall_s = 5, 8.0  # silent > 1 s idle limit
    started = time.monotonic()
    r = env.http.post("/v1/completions", headers={"X-Session-Id": "hung"},
                      json={"model": MODEL, "prompt": "h", "max_tokens": 20, "stream": True})
    events, comments = sse_events(r.text)
    assert stream_text(events, False) == text_of(fake_generate(fake_tokenize("h"), 20))
    assert json.loads(comments[0].split(" ", 2)[2])["after_tokens"] == 5
    assert time.monotonic() - started < 6.0  # resumed after the idle limit, not the stall


def test_client_leaving_mid_stream_frees_the_worker(env: Env) -> None:
    env.a.delay_s = env.b.delay_s = 0.02
    with env.http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "bye", "max_tokens": 200, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                break
    wait_until(env.idle)  # in-flight accounting released, both workers usable
    assert env.http.get("/health").status_code == 200


def test_unresumable_stream_break_ends_with_error_event(env: Env) -> None:
    # Every worker breaks its streams: the session's binding may move between two requests
    # (the policy weighs load), so arming only the worker of a first request let the stream
    # land on the other one now and then, unbroken, and left the armed one to break a later
    # test's stream. Its chunks 50 ms apart: the first ones reach the router before the
    # connection is reset (a reset discards what the router has not read yet; with none read,
    # the stream would rightly start over on the other worker, with nothing to resume).
    # Every stream breaks, a retry's too: a break the router takes for one before the stream's
    # first byte is rightly sent again elsewhere, and that attempt must break as well.
    for fake in env.fakes.values():
        fake.break_after, fake.delay_s, fake.break_every = 3, 0.05, True
    try:
        r = env.http.post("/v1/completions", headers={"X-Session-Id": "nores"},
                          json={"model": MODEL, "prompt": "q", "max_tokens": 20,
                                "stream": True, "prompt_logprobs": 1})
    finally:
        for fake in env.fakes.values():
            fake.break_after, fake.delay_s, fake.break_every = None, 0.0, False
    events, _ = sse_events(r.text)
    # The fake worker drops its connection right after its third chunk, which may take that
    # chunk with it: up to three chunks, then the error event, and nothing invented.
    assert events[-1]["error"]["code"] == 502 and 1 <= len(events) <= 4
    assert all("error" not in e for e in events[:-1])


def test_stream_falls_back_before_it_starts(env: Env) -> None:
    r0 = env.http.post("/v1/completions", headers={"X-Session-Id": "fb"},
                       json={"model": MODEL, "prompt": "q", "max_tokens": 1})
    first = r0.headers["X-KVKeep-Worker"]
    env.fakes[first].break_after = 0  # dies before the first chunk
    r = env.http.post("/v1/completions", headers={"X-Session-Id": "fb"},
                      json={"model": MODEL, "prompt": "q", "max_tokens": 6, "stream": True})
    events, _ = sse_events(r.text)
    assert stream_text(events, False) == text_of(fake_generate(fake_tokenize("q"), 6))


# --- sessions: stickiness, migration, failover --------------------------------------------------
def test_sticky_then_migrates_when_overloaded(env: Env) -> None:
    sid = "mig"
    r = env.http.post("/v1/completions", headers={"X-Session-Id": sid},
                      json={"model": MODEL, "prompt": "p", "max_tokens": 1})
    home = r.headers["X-KVKeep-Worker"]
    for _ in range(3):
        r = env.http.post("/v1/completions", headers={"X-Session-Id": sid},
                          json={"model": MODEL, "prompt": "p", "max_tokens": 1})
        assert r.headers["X-KVKeep-Worker"] == home and r.headers["X-KVKeep-Route"] == "sticky"
    env.fakes[home].running, env.fakes[home].waiting = 8, 3  # queueing on the home worker
    time.sleep(0.3)
    r = env.http.post("/v1/completions", headers={"X-Session-Id": sid},
                      json={"model": MODEL, "prompt": "p", "max_tokens": 1})
    new = r.headers["X-KVKeep-Worker"]
    assert new != home and r.headers["X-KVKeep-Route"] == "migrated"
    assert r.headers["X-KVKeep-Migrated"] == "1" and r.headers["X-KVKeep-Restore"] == "1"
    params = env.fakes[new].requests[-1]["kv_transfer_params"]
    assert params["restore"] == "auto" and params["restore_reason"] == "migrated"
    assert params["previous_worker"] == home
    # the restore hint is settled after success; the session sticks to its new worker
    wait_until(lambda: env.http.get(f"/kvkeep/sessions/{sid}").json()["restore_from"] is None)
    r = env.http.post("/v1/completions", headers={"X-Session-Id": sid},
                      json={"model": MODEL, "prompt": "p", "max_tokens": 1})
    assert r.headers["X-KVKeep-Worker"] == new and r.headers["X-KVKeep-Restore"] == "0"


def test_a_fresh_binding_does_not_migrate(env: Env) -> None:
    assert env.router.service is not None
    core = env.router.service.core
    running = core.policy
    core.policy = replace(running, thresholds=replace(running.thresholds,
                                                      migrate_cooldown_s=30.0))
    try:
        r = env.http.post("/v1/completions", headers={"X-Session-Id": "young"},
                          json={"model": MODEL, "prompt": "p", "max_tokens": 1})
        home = r.headers["X-KVKeep-Worker"]
        env.fakes[home].running, env.fakes[home].waiting = 8, 3
        time.sleep(0.3)
        r = env.http.post("/v1/completions", headers={"X-Session-Id": "young"},
                          json={"model": MODEL, "prompt": "p", "max_tokens": 1})
        assert r.headers["X-KVKeep-Worker"] == home and r.headers["X-KVKeep-Route"] == "sticky"
    finally:
        core.policy = running


def test_failover_after_worker_death(env: Env) -> None:
    """A worker stops answering: its agent's probes fail, its registration goes (within the
    TTL), its sessions are rebound, and their next request carries the restore hint."""
    # Both workers registered (an earlier test may have just revived one), then new sessions
    # until each worker holds some: load-aware placement decides where they go, not this test.
    wait_until(lambda: env.usable() == {"a", "b"}, timeout=5)
    sids: list[str] = []
    homes: dict[str, str] = {}
    while set(homes.values()) != {"a", "b"} and len(sids) < 32:
        sid = f"fo{len(sids)}"
        sids.append(sid)
        r = env.http.post("/v1/completions", headers={"X-Session-Id": sid},
                          json={"model": MODEL, "prompt": "p", "max_tokens": 1})
        homes[sid] = r.headers["X-KVKeep-Worker"]
    assert set(homes.values()) == {"a", "b"}
    env.a.healthy = False
    died = time.monotonic()
    took = wait_until(lambda: "a" not in {w["id"] for w in env.http.get("/kvkeep/workers").json()})
    assert took <= 1.0 + 3.0  # the TTL, plus slack for a loaded machine
    moved = [s for s in sids if homes[s] == "a"]
    wait_until(lambda: all(env.http.get(f"/kvkeep/sessions/{s}").json()["worker"] == "b"
                           for s in moved))
    assert time.monotonic() - died <= 1.0 + 3.0
    for sid in moved:
        r = env.http.post("/v1/completions", headers={"X-Session-Id": sid},
                          json={"model": MODEL, "prompt": "p", "max_tokens": 1})
        assert r.headers["X-KVKeep-Worker"] == "b"
        assert r.headers["X-KVKeep-Route"] == "failover"
        assert r.headers["X-KVKeep-Failover"] == "1" and r.headers["X-KVKeep-Restore"] == "1"
        params = env.b.requests[-1]["kv_transfer_params"]
        assert params["restore_reason"] == "failover" and params["previous_worker"] == "a"
    env.a.healthy = True
    wait_until(lambda: env.usable() == {"a", "b"}, timeout=5)
