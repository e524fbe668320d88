"""What is a worker's fault, and how much (issue 22 item 4, trust review H3 and M8).

- A worker that answers with a redirect (302 turns aiohttp's POST into a GET of any URL the
  worker names, 307 re-POSTs the client's body there) is never followed: not for generation,
  not for the scraper's `/metrics`, not for `/tokenize`. The client gets an error, never the
  target's body, and the target gets no request at all.
- A stream that waits for its first bytes longer than the idle timeout (queued, prefilling a
  long prompt) is not broken: the time-to-first-byte deadline is separate and longer, and
  passing it is a soft failure that leaves the worker usable.

Fake workers over real sockets (a hostile worker is what these check); the router is the real
`RouterService`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import pytest
from aiohttp import web

from deploy.local.services import free_port
from router.config import RouterConfig, StaticWorker
from router.membership.workers import WorkerId
from router.policy import policy_preset
from tests.router_harness import FakeWorker, LoopThread, RouterHandle, loop_thread, wait_until

SECRET = "SECRET-OF-THE-TARGET"


@dataclass
class App:
    """A small aiohttp server over a real socket, recording what it was asked."""

    lt: LoopThread
    requests: list[tuple[str, str]] = field(default_factory=list)
    port: int = 0
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def serve(self, app: web.Application) -> App:
        async def start() -> None:
            self.runner = web.AppRunner(app, access_log=None)
            await self.runner.setup()
            self.port = free_port()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        self.lt.run(start())
        return self

    def stop(self) -> None:
        if self.runner is not None:
            self.lt.run(self.runner.cleanup())


def target(lt: LoopThread) -> App:
    """Where a hostile worker's redirects point (an internal service, a metadata endpoint)."""
    app = App(lt)

    async def anything(request: web.Request) -> web.Response:
        app.requests.append((request.method, request.path))
        return web.Response(text=SECRET)

    web_app = web.Application()
    web_app.router.add_route("*", "/{tail:.*}", anything)
    return app.serve(web_app)


def redirecting_worker(lt: LoopThread, to: str, status: list[int]) -> App:
    """A worker that registers honestly (health, models) and answers generation, `/metrics` and
    `/tokenize` with a redirect to `to` (its status: `status[0]`, changeable)."""
    app = App(lt)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "evil"}]})

    async def redirect(request: web.Request) -> web.Response:
        app.requests.append((request.method, request.path))
        await request.read()
        return web.Response(status=status[0], headers={"Location": f"{to}/latest/meta-data"},
                            text="moved")

    web_app = web.Application()
    web_app.router.add_get("/health", health)
    web_app.router.add_get("/v1/models", models)
    web_app.router.add_get("/metrics", redirect)
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
        web_app.router.add_post(path, redirect)
    return app.serve(web_app)


def _router(lt: LoopThread, workers: dict[str, str], **config: Any) -> RouterHandle:
    cfg = RouterConfig(port=free_port(), scrape_interval_s=0.05, static_ttl_s=2.0,
                       static_workers=tuple(StaticWorker(WorkerId(w), u)
                                            for w, u in workers.items()), **config)
    return RouterHandle(lt, cfg).start()


@pytest.fixture(scope="module")
def lt() -> Iterator[LoopThread]:
    with loop_thread() as loop:
        yield loop


def _worker_ids(router: RouterHandle) -> set[str]:
    assert router.service is not None
    return {w.worker_id for w in router.service.core.workers()}


@pytest.mark.parametrize("code", [302, 307])
def test_a_redirect_from_a_worker_is_never_followed(lt: LoopThread, code: int) -> None:
    """Unary and streamed, chat and completions (text prompts: the router tokenizes them
    through the worker's `/tokenize`, which redirects too): every answer is an OpenAI-shaped
    error, none holds the target's body, and the target is never asked, though the worker was
    asked for every endpoint (the scraper's `/metrics` included)."""
    tgt = target(lt)
    evil = redirecting_worker(lt, tgt.url, [code])
    router = _router(lt, {"evil": evil.url})
    try:
        wait_until(lambda: _worker_ids(router) == {"evil"})
        with httpx.Client(base_url=router.url, timeout=30) as http:
            for path, body in (("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}]}),
                               ("/v1/completions", {"prompt": "hi"})):
                for stream in (False, True):
                    r = http.post(path, json={"model": "evil", "max_tokens": 4,
                                              "stream": stream, **body})
                    assert r.status_code in (502, 503), r.text
                    assert SECRET not in r.text and "moved" not in r.text
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
                    assert r.json()["error"]["code"] == r.status_code
                    assert router.service is not None
                    for state in router.service.core.workers():  # try it again next time
                        state.suspect_until = 0.0
        wait_until(lambda: {"/metrics", "/v1/chat/completions", "/v1/completions"}
                   <= {p for _, p in evil.requests})
        assert ("POST", "/v1/chat/completions") in evil.requests
        assert tgt.requests == []
    finally:
        router.stop()
        evil.stop()
        tgt.stop()


def test_a_redirecting_worker_is_failed_and_the_request_served_elsewhere(lt: LoopThread
                                                                          ) -> None:
    """Beside an honest worker: a redirect is that worker's (hard) failure, the request goes to
    the honest one, and the client gets its answer, never the target's body."""
    tgt = target(lt)
    evil = redirecting_worker(lt, tgt.url, [302])
    honest = FakeWorker("evil")  # the same model name: either may be picked
    lt.run(honest.start())
    router = _router(lt, {"evil": evil.url, "honest": honest.url})
    try:
        wait_until(lambda: _worker_ids(router) == {"evil", "honest"})
        with httpx.Client(base_url=router.url, timeout=30) as http:
            served = set()
            for i in range(8):
                r = http.post("/v1/completions", json={"model": "evil", "prompt": f"p {i}",
                                                       "max_tokens": 3})
                assert r.status_code == 200 and SECRET not in r.text, r.text
                served.add(r.headers["X-KVKeep-Worker"])
                assert router.service is not None
                for state in router.service.core.workers():
                    state.suspect_until = 0.0
            assert served == {"honest"}
        assert ("POST", "/v1/completions") in evil.requests
        assert tgt.requests == []
    finally:
        router.stop()
        evil.stop()
        lt.run(honest.stop())
        tgt.stop()


def slow_first_byte_worker(lt: LoopThread, delay: list[float], *, headers_first: bool) -> App:
    """A worker whose stream starts late (queued, prefilling): `delay[0]` seconds before its
    first event (`headers_first`: the headers come at once, as vLLM sends them), then 5
    events at once."""
    app = App(lt)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "slow"}]})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        app.requests.append(("POST", request.path))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if headers_first:
            await resp.prepare(request)
        await asyncio.sleep(delay[0])
        if not headers_first:
            await resp.prepare(request)
        ids = body.get("prompt") if isinstance(body.get("prompt"), list) else [1, 2]
        for i in range(5):
            choice: dict[str, Any] = {"index": 0, "text": f" t{i}", "token_ids": [10 + i],
                                      "finish_reason": "length" if i == 4 else None}
            if i == 0:
                choice["prompt_token_ids"] = ids
            await resp.write(b"data: " + json.dumps(
                {"id": "c", "object": "text_completion", "created": 1, "model": "slow",
                 "choices": [choice]}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    web_app = web.Application()
    web_app.router.add_get("/health", health)
    web_app.router.add_get("/v1/models", models)
    web_app.router.add_get("/metrics", metrics)
    web_app.router.add_post("/v1/completions", completions)
    return app.serve(web_app)


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("headers_first", [True, False])
def test_a_late_first_byte_is_not_a_dead_worker(lt: LoopThread, headers_first: bool) -> None:
    """A stream whose first bytes come after the idle timeout (but within the first-byte
    deadline) is relayed whole, and nothing is counted against its worker. One whose first
    bytes miss the first-byte deadline too ends with an error event (no other worker to start
    it on) and is counted as a soft failure: the worker stays usable."""
    delay = [0.6]
    slow = slow_first_byte_worker(lt, delay, headers_first=headers_first)
    policy = replace(policy_preset("kvkeep"), tokenize=replace(policy_preset("kvkeep").tokenize,
                                                               mode="off"))
    router = _router(lt, {"slow": slow.url}, stream_idle_timeout_s=0.2,
                     first_byte_timeout_s=3.0, policy=policy)
    try:
        wait_until(lambda: _worker_ids(router) == {"slow"})
        assert router.service is not None
        core = router.service.core
        registry = router.service.metrics.registry

        def failures() -> float:
            return registry.get_sample_value("kvkeep_router_upstream_failures_total",
                                             {"worker": "slow"}) or 0.0

        with httpx.Client(base_url=router.url, timeout=30) as http:
            r = http.post("/v1/completions", json={"model": "slow", "prompt": "x",
                                                   "max_tokens": 5, "stream": True})
            events = _events(r.text)
            assert [e for e in events if "error" in e] == []
            assert "".join(c["text"] for e in events for c in e["choices"]) == \
                "".join(f" t{i}" for i in range(5))
            assert failures() == 0
            # past the first-byte deadline too (a second router with a short one)
            delay[0] = 1.0
            short = _router(lt, {"slow": slow.url}, stream_idle_timeout_s=0.2,
                            first_byte_timeout_s=0.4, policy=policy)
            try:
                wait_until(lambda: _worker_ids(short) == {"slow"})
                assert short.service is not None
                r = httpx.post(f"{short.url}/v1/completions", timeout=30, json={
                    "model": "slow", "prompt": "x", "max_tokens": 5, "stream": True})
                if r.status_code == 200:
                    errors = [e["error"] for e in _events(r.text) if "error" in e]
                    assert len(errors) == 1 and errors[0]["code"] == 502
                else:  # no headers in time (headers_first False): no stream started, and
                    # no other worker to try
                    assert r.status_code in (502, 503)
                    assert r.json()["error"]["code"] == r.status_code
                state = next(iter(short.service.core.workers()))
                assert short.service.core.usable(state)
                assert short.service.metrics.registry.get_sample_value(
                    "kvkeep_router_upstream_failures_total", {"worker": "slow"}) == 1
            finally:
                short.stop()
        assert all(core.usable(w) for w in core.workers())
    finally:
        router.stop()
        slow.stop()
