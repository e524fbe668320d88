"""The router's structures bounded where clients or workers choose their size (trust-review
L4, the router parts): the continuation renderer's cache of open renderings, the `/tokenize`
answers the router reads (renderer and prompt tokenizer), and the ext_proc endpoint book,
which also resolves host names again on a TTL so a rescheduled pod's old IP stops receiving
prompts. The `/tokenize` servers are real aiohttp servers on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from deploy.local.services import free_port
from router.conversations.render import TokenizeFailed, TurnRenderer
from router.front.api import Endpoint, parse_request
from router.limits import TOKENIZE_MAX_BYTES
from router.membership.workers import WorkerId, WorkerInfo, WorkerPool, WorkerState
from router.tokenize.client import PromptTokenizer
from router.tokenize.prompts import TokenizeSpec


class Tokenizer:
    """A `/tokenize` that answers one id per message (chat) or word, or `oversize` bytes of a
    valid-looking JSON answer that never ends within the cap."""

    def __init__(self) -> None:
        self.calls = 0
        self.oversize = False

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls += 1
        if self.oversize:
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(b'{"tokens":[')
            chunk = b"1," * (512 << 10)
            for _ in range((TOKENIZE_MAX_BYTES // len(chunk)) + 2):
                await resp.write(chunk)
            await resp.write(b"1]}")
            return resp
        if "messages" in body:
            ids = [len(str(m.get("content", ""))) for m in body["messages"]]
            if body.get("add_generation_prompt"):
                ids.append(7)
        else:
            ids = [len(w) for w in str(body.get("prompt", "")).split()]
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 1000})


@asynccontextmanager
async def serving(tokenizer: Tokenizer) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/tokenize", tokenizer.tokenize)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_the_renderers_open_renderings_are_bounded() -> None:
    """A client varying `chat_template_kwargs` on every continuation cannot grow the cache:
    it holds `max_open` entries, and a repeated one is still a hit (no second round trip)."""
    async def go() -> None:
        tokenizer = Tokenizer()
        async with serving(tokenizer) as url, aiohttp.ClientSession() as http:
            renderer = TurnRenderer(http, max_open=4)
            turn = {"messages": [{"role": "user", "content": "next"}]}
            for i in range(20):
                await renderer.chat_suffix(url, "m", {**turn,
                                                      "chat_template_kwargs": {"v": i}})
                assert len(renderer) == min(i + 1, 4)
            calls = tokenizer.calls
            await renderer.chat_suffix(url, "m", {**turn, "chat_template_kwargs": {"v": 19}})
            assert tokenizer.calls == calls + 1  # the open rendering was cached: one call
            huge = {"v": "x" * 100_000}  # a large argument: kept as a digest, not as given
            await renderer.chat_suffix(url, "m", {**turn, "chat_template_kwargs": huge})
            assert len(renderer) == 4

    asyncio.run(go())


def test_a_tokenize_answer_over_the_cap_is_the_workers_failure() -> None:
    """A worker streaming an endless `/tokenize` answer: the renderer stops reading past
    `TOKENIZE_MAX_BYTES` (TokenizeFailed: another worker is asked), and the prompt tokenizer
    falls back to text keys and rests the worker."""
    async def go() -> None:
        tokenizer = Tokenizer()
        tokenizer.oversize = True
        async with serving(tokenizer) as url, aiohttp.ClientSession() as http:
            renderer = TurnRenderer(http)
            with pytest.raises(TokenizeFailed, match="limit"):
                await renderer.text_tokens(url, "m", "some words")
            pool = WorkerPool()
            pool.upsert(WorkerInfo(WorkerId("w"), url, ("m",)))
            tok = PromptTokenizer(TokenizeSpec(timeout_s=30.0), pool, http)
            creq = parse_request(Endpoint.COMPLETIONS,
                                 json.dumps({"model": "m", "prompt": "a b c"}).encode(), None)
            features = await tok.features(creq)
            assert features.prompt_tokens is None and features.prompt_text == "a b c"
            assert tok.outcomes.labels("error")._value.get() == 1

    asyncio.run(go())


def _state(worker: str, url: str) -> WorkerState:
    return WorkerState(WorkerInfo(WorkerId(worker), url, ("m",)))


def test_the_endpoint_book_resolves_names_again_and_is_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A name's address is used for `ttl_s`, then resolved again: the pod's new IP is offered
    and the old one no longer maps to the worker. IP literals are never re-resolved. The
    book keeps `max_entries` names whatever the registrations."""
    from router.extproc import endpoints

    now = [0.0]
    answers = {"vllm-0": "10.0.0.1"}
    asked: list[str] = []
    real = endpoints._resolve

    async def resolve(url: str) -> tuple[str | None, bool]:
        host = url.split("//", 1)[1].split(":", 1)[0]
        asked.append(host)
        if host in answers:  # a cluster DNS name: its answer changes with the pod
            return f"{answers[host]}:8000", False
        return await real(url)

    monkeypatch.setattr(endpoints, "_resolve", resolve)

    async def go() -> None:
        book = endpoints.EndpointBook(ttl_s=30.0, max_entries=3, clock=lambda: now[0])
        pod = _state("w0", "http://vllm-0:8000")
        assert await book.endpoint(pod) == "10.0.0.1:8000"
        answers["vllm-0"] = "10.0.0.9"  # rescheduled
        now[0] = 10.0
        assert await book.endpoint(pod) == "10.0.0.1:8000"  # within the TTL
        now[0] = 31.0
        assert await book.endpoint(pod) == "10.0.0.9:8000"
        assert book.worker("10.0.0.9:8000") == "w0" and book.worker("10.0.0.1:8000") is None
        literal = _state("w1", "http://127.0.0.1:8001")
        assert await book.endpoint(literal) == "127.0.0.1:8001"
        calls = len(asked)
        now[0] = 1000.0
        assert await book.endpoint(literal) == "127.0.0.1:8001"
        assert len(asked) == calls  # an IP literal is never resolved again
        local = _state("w2", f"http://localhost:{free_port()}")  # a real resolution
        assert (await book.endpoint(local) or "").split(":")[0] in ("127.0.0.1", "[")
        for i in range(50):
            await book.endpoint(_state(f"x{i}", f"http://10.1.0.{i}:8000"))
        assert len(book) == 3 and len(book._by_endpoint) <= 3

    asyncio.run(go())


def test_the_tokenize_cap_leaves_room_for_any_context() -> None:
    ids = json.dumps({"tokens": list(range(150_000, 150_000 + 1_000_000))})
    assert len(ids) < TOKENIZE_MAX_BYTES  # a million-token context is read whole
