"""The router tokenizes text prompts so the precise prefix scorer works on text.

Units: the bounded cache, what is tokenized (and what is not), the client's fallbacks against
a stand-in `/tokenize` (slow, failing, missing). With real vLLM workers (in
tests/test_router_vllm.py, whose cluster they share): the router's ids equal vLLM's
`prompt_token_ids` for completions and chat, and a text prompt another client prefilled on one
worker is routed there by the KV-event index.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from deploy.local.services import free_port
from kvstore.errors import ConfigError
from router.front.api import ClientRequest, Endpoint, parse_request
from router.membership.workers import WorkerId, WorkerInfo, WorkerPool
from router.policy import policy_preset
from router.policy_file import load_policy_file
from router.tokenize.cache import TokenCache
from router.tokenize.client import PromptTokenizer
from router.tokenize.prompts import TokenizeSpec, tokenize_input


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
