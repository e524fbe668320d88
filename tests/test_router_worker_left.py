"""A stream whose worker leaves the registry while the stream is silent is resumed at once, not
after the idle timeout (issue 22: "resumed after the worker's lease expired").

A frozen or partitioned node keeps its TCP connections open: nothing breaks them, and the relay
would wait out `stream_idle_timeout_s` (30 s by default) before resuming. Its lease expires
within its TTL, though, and every replica drops it from the registry then: the relay asks, each
`LIVENESS_POLL_S` of silence, whether its worker is still registered.

Fake workers over real sockets (what a silent worker does is what this checks); the router is
the real `RouterService` with its static workers' agents, which revoke a worker's lease when its
`/health` fails. `tests/test_router_lease_vllm.py` does the same with real vLLM workers, a
frozen process and a lease that expires on its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from deploy.local.services import free_port
from router.config import RouterConfig, StaticWorker
from router.membership.workers import WorkerId
from router.policy import Thresholds, policy_preset
from tests.router_harness import (
    FakeWorker,
    LoopThread,
    RouterHandle,
    fake_generate,
    fake_tokenize,
    loop_thread,
    wait_until,
)

MODEL = "fake"
# Far past the test's own client timeout: a stream resumed only by the idle timeout fails it.
IDLE_S = 600.0
CLIENT_TIMEOUT_S = 20.0


@pytest.fixture()
def env() -> Iterator[tuple[LoopThread, FakeWorker, FakeWorker, RouterHandle]]:
    with loop_thread() as lt:
        a, b = FakeWorker(MODEL), FakeWorker(MODEL)
        lt.run(a.start())
        lt.run(b.start())
        config = RouterConfig(
            port=free_port(), scrape_interval_s=0.05, static_ttl_s=1.0,
            static_workers=(StaticWorker(WorkerId("a"), a.url), StaticWorker(WorkerId("b"), b.url)),
            policy=replace(policy_preset("kvkeep"),
                           thresholds=Thresholds(max_waiting=50, migrate_cooldown_s=0.0)),
            stream_idle_timeout_s=IDLE_S, first_byte_timeout_s=IDLE_S)
        router = RouterHandle(lt, config).start()
        try:
            yield lt, a, b, router
        finally:
            router.stop()
            lt.run(a.stop())
            lt.run(b.stop())


def _usable(http: httpx.Client) -> set[str]:
    return {w["id"] for w in http.get("/kvkeep/workers").json() if w["usable"]}


def test_a_silent_stream_of_a_departed_worker_resumes_without_the_idle_timeout(
        env: tuple[LoopThread, FakeWorker, FakeWorker, RouterHandle]) -> None:
    _, a, b, router = env
    fakes = {"a": a, "b": b}
    with httpx.Client(base_url=router.url, timeout=CLIENT_TIMEOUT_S) as http:
        wait_until(lambda: _usable(http) == {"a", "b"})
        first = http.post("/v1/completions", headers={"X-Session-Id": "frozen"},
                          json={"model": MODEL, "prompt": "f", "max_tokens": 1}
                          ).headers["X-KVKeep-Worker"]
        other = "b" if first == "a" else "a"
        frozen = fakes[first]
        # Silent after 6 chunks for longer than the client waits; its health fails meanwhile,
        # so its agent revokes the lease (as an expired one would drop it).
        frozen.stall_after, frozen.stall_s = 6, CLIENT_TIMEOUT_S + 5
        with http.stream("POST", "/v1/completions", headers={"X-Session-Id": "frozen"},
                         json={"model": MODEL, "prompt": "f", "max_tokens": 24,
                               "stream": True}) as r:
            lines = r.iter_lines()
            events: list[dict[str, Any]] = []
            comments: list[str] = []
            for line in lines:
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 6:
                        frozen.healthy = False
                elif line.startswith(": kvkeep"):
                    comments.append(line)
        text = "".join(c["text"] for e in events for c in e["choices"])
        assert text == "".join(f" w{t}" for t in fake_generate(fake_tokenize("f"), 24))
        resumed = json.loads(comments[0].split(" ", 2)[2])
        assert resumed["resumed_on"] == other and resumed["after_tokens"] == 6
        assert other in _usable(http) and first not in _usable(http)
