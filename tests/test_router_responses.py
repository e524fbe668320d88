"""`POST /v1/responses` (the OpenAI Responses API) and `/v1/completions` with `echo` through the
HTTP proxy, against fake workers (`tests/router_harness.py`'s `FakeWorker._responses`): routed
with the session and tenant rules of the other endpoints, failed over before the first byte,
and, mid-stream, never resumed: a break ends the stream with the API's own failure events
(`router/streaming/responses_api.py`), the worker marked. Real sockets, in-process state."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from router.errors import BadRequest
from router.front.api import Endpoint, parse_request
from router.streaming.relay import StreamBroken
from router.streaming.responses_api import EventStream, _relay_event
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


class Env:
    def __init__(self, lt: LoopThread, fakes: dict[str, FakeWorker], router: RouterHandle
                 ) -> None:
        self.lt, self.fakes, self.router = lt, fakes, router
        self.http = httpx.Client(base_url=router.url, timeout=30)

    def usable(self) -> set[str]:
        assert self.router.service is not None
        core = self.router.service.core
        return {s.worker_id for s in core.workers() if core.usable(s)}

    def failures(self, worker: str) -> float:
        """Failures the router has counted against `worker` so far (its counter: the pool's
        own count is reset by every good scrape)."""
        assert self.router.service is not None
        return self.router.service.metrics.registry.get_sample_value(
            "kvkeep_router_upstream_failures_total", {"worker": worker}) or 0.0


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with loop_thread() as lt, running_fakes(lt, MODEL) as fakes:
        router = RouterHandle(lt, fake_router_config(fakes)).start()
        e = Env(lt, fakes, router)
        wait_until(lambda: e.usable() == {"a", "b"})
        yield e
        e.http.close()
        router.stop()


@pytest.fixture(autouse=True)
def reset(env: Env) -> Iterator[None]:
    yield
    for fake in env.fakes.values():
        fake.break_after = fake.status = None
        fake.cached_tokens = 0
        fake.delay_s = 0.0
    assert env.router.service is not None
    for state in env.router.service.core.workers():
        state.suspect_until = 0.0
        state.consecutive_failures = 0
    wait_until(lambda: env.usable() == {"a", "b"})


def text_of(tokens: list[int]) -> str:
    return "".join(f" w{t}" for t in tokens)


def expected_text(instructions: str, text: str, n: int) -> str:
    """What the fake worker answers `input` `text` with (`FakeWorker._responses`)."""
    return text_of(fake_generate(fake_tokenize(f"{instructions} {text}"), n))


def typed_events(body: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event of a Responses API stream; comments skipped."""
    out = []
    for block in body.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        name = next(line[7:] for line in lines if line.startswith("event: "))
        data = json.loads("\n".join(line[6:] for line in lines if line.startswith("data: ")))
        assert data["type"] == name
        out.append((name, data))
    return out


def streamed_text(events: list[tuple[str, dict[str, Any]]]) -> str:
    return "".join(d["delta"] for name, d in events if name == "response.output_text.delta")


# --- parsing -----------------------------------------------------------------------------------
def test_parsing_reads_the_prompt_and_the_limit_as_vllm_does() -> None:
    """`instructions` then `input` (a string, or items) are the prompt text for prefix
    routing; `max_output_tokens` is the limit (none: what the context leaves); never
    resumable; ill-typed fields the router relies on are its 400s."""
    raw = json.dumps({"model": MODEL, "instructions": "be brief", "input": "hi",
                      "max_output_tokens": 7, "stream": True, "session_id": "s-1"}).encode()
    creq = parse_request(Endpoint.RESPONSES, raw, None)
    assert creq.prompt_text == "system:be brief\nuser:hi\n"
    assert creq.max_tokens == 7 and creq.stream and not creq.resumable
    assert creq.session_id == "s-1" and "session_id" not in creq.body
    items = [{"role": "user", "content": [{"type": "input_text", "text": "a"}]},
             {"type": "function_call_output", "call_id": "c", "output": "42"}]
    creq = parse_request(Endpoint.RESPONSES, json.dumps(
        {"model": MODEL, "input": items}).encode(), None)
    assert creq.prompt_text == "user:a\nfunction_call_output:42\n" and creq.max_tokens is None
    for bad, param in (({"input": 3}, "input"), ({"input": [1]}, "input"),
                       ({"input": "x", "instructions": 1}, "instructions"),
                       ({"input": "x", "max_output_tokens": "9"}, "max_output_tokens")):
        with pytest.raises(BadRequest) as exc:
            parse_request(Endpoint.RESPONSES, json.dumps({"model": MODEL, **bad}).encode(), None)
        assert exc.value.param == param


# --- routed -------------------------------------------------------------------------------------
def test_unary_is_routed_and_passed_through(env: Env) -> None:
    env.fakes["a"].cached_tokens = env.fakes["b"].cached_tokens = 1
    r = env.http.post("/v1/responses", json={"model": MODEL, "input": "hello there",
                                             "instructions": "sys", "max_output_tokens": 5})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "response" and out["status"] == "completed"
    assert out["output"][0]["content"][0]["text"] == expected_text("sys", "hello there", 5)
    worker = r.headers["X-KVKeep-Worker"]
    assert out["id"] in env.fakes[worker].stored
    sent = env.fakes[worker].requests[-1]
    assert "return_token_ids" not in sent  # the worker is not asked for what it cannot give
    assert r.headers["X-KVKeep-Route"] == "stateless"
    assert r.headers["X-KVKeep-Cached-Tokens"] == "1"
    assert r.headers["X-KVKeep-Recomputed-Tokens"] == str(len(fake_tokenize("sys hello there"))
                                                          - 1)


def test_stream_is_relayed_event_by_event(env: Env) -> None:
    """The worker's typed events reach the client as it sent them, ended by its
    `response.completed` (no `[DONE]`: the Responses API has none)."""
    r = env.http.post("/v1/responses", json={"model": MODEL, "input": "stream me",
                                             "max_output_tokens": 6, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = typed_events(r.text)
    assert [n for n, _ in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1][0] == "response.completed"
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert streamed_text(events) == expected_text("", "stream me", 6)
    assert "[DONE]" not in r.text
    assert events[-1][1]["response"]["id"] in env.fakes[r.headers["X-KVKeep-Worker"]].stored


def test_the_workers_own_4xx_passes_through(env: Env) -> None:
    """A `previous_response_id` the worker does not have is its 404, passed on as it is (not a
    failure of the worker: nothing is tried elsewhere)."""
    before = {w: env.failures(w) for w in env.fakes}
    for stream in (False, True):
        r = env.http.post("/v1/responses", json={"model": MODEL, "input": "x",
                                                 "previous_response_id": "resp_nope",
                                                 "stream": stream})
        assert r.status_code == 404 and "resp_nope" in r.json()["error"]["message"]
    assert {w: env.failures(w) for w in env.fakes} == before


# --- sessions and tenants -----------------------------------------------------------------------
def test_a_session_sticks_and_keeps_previous_response_id_on_its_worker(env: Env) -> None:
    """With `X-Session-Id` every turn goes to the session's worker, so the response a turn
    names in `previous_response_id` (kept in that worker's memory) is found."""
    sid = {"X-Session-Id": "resp-sticky"}
    r = env.http.post("/v1/responses", headers=sid, json={"model": MODEL, "input": "one"})
    home = r.headers["X-KVKeep-Worker"]
    assert r.headers["X-KVKeep-Route"] == "new"
    previous = r.json()["id"]
    for stream in (False, True, False):
        r = env.http.post("/v1/responses", headers=sid, json={
            "model": MODEL, "input": "two", "previous_response_id": previous,
            "stream": stream})
        assert r.status_code == 200, r.text
        assert r.headers["X-KVKeep-Worker"] == home and r.headers["X-KVKeep-Route"] == "sticky"
        previous = typed_events(r.text)[-1][1]["response"]["id"] if stream else r.json()["id"]
        assert previous in env.fakes[home].stored
    params = env.fakes[home].requests[-1]["kv_transfer_params"]
    assert params["session_id"] == "resp-sticky"


def test_another_tenants_session_is_a_404(env: Env) -> None:
    assert env.router.service is not None
    svc = env.router.service
    svc.config = replace(svc.config, api_keys=ApiKeys({KEYS["alice"]: "alice",
                                                       KEYS["bob"]: "bob"}))

    def auth(who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEYS[who]}", "X-Session-Id": "resp-owned"}

    try:
        body = {"model": MODEL, "input": "secret plans", "max_output_tokens": 2}
        assert env.http.post("/v1/responses", json=body).status_code == 401
        r = env.http.post("/v1/responses", json=body, headers=auth("alice"))
        assert r.status_code == 200 and r.headers["X-KVKeep-Route"] == "new"
        home = env.fakes[r.headers["X-KVKeep-Worker"]]
        assert svc.config.api_keys is not None
        # the tenant's salt, as on the other endpoints (its prefix cache is its own)
        assert home.requests[-1]["cache_salt"] == svc.config.api_keys.cache_salt("alice")
        for stream in (False, True):
            r = env.http.post("/v1/responses", json={**body, "stream": stream},
                              headers=auth("bob"))
            assert r.status_code == 404 and r.json()["error"]["param"] == "session_id"
        r = env.http.post("/v1/responses", json=body, headers=auth("alice"))
        assert r.status_code == 200 and r.headers["X-KVKeep-Route"] == "sticky"
    finally:
        svc.config = replace(svc.config, api_keys=None)


# --- failures -----------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_fails_over_before_the_first_byte(env: Env, stream: bool) -> None:
    """A session's worker answering 503, or (streaming) dying before its first event, fails
    the request over to the other worker, the client none the wiser."""
    sid = {"X-Session-Id": f"resp-fo-{stream}"}
    r = env.http.post("/v1/responses", headers=sid, json={"model": MODEL, "input": "q",
                                                          "max_output_tokens": 1})
    first = r.headers["X-KVKeep-Worker"]
    other = "b" if first == "a" else "a"
    body = {"model": MODEL, "input": "q", "max_output_tokens": 4, "stream": stream}
    env.fakes[first].status = 503
    r = env.http.post("/v1/responses", headers=sid, json=body)
    assert r.status_code == 200 and r.headers["X-KVKeep-Worker"] == other
    assert r.headers["X-KVKeep-Failover"] == "1"
    text = streamed_text(typed_events(r.text)) if stream \
        else r.json()["output"][0]["content"][0]["text"]
    assert text == expected_text("", "q", 4)
    if stream:  # now a stream that opens and dies before its first event, on `other`
        env.fakes[first].status = None
        env.fakes[other].break_after = 0
        before = env.failures(other)
        r = env.http.post("/v1/responses", headers=sid, json=body)
        assert r.status_code == 200
        events = typed_events(r.text)
        assert events[-1][0] == "response.completed"
        assert streamed_text(events) == expected_text("", "q", 4)
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
        assert env.failures(other) == before + 1
        assert events[-1][1]["response"]["id"] in env.fakes[first].stored


def test_a_redirect_is_the_workers_failure(env: Env) -> None:
    """A 3xx is never followed nor relayed: the worker failed, the other one answers."""
    sid = {"X-Session-Id": "resp-redirect"}
    r = env.http.post("/v1/responses", headers=sid, json={"model": MODEL, "input": "r"})
    home = r.headers["X-KVKeep-Worker"]
    env.fakes[home].status = 307
    before = env.failures(home)
    for stream in (False, True):
        r = env.http.post("/v1/responses", headers=sid, json={"model": MODEL, "input": "r",
                                                              "stream": stream})
        assert r.status_code == 200 and r.headers["X-KVKeep-Worker"] != home
    assert env.failures(home) > before


def test_a_break_mid_stream_ends_with_the_failure_events(env: Env) -> None:
    """Not resumed: after some events the client gets an `error` event and a
    `response.failed` (the created response, status failed, its error), numbered after the
    last event it had, and the stream ends; the worker is marked."""
    sid = {"X-Session-Id": "resp-break"}
    r = env.http.post("/v1/responses", headers=sid, json={"model": MODEL, "input": "b",
                                                          "max_output_tokens": 1})
    home = r.headers["X-KVKeep-Worker"]
    env.fakes[home].break_after = 6  # created, in_progress, item, part, 2 deltas
    # A pause after each event: the router has read the sixth before the socket is reset
    # (a reset can discard what the router had not read yet, and with it the events).
    env.fakes[home].delay_s = 0.02
    before = env.failures(home)
    r = env.http.post("/v1/responses", headers=sid, json={
        "model": MODEL, "input": "b", "max_output_tokens": 8, "stream": True})
    assert r.status_code == 200
    events = typed_events(r.text)
    names = [n for n, _ in events]
    assert names[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert names[4:] == ["response.output_text.delta"] * 2 + ["error", "response.failed"]
    assert [d["sequence_number"] for _, d in events] == list(range(8))
    error, failed = events[-2][1], events[-1][1]
    assert error["code"] == "server_error" and "not resumed" in error["message"]
    assert error["param"] is None
    created = events[0][1]["response"]
    assert failed["response"]["id"] == created["id"]
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": error["message"]}
    assert streamed_text(events) == expected_text("", "b", 8)[:len(streamed_text(events))]
    assert env.failures(home) == before + 1 and home not in env.usable()
    # only the broken worker was asked: nothing was resumed elsewhere
    other = "b" if home == "a" else "a"
    assert not any(q.get("input") == "b" and q.get("max_output_tokens") == 8
                   for q in env.fakes[other].requests)


def test_the_workers_error_event_is_a_broken_stream() -> None:
    """vLLM's own `error` event mid-stream (typed, or the other endpoints' untyped
    `{"error": ...}`) is the worker's failure, never relayed as if the answer went on; the
    events before it are relayed and counted."""
    stream, batch = EventStream(), list[bytes]()
    delta = [b"event: response.output_text.delta",
             b'data: {"type":"response.output_text.delta","delta":"x","sequence_number":4}']
    assert not _relay_event(delta, stream, batch)
    assert batch == [b"\n".join(delta) + b"\n\n"] and stream.sequence == 4
    for lines in ([b"event: error", b'data: {"type":"error","code":"x","message":"boom",'
                   b'"param":null,"sequence_number":5}'],
                  [b'data: {"error":{"message":"boom","type":"InternalServerError"}}']):
        with pytest.raises(StreamBroken, match="boom"):
            _relay_event(lines, stream, batch)
    assert stream.events == 1 and len(batch) == 1 and not stream.done


def test_stateful_continuation_is_refused(env: Env) -> None:
    r = env.http.post("/v1/responses", headers={"X-Session-Id": "resp-cont"},
                      json={"model": MODEL, "input": "x", "continue_session": True})
    assert r.status_code == 400 and "previous_response_id" in r.json()["error"]["message"]


@pytest.mark.parametrize("extra", [{"echo": True}, {"suffix": " and the end"},
                                   {"prompt_logprobs": 1}], ids=["echo", "suffix",
                                                                 "prompt_logprobs"])
def test_completions_with_echo_end_with_an_error_event_on_a_break(env: Env,
                                                                  extra: dict[str, Any]
                                                                  ) -> None:
    """`echo`, `suffix` and `prompt_logprobs` are not resumed (a continuation's prompt is the
    answer so far, not the client's: it would echo, fill around or score another prompt): a
    break ends the stream with an OpenAI-shaped error event, nothing is sent to another
    worker, and the worker is marked. (vLLM 0.32 refuses the last two in a stream on a model
    without fill-in-the-middle rendering; an engine that streams them is still never
    resumed.)"""
    sid = {"X-Session-Id": f"not-resumed-{next(iter(extra))}"}
    r = env.http.post("/v1/completions", headers=sid, json={"model": MODEL, "prompt": "e",
                                                            "max_tokens": 1})
    home = r.headers["X-KVKeep-Worker"]
    other = "b" if home == "a" else "a"
    asked = len(env.fakes[other].requests)
    env.fakes[home].break_after = 3
    env.fakes[home].delay_s = 0.02  # the third chunk read before the reset (see above)
    before = env.failures(home)
    r = env.http.post("/v1/completions", headers=sid, json={
        "model": MODEL, "prompt": "e", "max_tokens": 8, "stream": True, **extra})
    assert r.status_code == 200
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert len(chunks) == 4 and all("choices" in c for c in chunks[:3])
    sent = "".join(c["choices"][0]["text"] for c in chunks[:3])
    assert sent and text_of(fake_generate(fake_tokenize("e"), 8)).startswith(sent)
    error = chunks[-1]["error"]
    assert error["code"] == 502 and error["type"] == "upstream_error"
    assert "worker failed mid-stream" in error["message"]
    assert env.failures(home) == before + 1
    assert len(env.fakes[other].requests) == asked  # nothing resumed there


def test_an_echo_is_not_asked_for_token_ids(env: Env) -> None:
    """vLLM 0.32 echoes a completions prompt's text only when `return_token_ids` is off (with
    it, the prompt's ids and no text): the router, which asks every stream and every session's
    request for token ids, asks none of an echo (found by the real-vLLM SIGKILL test, where
    the echoed prompt never reached the client). A client asking them itself gets them, and
    vLLM's own answer to that."""
    sid = {"X-Session-Id": "echo-ids"}
    body = {"model": MODEL, "prompt": "e", "max_tokens": 3}
    for extra, asked in (({"echo": True}, False), ({"echo": True, "stream": True}, False),
                         ({"echo": True, "return_token_ids": True}, True),
                         ({"stream": True}, True), ({}, True)):
        r = env.http.post("/v1/completions", headers=sid, json={**body, **extra})
        assert r.status_code == 200, r.text
        sent = env.fakes[r.headers["X-KVKeep-Worker"]].requests[-1]
        assert bool(sent.get("return_token_ids")) is asked, extra
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "e"}], "echo": True,
            "max_tokens": 3, "stream": True}  # chat echoes the last message either way
    r = env.http.post("/v1/chat/completions", headers=sid, json=chat)
    assert env.fakes[r.headers["X-KVKeep-Worker"]].requests[-1]["return_token_ids"] is True
