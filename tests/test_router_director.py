"""The request director without the HTTP front: a request's whole life (placed, sent, relayed
to a sink, resumed after a break, finished, hooks) driven with the director's own entry point
and a sink of the test's, against two fake workers over real sockets (issue 22 item 2).

What the HTTP front adds (parsing, error answers, headers on the wire) is
`tests/test_router_proxy.py`'s; here: a front only has to give the director an admitted
request and a sink, the streaming hooks see exactly what the client got of the worker's
answer and its end once, and every attempt is finished exactly once."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from router.decision import Placement
from router.front.admission import admit
from router.front.api import ClientRequest, Endpoint, parse_request
from router.front.director import Reply, RequestDirector
from router.hooks import Outcome
from router.service import RouterService
from router.streaming.state import StreamState
from router.tenants import DEFAULT_TENANT
from tests.router_harness import (
    FakeWorker,
    LoopThread,
    fake_generate,
    fake_router_config,
    fake_tokenize,
    loop_thread,
    running_fakes,
    wait_until,
)

MODEL = "fake"


@dataclass
class ListSink:
    """A client's stream as a list: what a front's sink would have sent."""

    headers: dict[str, str] | None = None
    writes: list[bytes] = field(default_factory=list)
    last: bytes | None = None

    async def prepare(self, headers: Mapping[str, str]) -> None:
        assert self.headers is None, "prepared twice"
        self.headers = dict(headers)

    async def write(self, data: bytes) -> None:
        assert self.headers is not None and self.last is None, "written outside the stream"
        self.writes.append(data)

    async def write_eof(self, data: bytes) -> None:
        assert self.headers is not None and self.last is None, "ended twice"
        self.last = data

    @property
    def body(self) -> bytes:
        return b"".join(self.writes) + (self.last or b"")


@dataclass
class Watch:
    """A `ResponseStreaming` hook that keeps what it is shown."""

    chunks: list[bytes] = field(default_factory=list)
    ends: list[list[int]] = field(default_factory=list)

    def on_chunk(self, state: StreamState, data: bytes) -> None:
        self.chunks.append(data)

    async def on_end(self, state: StreamState) -> dict[str, Any]:
        self.ends.append(list(state.generated))
        return {"watched_chunks": len(self.chunks)}


@dataclass
class Finished:
    """A post-response hook: every attempt's end, by worker."""

    calls: list[tuple[str, bool]] = field(default_factory=list)

    def post_response(self, placement: Placement, outcome: Outcome) -> None:
        self.calls.append((placement.worker, outcome.ok))


class Env:
    def __init__(self, lt: LoopThread, service: RouterService, fakes: dict[str, FakeWorker]
                 ) -> None:
        self.lt, self.service, self.fakes = lt, service, fakes
        self.finished = Finished()
        service.core.post_response.append(self.finished)

    def director(self, watch: Watch, *, max_resumes: int = 2) -> RequestDirector:
        return RequestDirector(self.service.dispatcher, None, max_resumes=max_resumes,
                               streaming=[watch])

    def usable(self) -> set[str]:
        core = self.service.core
        return {s.worker_id for s in core.workers() if core.usable(s)}


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with loop_thread() as lt, running_fakes(lt, MODEL) as fakes:
        service = RouterService(fake_router_config(fakes))
        lt.run(service.start())
        e = Env(lt, service, fakes)
        wait_until(lambda: e.usable() == {"a", "b"})
        yield e
        lt.run(service.stop())


@pytest.fixture(autouse=True)
def reset(env: Env) -> Iterator[None]:
    yield
    for fake in env.fakes.values():
        fake.break_after = fake.status = None
    for state in env.service.core.workers():
        state.suspect_until = 0.0
        state.consecutive_failures = 0
    wait_until(lambda: env.usable() == {"a", "b"})


def admitted(body: dict[str, Any], session: str | None = None) -> ClientRequest:
    return admit(parse_request(Endpoint.COMPLETIONS, json.dumps(body).encode(), session),
                 DEFAULT_TENANT, keys=None)


def events_and_comments(body: bytes) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    events, comments = [], []
    for line in body.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
        elif line.startswith(": kvkeep "):
            comments.append(json.loads(line[len(": kvkeep "):]))
    return events, comments


def text(events: list[dict[str, Any]]) -> str:
    return "".join(c.get("text", "") for e in events for c in e.get("choices", []))


def bind(env: Env, director: RequestDirector, sid: str) -> str:
    """Bind session `sid` with a one-token unary turn; its worker."""
    reply = env.lt.run(director.generate(
        admitted({"model": MODEL, "prompt": "bind", "max_tokens": 1}, sid), ListSink()))
    assert isinstance(reply, Reply) and reply.status == 200
    return reply.headers["X-KVKeep-Worker"]


def test_a_broken_stream_resumes_through_the_director_and_its_hooks_see_what_the_client_got(
        env: Env) -> None:
    watch = Watch()
    director = env.director(watch)
    first = bind(env, director, "director-resume")
    other = "b" if first == "a" else "a"
    env.finished.calls.clear()
    env.fakes[first].break_after = 7
    sink = ListSink()
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 30, "stream": True}
    assert env.lt.run(director.generate(admitted(body, "director-resume"), sink)) is None
    assert sink.headers is not None and sink.last is not None
    assert sink.headers["X-KVKeep-Worker"] == first
    assert sink.headers["Content-Type"] == "text/event-stream"
    expected = fake_generate(fake_tokenize("a long story"), 30)
    events, comments = events_and_comments(sink.body)
    assert text(events) == "".join(f" w{t}" for t in expected)  # nothing lost or doubled
    assert sink.body.endswith(b"data: [DONE]\n\n")
    # The hooks saw the worker's events, all of them and only them (no router comment).
    seen, seen_comments = events_and_comments(b"".join(watch.chunks))
    assert seen == events and seen_comments == []
    assert watch.ends == [expected]  # the end, once, with every token delivered
    resumed, summary = comments
    assert resumed["resumed_on"] == other and resumed["after_tokens"] == 7
    assert summary["resumed_on"] == [other] and summary["watched_chunks"] == len(watch.chunks)
    # Each attempt finished exactly once: the broken one failed, the resumption whole.
    assert env.finished.calls == [(first, False), (other, True)]


def test_a_unary_request_is_a_reply_and_no_stream(env: Env) -> None:
    watch = Watch()
    director = env.director(watch)
    env.finished.calls.clear()
    sink = ListSink()
    reply = env.lt.run(director.generate(
        admitted({"model": MODEL, "prompt": "hello there", "max_tokens": 5}), sink))
    assert isinstance(reply, Reply) and reply.status == 200
    assert reply.content_type == "application/json"
    assert reply.headers["X-KVKeep-Route"] == "stateless"
    obj = json.loads(reply.body)
    assert obj["choices"][0]["text"] == "".join(
        f" w{t}" for t in fake_generate(fake_tokenize("hello there"), 5))
    assert sink.headers is None and watch.chunks == [] and watch.ends == []
    assert env.finished.calls == [(reply.headers["X-KVKeep-Worker"], True)]


def test_a_stream_the_worker_refuses_is_its_reply_and_the_sink_stays_unopened(env: Env) -> None:
    watch = Watch()
    director = env.director(watch)
    env.finished.calls.clear()
    for fake in env.fakes.values():
        fake.status = 400
    sink = ListSink()
    reply = env.lt.run(director.generate(
        admitted({"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True}), sink))
    assert isinstance(reply, Reply) and reply.status == 400
    assert json.loads(reply.body)["error"]["code"] == 400
    assert sink.headers is None and sink.writes == [] and watch.ends == []
    assert len(env.finished.calls) == 1 and not env.finished.calls[0][1]


def test_a_stream_that_cannot_resume_ends_with_an_error_event_and_no_end_hook(env: Env) -> None:
    watch = Watch()
    director = env.director(watch, max_resumes=0)
    first = bind(env, director, "director-refused")
    env.finished.calls.clear()
    env.fakes[first].break_after = 4
    sink = ListSink()
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 30, "stream": True}
    assert env.lt.run(director.generate(admitted(body, "director-refused"), sink)) is None
    events, _ = events_and_comments(sink.body)
    assert events[-1]["error"]["type"] == "upstream_error"
    assert "worker failed mid-stream" in events[-1]["error"]["message"]
    # What reached the client before the break was shown to the hooks; no end was.
    seen, _ = events_and_comments(b"".join(watch.chunks))
    assert seen == events[:-1] and len(seen) == 4
    assert watch.ends == []
    assert env.finished.calls == [(first, False)]
