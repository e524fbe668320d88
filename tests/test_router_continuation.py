"""Stateful continuation without vLLM: the turn-end rules, the request flag, the CLI flags,
and a real router replica over fake workers with in-process conversation records (token-id
completions need no tokenizer). The real-vLLM and real-store side is
tests/test_router_continuation_vllm.py."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from aiohttp import web

from deploy.local.services import free_port
from kvstore.commands.kvkeep import build_parser
from kvstore.errors import ConfigError, TierUnavailable
from kvstore.etcd import etcd_spec
from kvstore.keys import SessionId
from router.commands import config_from_args
from router.config import RouterConfig, StaticWorker
from router.conversations import MemoryRecords, TurnEnd, asks_continuation
from router.conversations.service import conversation_tokens
from router.errors import BadRequest
from router.front.api import Endpoint, parse_request
from router.front.proxy import build_app
from router.membership.workers import WorkerId
from router.service import RouterService
from tests.router_harness import FakeWorker, LoopThread, fake_generate, wait_until


@pytest.mark.parametrize(("end", "kept"), [
    (TurnEnd("stop", None), [1, 2, 3, 4]),        # EOS: dropped
    (TurnEnd("stop", 9), [1, 2, 3, 4]),           # one of stop_token_ids: dropped
    (TurnEnd("stop", "\n\n"), [1, 2, 3, 4, 5]),   # a stop string: its tokens stay
    (TurnEnd("length"), [1, 2, 3, 4, 5]),
    (TurnEnd(None), [1, 2, 3, 4, 5]),
])
def test_what_a_turn_leaves(end: TurnEnd, kept: list[int]) -> None:
    assert conversation_tokens([1, 2], [3, 4, 5], end) == kept
    assert conversation_tokens([1, 2], [], TurnEnd("stop")) == [1, 2]


def test_turn_end_of_a_reply() -> None:
    reply = {"choices": [{"finish_reason": "stop", "stop_reason": 7}]}
    assert TurnEnd.of_reply(reply) == TurnEnd("stop", 7)
    assert TurnEnd.of_reply({"choices": []}) == TurnEnd(None)
    assert TurnEnd.of_reply({"choices": [{"finish_reason": "stop", "stop_reason": [1]}]}) == \
        TurnEnd("stop", None)


def test_the_continuation_flag() -> None:
    body = json.dumps({"model": "m", "prompt": "x", "continue_session": True}).encode()
    creq = parse_request(Endpoint.COMPLETIONS, body, "s")
    assert asks_continuation(creq, None) and "continue_session" not in creq.body
    plain = parse_request(Endpoint.COMPLETIONS, b'{"model":"m","prompt":"x"}', "s")
    assert not asks_continuation(plain, None)
    assert asks_continuation(plain, "1") and asks_continuation(plain, "true")
    assert not asks_continuation(plain, "0")
    wrong = parse_request(Endpoint.COMPLETIONS,
                          b'{"model":"m","prompt":"x","continue_session":"yes"}', "s")
    with pytest.raises(BadRequest):
        asks_continuation(wrong, None)


def _config(*flags: str) -> RouterConfig:
    return config_from_args(build_parser().parse_args(["router", "serve", *flags]))


def test_cli_flags(tmp_path: Any) -> None:
    assert _config().continuation is None
    config = _config("--etcd", "http://127.0.0.1:2379", "--continuation",
                     "--store-token-file", "/etc/kvkeep/t", "--store-tenant", "chats")
    assert config.continuation is not None
    spec = config.continuation.remote_spec()
    assert spec.etcd is not None  # the router's own etcd (a spec: its TLS flags come along)
    assert (etcd_spec(spec.etcd).url, spec.token_file, config.continuation.tenant) == \
        ("http://127.0.0.1:2379", "/etc/kvkeep/t", "chats")
    listed = _config("--continuation", "--store-daemon", "d0=10.0.0.1:7400",
                     "--store-daemon", "d1=10.0.0.2:7400", "--store-replicas", "1")
    assert listed.continuation is not None
    assert listed.continuation.remote_spec().daemons == (("d0", "10.0.0.1:7400"),
                                                         ("d1", "10.0.0.2:7400"))
    for bad in (["--continuation"], ["--store-token-file", "x"],
                ["--continuation", "--store-daemon", "nope"],
                ["--continuation", "--etcd", "http://e:2379", "--store-tenant", "../x"]):
        with pytest.raises(ConfigError):
            _config(*bad)


class FlakyRecords(MemoryRecords):
    """In-process records whose writes fail while `failing`."""

    failing = False

    async def put(self, scope: str, session: SessionId, tokens: Sequence[int],
                  after: int = 0) -> int:
        if self.failing:
            raise TierUnavailable("no daemon stored the record")
        return await super().put(scope, session, tokens, after)


@dataclass
class Env:
    lt: LoopThread
    worker: FakeWorker
    records: FlakyRecords
    url: str
    plain_url: str


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    lt = LoopThread()
    worker = FakeWorker()
    lt.run(worker.start())
    records = FlakyRecords()
    runners: list[web.AppRunner] = []

    async def start(with_records: bool) -> str:
        config = RouterConfig(port=free_port(), static_workers=(
            StaticWorker(WorkerId("w1"), worker.url),))
        service = RouterService(config, records=records if with_records else None)
        runner = web.AppRunner(build_app(service), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", config.port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{config.port}"

    e = Env(lt, worker, records, lt.run(start(True)), lt.run(start(False)))
    for url in (e.url, e.plain_url):
        wait_until(lambda u=url: any(w["usable"] for w in  # type: ignore[misc]
                                     httpx.get(f"{u}/kvkeep/workers").json()), timeout=10)
    yield e
    for runner in runners:
        lt.run(runner.cleanup())
    lt.run(worker.stop())
    lt.close()


def _complete(url: str, sid: str, prompt: Any, *, cont: bool = False, stream: bool = False,
              n: int = 3) -> httpx.Response:
    body = {"model": "fake", "prompt": prompt, "max_tokens": n, "stream": stream}
    headers = {"X-Session-Id": sid, **({"X-KVKeep-Continue": "1"} if cont else {})}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)


def test_a_token_id_conversation_continues(env: Env) -> None:
    first = _complete(env.url, "c-1", [5, 6, 7])
    assert first.status_code == 200
    history = [5, 6, 7, *fake_generate([5, 6, 7], 3)]
    assert first.headers["X-KVKeep-History-Tokens"] == str(len(history))
    second = _complete(env.url, "c-1", [8, 9], cont=True, stream=True)
    assert second.status_code == 200
    assert env.worker.requests[-1]["prompt"] == [*history, 8, 9]
    notes = [json.loads(line[len(": kvkeep "):]) for line in second.text.splitlines()
             if line.startswith(": kvkeep ")]
    history = [*history, 8, 9, *fake_generate([*history, 8, 9], 3)]
    assert notes[-1]["history_tokens"] == len(history)  # a streamed turn is recorded too
    third = _complete(env.url, "c-1", [1], cont=True)
    assert env.worker.requests[-1]["prompt"] == [*history, 1]
    assert "token_ids" not in third.json()["choices"][0]  # not asked for: not shown


def test_a_turn_that_cannot_be_recorded_forgets_the_history(env: Env) -> None:
    assert _complete(env.url, "c-2", [5, 6]).status_code == 200
    assert _complete(env.url, "c-2", [7], cont=True).status_code == 200
    env.records.failing = True
    try:
        done = _complete(env.url, "c-2", [8], cont=True)
        assert done.status_code == 200 and "X-KVKeep-History-Tokens" not in done.headers
    finally:
        env.records.failing = False
    # The stored history would miss the last turn: it is gone instead.
    stale = _complete(env.url, "c-2", [9], cont=True)
    assert stale.status_code == 409 and stale.json()["error"]["type"] == "history_unavailable"
    metrics = httpx.get(f"{env.url}/metrics").text
    assert 'kvkeep_router_conversation_records_total{outcome="failed"} 1.0' in metrics
    assert 'kvkeep_router_continuations_total{outcome="no_history"}' in metrics


def test_without_the_feature_or_a_tokenizer_it_is_a_501(env: Env) -> None:
    off = _complete(env.plain_url, "c-3", [1], cont=True)
    assert off.status_code == 501 and "--continuation" in off.json()["error"]["message"]
    assert _complete(env.url, "c-3", "some text").status_code == 200
    # The fake worker has no /tokenize: a text turn cannot be rendered, and says so.
    text = _complete(env.url, "c-3", " more", cont=True)
    assert text.status_code == 501 and text.json()["error"]["type"] == "not_implemented_error"
    chat = httpx.post(f"{env.url}/v1/chat/completions", timeout=30, headers={
        "X-Session-Id": "c-3", "X-KVKeep-Continue": "1"}, json={
        "model": "fake", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}]})
    assert chat.status_code == 400 and "text only" in chat.json()["error"]["message"]
    no_session = httpx.post(f"{env.url}/v1/completions", timeout=30, json={
        "model": "fake", "prompt": [1], "continue_session": True})
    assert no_session.status_code == 400


def test_records_are_filed_per_tenant() -> None:
    """Two API tenants using the same session id never read each other's history."""
    import asyncio

    from router.conversations.records import record_scope

    async def scenario() -> None:
        records = MemoryRecords()
        sid = SessionId("shared-id")
        await records.put(record_scope("m", "alice"), sid, [1, 2, 3])
        assert await records.get(record_scope("m", "bob"), sid) is None
        assert await records.get(record_scope("m", "default"), sid) is None
        alice = await records.get(record_scope("m", "alice"), sid)
        assert alice is not None and alice.tokens == (1, 2, 3)

    asyncio.run(scenario())
