"""Test harness for the router: an event loop in a thread, fake OpenAI workers, routers.

The fake worker is a deterministic "model": each next token is a function of the whole context
(prompt + generated), so a continuation from any split point produces exactly what an unbroken
run would, like greedy decoding on a real model. It honours `return_token_ids`, token-id
prompts, `max_tokens`, `stream_options.include_usage`, `stop` strings as vLLM does (streaming
holds back `max(len(stop)) - 1` characters unless `include_stop_str_in_output`; the stop that
completes first ends the answer, `stop_reason` names it; `min_tokens`), and can be told to
break a stream after N chunks (closing the socket mid-response), answer with a status, be
down, leave out token ids, keep a prefix cache per `cache_salt` (reported as cached tokens), or
misbehave as a hostile worker (an endless SSE line, an endless unary body, too many tokens).
A stream honours `n` (choice j's first token moved by j, so choices differ; their chunks
interleave step by step, numbered prompt by prompt) and a batch of token-id prompts, as vLLM's
completions endpoint does; `short_choices` ends chosen choices early, as at an EOS.

`POST /v1/responses` is a minimal Responses API (`_responses`): `input` (a string or message
items) and `instructions` tokenized as one text, `max_output_tokens` (16 when missing),
unary or streamed as vLLM streams it (typed events `response.created` ... `response.completed`
with sequence numbers, no `[DONE]`); `break_after` counts its events. It stores every response
it made (as vLLM does with `VLLM_ENABLE_RESPONSES_API_STORE=1`, in its own memory) and answers
a `previous_response_id` it does not have with vLLM's 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import zlib
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from aiohttp import web

from deploy.local.services import free_port
from router.config import RouterConfig, StaticWorker
from router.front.proxy import build_app
from router.membership.workers import WorkerId
from router.policy import Thresholds, policy_preset
from router.service import RouterService
from router.state.base import StateBackend

__all__ = ["LoopThread", "FakeWorker", "RouterHandle", "fake_next_token", "fake_tokenize",
           "fake_generate", "loop_thread"]

T = TypeVar("T")
VOCAB = 1000
EOS = 999


def fake_tokenize(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) % (VOCAB - 1) for w in text.split()]


def fake_next_token(context: list[int]) -> int:
    tail = context[-4:]
    return (sum((i + 1) * t for i, t in enumerate(tail)) * 7919 + len(context)) % (VOCAB - 1)


def fake_generate(prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    out = []
    for _ in range(n):
        tok = fake_next_token(ctx)
        ctx.append(tok)
        out.append(tok)
    return out


def fake_generate_choice(prompt: list[int], n: int, choice: int) -> list[int]:
    """Choice `choice` of n > 1 (as sampling makes them differ): its first token is moved by
    the choice's number, the rest follow from the context, so a continuation of any of its
    prefixes produces what the unbroken choice would."""
    if choice == 0 or n == 0:
        return fake_generate(prompt, n)
    first = (fake_next_token(prompt) + choice) % (VOCAB - 1)
    return [first, *fake_generate([*prompt, first], n - 1)]


def _text(tokens: list[int]) -> str:
    return "".join(f" w{t}" for t in tokens)


def check_stop(output: str, new_chars: int, stops: list[str], include: bool
               ) -> tuple[str, int] | None:
    """vLLM's `check_stop_strings`: (stop string, length to truncate the text to) of the stop
    that completes first within the last `new_chars` characters (ties: list order)."""
    best: tuple[str, int] | None = None
    best_end = 1 << 62
    for stop in stops:
        start = output.find(stop, max(0, len(output) - new_chars - len(stop) + 1))
        if start != -1 and start + len(stop) < best_end:
            best, best_end = (stop, start), start + len(stop)
    if best is None:
        return None
    return best[0], best_end if include else best[1]


def stopped_stream(tokens: list[int], stops: list[str], *, include: bool = False,
                   min_tokens: int = 0) -> list[tuple[int, str, str | None, str | None]]:
    """What vLLM streams for `tokens` with `stops`: per token (id, text delta, finish reason,
    stop reason), the last text held back while it could start a stop string."""
    hold = 0 if include or not stops else max(len(s) for s in stops) - 1
    out, sent = "", 0
    steps: list[tuple[int, str, str | None, str | None]] = []
    for i, tok in enumerate(tokens):
        before = len(out)
        out += _text([tok])
        found = check_stop(out, len(out) - before, stops, include) \
            if stops and i + 1 > min_tokens else None
        if found is not None:
            out = out[:found[1]]
        last = found is not None or i == len(tokens) - 1
        upto = len(out) if last else len(out) - hold
        delta = out[sent:upto] if upto > sent else ""
        sent = max(sent, upto)
        finish = ("stop" if found is not None else "length") if last else None
        steps.append((tok, delta, finish, found[0] if found is not None else None))
        if found is not None:
            break
    return steps


def fake_logprob(token: int) -> float:
    """A deterministic log-probability per token, so a resumed stream's can be compared."""
    return -(token % 97) / 100


def fake_top(token: int, k: int) -> list[tuple[str, float]]:
    """The `k` best (text, logprob) of a step, best first: the sampled token and runners-up."""
    best = fake_logprob(token)
    return [(_text([token + i]), best - i) for i in range(k)]


def _fake_logprobs(body: dict[str, Any], token: int, offset: int, *, chat: bool
                   ) -> dict[str, Any] | None:
    """vLLM's logprobs of one streamed token, in the endpoint's format, when asked."""
    text = _text([token])
    if chat:
        if body.get("logprobs") is not True:
            return None
        top = fake_top(token, int(body.get("top_logprobs") or 0))
        return {"content": [{"token": text, "logprob": fake_logprob(token),
                             "bytes": list(text.encode()),
                             "top_logprobs": [{"token": t, "logprob": v,
                                               "bytes": list(t.encode())} for t, v in top]}]}
    k = body.get("logprobs")
    if k is None:
        return None
    return {"text_offset": [offset], "token_logprobs": [fake_logprob(token)],
            "tokens": [text], "top_logprobs": [dict(fake_top(token, int(k)))]}


class LoopThread:
    """An asyncio loop running in a daemon thread; `run(coro)` executes on it and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@contextlib.contextmanager
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    try:
        yield lt
    finally:
        lt.close()


@dataclass
class FakeWorker:
    """A fake vLLM OpenAI server (see module docstring). Mutate the knobs between requests."""

    model: str = "fake"
    break_after: int | None = None  # close the stream after this many chunks (once)
    break_every: bool = False  # `break_after` stays armed: every stream breaks, retries too
    status: int | None = None  # answer every generation request with this status
    delay_s: float = 0.0  # between chunks
    stall_after: int | None = None  # go silent for `stall_s` after this many chunks (once)
    stall_s: float = 0.0
    eof_delay_s: float = 0.0  # between a stream's [DONE] and the end of the response
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens of a non-stream answer
    returned_params: dict[str, Any] | None = None  # kv_transfer_params a connector would return
    healthy: bool = True
    omit_prompt_ids: bool = False  # a worker that ignores return_token_ids for the prompt
    omit_token_ids: bool = False  # ... and for the generated tokens
    prefix_cache: bool = False  # report cached tokens from a prefix cache keyed by cache_salt
    endless_line: bool = False  # hostile: a stream's second event is one line that never ends
    endless_body: bool = False  # hostile: a non-streaming answer that never ends
    extra_tokens: int = 0  # hostile: stream this many tokens past max_tokens
    metrics_padding: int = 0  # hostile: this many bytes of comments in /metrics
    short_choices: dict[int, int] = field(default_factory=dict)  # n > 1: choice -> its length
    requests: list[dict[str, Any]] = field(default_factory=list)
    stored: set[str] = field(default_factory=set)  # the ids of the responses it made
    peers: list[Any] = field(default_factory=list)  # the client address of each request
    port: int = 0
    host: str = "127.0.0.1"
    _runner: web.AppRunner | None = None
    _cache: set[tuple[str | None, tuple[int, ...]]] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/responses", self._responses)
        # A fake worker is stopped, not drained: a handler a test left stalled (`stall_s`)
        # would otherwise hold the stop for aiohttp's 60 s default.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        self.port = self.port or free_port()
        await web.TCPSite(self._runner, self.host, self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        labels = f'{{engine="0",model_name="{self.model}"}}'
        return web.Response(text="#" * self.metrics_padding + "\n" + (
            f"vllm:num_requests_running{labels} {self.running}\n"
            f"vllm:num_requests_waiting{labels} {self.waiting}\n"
            f"vllm:kv_cache_usage_perc{labels} {self.kv_usage}\n"))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            return await self._generate_checked(request, chat=chat)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            # Like vLLM: a request it cannot understand is the client's 400, not a 500.
            return web.json_response({"error": {"message": repr(exc), "code": 400}},
                                     status=400)

    async def _generate_checked(self, request: web.Request, *, chat: bool
                                ) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.peers.append(request.transport.get_extra_info("peername")
                          if request.transport is not None else None)
        if self.status is not None:
            return web.json_response({"error": {"message": "injected", "type": "x",
                                                "code": self.status}}, status=self.status)
        if body.get("model") != self.model:
            return web.json_response({"error": {"message": "no model", "code": 404}},
                                     status=404)
        if chat:
            prompt_text = "".join(f"{m['role']}: {m['content']} " for m in body["messages"])
            prompt = fake_tokenize(prompt_text)
        else:
            p = body["prompt"]
            batch = p if isinstance(p, list) and p and isinstance(p[0], list) else [p]
            prompts = [list(q) if isinstance(q, list) else fake_tokenize(q) for q in batch]
            prompt = prompts[0]
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        steps = stopped_stream(fake_generate(prompt, n + self.extra_tokens), stops,
                               include=bool(body.get("include_stop_str_in_output")),
                               min_tokens=int(body.get("min_tokens") or 0))
        tokens = [t for t, *_ in steps]
        n = len(tokens)
        ids = bool(body.get("return_token_ids"))
        cached = self.cached_tokens
        if self.prefix_cache:
            salt = body.get("cache_salt")
            blocks = [tuple(prompt[:end]) for end in range(16, len(prompt) + 1, 16)]
            cached = max((len(b) for b in blocks if (salt, b) in self._cache), default=0)
            self._cache.update((salt, b) for b in blocks)
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{len(self.requests)}"
        if not body.get("stream"):
            if self.endless_body:
                endless = web.StreamResponse(headers={"Content-Type": "application/json"})
                await endless.prepare(request)
                with contextlib.suppress(ConnectionError):
                    while True:
                        await endless.write(b" " * (1 << 16))
                return endless
            finish, stop_reason = steps[-1][2], steps[-1][3]
            text = "".join(d for _, d, *_ in steps)
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None,
                                      "stop_reason": stop_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if ids and not self.omit_token_ids:
                choice["token_ids"] = tokens
                if not chat and not self.omit_prompt_ids:
                    choice["prompt_token_ids"] = prompt
            out: dict[str, Any] = {
                "id": cid, "object": "chat.completion" if chat else "text_completion",
                "created": 1, "model": self.model, "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                          "total_tokens": len(prompt) + n,
                          "prompt_tokens_details": {"cached_tokens": cached}}}
            if self.returned_params is not None:
                out["kv_transfer_params"] = self.returned_params
            if chat and ids and not self.omit_prompt_ids:
                out["prompt_token_ids"] = prompt
            return web.json_response(out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent = 0
        # n choices per prompt, numbered prompt by prompt as vLLM numbers them; their chunks
        # interleave step by step, as vLLM's do.
        choices = int(body.get("n") or 1)
        runs: list[tuple[int, list[int], list[tuple[int, str, str | None, str | None]]]] = []
        for q, qprompt in enumerate([prompt] if chat else prompts):
            for j in range(choices):
                index = q * choices + j
                # (the original request's choices only: a continuation asks n = 1)
                cut = self.short_choices.get(index) if choices > 1 else None
                qsteps = steps if (q, j) == (0, 0) else stopped_stream(
                    fake_generate_choice(qprompt, n + self.extra_tokens, j), stops,
                    include=bool(body.get("include_stop_str_in_output")),
                    min_tokens=int(body.get("min_tokens") or 0))
                if cut is not None and cut < len(qsteps):  # ends early, as at an EOS
                    qsteps = [*qsteps[:cut - 1], (*qsteps[cut - 1][:2], "stop", None)]
                runs.append((index, qprompt, qsteps))

        async def send(chunk: dict[str, Any]) -> None:
            nonlocal sent
            if self.break_after is not None and sent >= self.break_after:
                if not self.break_every:
                    self.break_after = None
                assert request.transport is not None
                request.transport.abort()  # the worker "dies" mid-stream
                raise ConnectionResetError("injected break")
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            sent += 1
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.stall_after is not None and sent >= self.stall_after:
                self.stall_after = None
                await asyncio.sleep(self.stall_s)  # hung, socket open

        try:
            if chat:
                for index, _, _ in runs:
                    first: dict[str, Any] = {"id": cid, "object": obj, "created": 1,
                                             "model": self.model, "choices": [{
                                                 "index": index, "delta": {
                                                     "role": "assistant", "content": ""},
                                                 "finish_reason": None}]}
                    if ids and not self.omit_prompt_ids:
                        first["prompt_token_ids"] = prompt
                    await send(first)
            offsets = [0] * len(runs)
            for i in range(max(len(r[2]) for r in runs)):
                for r, (index, qprompt, qsteps) in enumerate(runs):
                    if i >= len(qsteps):
                        continue
                    tok, delta, fin, stop_reason = qsteps[i]
                    if chat:
                        c: dict[str, Any] = {"index": index, "delta": {"content": delta},
                                             "finish_reason": fin}
                    else:
                        c = {"index": index, "text": delta, "finish_reason": fin}
                    if fin is not None:
                        c["stop_reason"] = stop_reason
                    c["logprobs"] = _fake_logprobs(body, tok, offsets[r], chat=chat)
                    offsets[r] += len(_text([tok]))
                    if ids and not self.omit_token_ids:
                        c["token_ids"] = [tok]
                        if not chat and i == 0 and not self.omit_prompt_ids:
                            c["prompt_token_ids"] = qprompt
                    await send({"id": cid, "object": obj, "created": 1, "model": self.model,
                                "choices": [c]})
                    if i == 0 and self.endless_line:
                        await resp.write(b"data: ")
                        while True:  # until the router hangs up
                            await resp.write(b"x" * (1 << 16))
            if (body.get("stream_options") or {}).get("include_usage"):
                # vLLM counts each prompt once, however many choices it has
                prompt_tokens = sum(len(q) for q in ([prompt] if chat else prompts))
                completion = sum(len(r[2]) for r in runs)
                await send({"id": cid, "object": obj, "created": 1, "model": self.model,
                            "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                     "completion_tokens": completion,
                                                     "total_tokens": prompt_tokens
                                                     + completion}})
            await resp.write(b"data: [DONE]\n\n")
            if self.eof_delay_s:
                await asyncio.sleep(self.eof_delay_s)
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return resp


    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """A minimal `/v1/responses` (see the module docstring)."""
        body = await request.json()
        self.requests.append(body)
        if self.status is not None:
            return web.json_response({"error": {"message": "injected", "type": "x",
                                                "code": self.status}}, status=self.status)
        if body.get("model") != self.model:
            return web.json_response({"error": {"message": "no model", "code": 404}},
                                     status=404)
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.stored:
            return web.json_response({"error": {
                "message": f"Response with id '{previous}' not found.",
                "type": "invalid_request_error", "param": "response_id", "code": 404}},
                status=404)
        items = body["input"]
        text = (body.get("instructions") or "") + " " + (items if isinstance(items, str) else
                " ".join(str(i.get("content", "")) for i in items))
        tokens = fake_generate(fake_tokenize(text), body.get("max_output_tokens") or 16)
        rid = f"resp_{self.port}_{len(self.requests)}"
        self.stored.add(rid)
        usage = {"input_tokens": len(fake_tokenize(text)), "output_tokens": len(tokens),
                 "total_tokens": len(fake_tokenize(text)) + len(tokens),
                 "input_tokens_details": {"cached_tokens": self.cached_tokens},
                 "output_tokens_details": {"reasoning_tokens": 0}}
        part = {"type": "output_text", "text": _text(tokens), "annotations": []}
        item = {"type": "message", "id": f"msg_{rid}", "role": "assistant",
                "status": "completed", "content": [part]}

        def response(status: str, output: list[Any]) -> dict[str, Any]:
            return {"id": rid, "object": "response", "created_at": 1, "model": self.model,
                    "status": status, "output": output, "previous_response_id": previous,
                    "max_output_tokens": body.get("max_output_tokens"), "error": None,
                    "usage": usage if status == "completed" else None}

        if not body.get("stream"):
            return web.json_response(response("completed", [item]))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        seq = 0

        async def send(kind: str, data: dict[str, Any]) -> None:
            nonlocal seq
            if self.break_after is not None and seq >= self.break_after:
                if not self.break_every:
                    self.break_after = None
                assert request.transport is not None
                request.transport.abort()  # the worker "dies" mid-stream
                raise ConnectionResetError("injected break")
            await resp.write(f"event: {kind}\ndata: ".encode() + json.dumps(
                {"type": kind, **data, "sequence_number": seq}).encode() + b"\n\n")
            seq += 1
            if self.delay_s:
                await asyncio.sleep(self.delay_s)

        ids = {"item_id": item["id"], "output_index": 0, "content_index": 0}
        try:
            await send("response.created", {"response": response("in_progress", [])})
            await send("response.in_progress", {"response": response("in_progress", [])})
            await send("response.output_item.added", {
                "output_index": 0, "item": {**item, "status": "in_progress", "content": []}})
            await send("response.content_part.added", {
                **ids, "part": {**part, "text": ""}})
            for tok in tokens:
                await send("response.output_text.delta", {**ids, "delta": _text([tok]),
                                                          "logprobs": []})
            await send("response.output_text.done", {**ids, "text": part["text"],
                                                     "logprobs": []})
            await send("response.content_part.done", {**ids, "part": part})
            await send("response.output_item.done", {"output_index": 0, "item": item})
            await send("response.completed", {"response": response("completed", [item])})
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return resp


@dataclass
class RouterHandle:
    """A router replica served from a `LoopThread`."""

    lt: LoopThread
    config: RouterConfig
    backend: StateBackend | None = None
    service: RouterService | None = None
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    def start(self) -> RouterHandle:
        self.lt.run(self._start())
        return self

    def stop(self) -> None:
        self.lt.run(self._stop())

    def call(self, fn: Callable[[RouterService], Coroutine[Any, Any, T]]) -> T:
        assert self.service is not None
        return self.lt.run(fn(self.service))

    async def _start(self) -> None:
        self.service = RouterService(self.config, self.backend)
        self._runner = web.AppRunner(build_app(self.service), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.config.host, self.config.port).start()

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, step: float = 0.02
               ) -> float:
    """Poll until `predicate()`; returns the seconds it took. Raises on timeout."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError("condition not met in time")
        time.sleep(step)
    return time.monotonic() - start


@contextlib.contextmanager
def running_fakes(lt: LoopThread, model: str = "fake", names: tuple[str, ...] = ("a", "b")
                  ) -> Iterator[dict[str, FakeWorker]]:
    """Fake workers `names` serving `model`, started on `lt` and stopped at the end."""
    fakes = {name: FakeWorker(model) for name in names}
    for fake in fakes.values():
        lt.run(fake.start())
    try:
        yield fakes
    finally:
        for fake in fakes.values():
            lt.run(fake.stop())


def fake_router_config(fakes: dict[str, FakeWorker], **overrides: Any) -> RouterConfig:
    """The router the fake-worker tests put in front of `fakes`: each a static worker (a 1 s
    lease), scraped every 50 ms, no migration cooldown, a 1 s stream idle timeout; `overrides`
    replace any of these."""
    settings: dict[str, Any] = {
        "port": free_port(), "scrape_interval_s": 0.05, "static_ttl_s": 1.0,
        "static_workers": tuple(StaticWorker(WorkerId(name), fake.url)
                                for name, fake in fakes.items()),
        "policy": replace(policy_preset("kvkeep"), thresholds=Thresholds(
            max_waiting=50, migrate_cooldown_s=0.0)),
        "stream_idle_timeout_s": 1.0}
    settings.update(overrides)
    return RouterConfig(**settings)
