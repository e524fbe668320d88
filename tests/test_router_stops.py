"""Resumed streams with stop strings (issue 13, item 9): a stream broken at any point around a
stop string, and continued on another worker, gives the client exactly what one unbroken vLLM
stream gives (the text held back at the break is not lost, a stop string spanning the break is
found); and a stream whose chunks carry no token ids is never continued by replaying the start
of the answer.

The fake workers stream stop strings as vLLM does (held-back text, `stop_reason`); the
reference is vLLM's behaviour computed on the same tokens (`stopped_stream`), not the router's.
The same over a real vLLM worker SIGKILLed is in `tests/test_router_vllm.py`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from deploy.local.services import free_port
from router.config import RouterConfig, StaticWorker
from router.policy import Thresholds, policy_preset
from router.streaming.stops import StopText
from router.workers import WorkerId
from tests.router_harness import (
    FakeWorker,
    LoopThread,
    RouterHandle,
    fake_generate,
    fake_tokenize,
    loop_thread,
    stopped_stream,
    wait_until,
)

MODEL = "fake"
PROMPT = "tell a long story about stops"
LONG_STOP = "QQQQQQQQQQQQQQ"  # never generated; it makes the worker hold 13 characters back


class Env:
    def __init__(self, lt: LoopThread, fakes: dict[str, FakeWorker], router: RouterHandle
                 ) -> None:
        self.lt, self.fakes, self.router = lt, fakes, router
        self.http = httpx.Client(base_url=router.url, timeout=30)
        self.sids = itertools.count()

    def home(self, chat: bool) -> tuple[str, FakeWorker]:
        """A new session and the worker it lives on (both workers usable again: the one a
        previous case broke is suspect for a while)."""
        assert self.router.service is not None
        for state in self.router.service.core.workers():
            state.suspect_until = 0.0
            state.consecutive_failures = 0
        sid = f"stop-{next(self.sids)}"
        r = self.http.post(_path(chat), headers={"X-Session-Id": sid},
                           json={**_body(chat, 1), "stream": False})
        assert r.status_code == 200
        return sid, self.fakes[r.headers["X-KVKeep-Worker"]]


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with loop_thread() as lt:
        fakes = {"a": FakeWorker(MODEL), "b": FakeWorker(MODEL)}
        for fake in fakes.values():
            lt.run(fake.start())
        config = RouterConfig(
            port=free_port(), scrape_interval_s=0.05, static_ttl_s=1.0,
            static_workers=tuple(StaticWorker(WorkerId(n), f.url) for n, f in fakes.items()),
            policy=replace(policy_preset("kvkeep"),
                           thresholds=Thresholds(max_waiting=50, migrate_cooldown_s=0.0)),
            stream_idle_timeout_s=2.0)
        router = RouterHandle(lt, config).start()
        e = Env(lt, fakes, router)
        assert router.service is not None
        wait_until(lambda: sum(router.service.core.usable(w)  # type: ignore[union-attr]
                               for w in router.service.core.workers()) == 2)
        yield e
        e.http.close()
        router.stop()
        for fake in fakes.values():
            lt.run(fake.stop())


@pytest.fixture(autouse=True)
def reset(env: Env) -> Iterator[None]:
    yield
    assert env.router.service is not None
    for fake in env.fakes.values():
        fake.break_after = None
        fake.omit_prompt_ids = fake.omit_token_ids = False
    for state in env.router.service.core.workers():
        state.suspect_until = 0.0
        state.consecutive_failures = 0


def _path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def _prompt(chat: bool) -> list[int]:
    return fake_tokenize(f"user: {PROMPT} " if chat else PROMPT)


def _body(chat: bool, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": True, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return body


def _stream(env: Env, chat: bool, sid: str, body: dict[str, Any]
            ) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """(text, choices, notes) of a streamed answer through the router."""
    r = env.http.post(_path(chat), headers={"X-Session-Id": sid}, json=body)
    assert r.status_code == 200
    choices: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    for line in r.text.splitlines():
        if line.startswith(": kvkeep "):
            notes.append(json.loads(line[len(": kvkeep "):]))
        elif line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            assert "error" not in event, event
            choices.extend(event["choices"])
    text = "".join((c.get("delta") or {}).get("content") or "" if chat else c.get("text", "")
                   for c in choices)
    return text, choices, notes


def _spanning_stop(tokens: list[int], at: int) -> str:
    """A stop string from the end of token `at`'s text into token `at + 1`'s, that does not
    occur earlier in the answer."""
    texts = [f" w{t}" for t in tokens]
    stop = texts[at][-2:] + texts[at + 1][:3]
    whole = "".join(texts)
    assert whole.find(stop) == len("".join(texts[:at])) + len(texts[at]) - 2, stop
    return stop


MAX_TOKENS = 40
AT = 15  # the stop string spans tokens 15 and 16


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_a_break_anywhere_around_a_stop_string_loses_nothing(env: Env, chat: bool,
                                                             include: bool) -> None:
    tokens = fake_generate(_prompt(chat), MAX_TOKENS)
    stop = _spanning_stop(tokens, AT)
    stops = [LONG_STOP, stop]
    reference = stopped_stream(tokens, stops, include=include)
    expected = "".join(delta for _, delta, _, _ in reference)
    assert reference[-1][2:] == ("stop", stop) and len(reference) == AT + 2
    body = _body(chat, MAX_TOKENS, stop=stops, include_stop_str_in_output=include)
    # Breaks from well before the stop string to the chunk that completes it: the stop then
    # lies after the break, spans it, or was about to be released when the worker died.
    first_chunk = 1 if chat else 0  # a chat stream starts with its role chunk
    for broken_after in range(AT - 4, AT + 2):
        sid, home = env.home(chat)
        home.break_after = first_chunk + broken_after
        text, choices, notes = _stream(env, chat, sid, body)
        case = f"break after token {broken_after}"
        assert notes[0].get("resumed_on") not in (None, []), case
        assert text == expected, case
        final = choices[-1]
        assert (final["finish_reason"], final.get("stop_reason")) == ("stop", stop), case
        # the continuation was asked to keep stop strings in its text: the router drops them
        cont = next(f for f in env.fakes.values() if f is not home).requests[-1]
        assert cont["include_stop_str_in_output"] is True and cont["stop"] == stops
    # and unbroken, the client still gets what vLLM itself sends
    sid, _ = env.home(chat)
    text, choices, _ = _stream(env, chat, sid, body)
    assert text == expected and choices[-1]["stop_reason"] == stop


def test_held_back_text_at_the_break_is_not_lost_when_no_stop_comes(env: Env) -> None:
    """A stop string that never comes: the worker that broke held 13 characters back; the
    resumed answer has every one of them, and ends at max_tokens."""
    tokens = fake_generate(_prompt(False), 24)
    sid, home = env.home(False)
    home.break_after = 10
    text, choices, _ = _stream(env, False, sid, _body(False, 24, stop=[LONG_STOP]))
    assert text == "".join(f" w{t}" for t in tokens)
    assert choices[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_without_token_ids_is_not_replayed(env: Env, chat: bool) -> None:
    """A worker that leaves out `prompt_token_ids` (or the tokens' ids) breaks after some of
    the answer reached the client: continuing from the original request would send the start
    of the answer twice, so the stream ends with an error event after what was sent."""
    tokens = fake_generate(_prompt(chat), 30)
    full = "".join(f" w{t}" for t in tokens)
    for omit in ("prompt", "tokens"):
        sid, home = env.home(chat)
        for fake in env.fakes.values():
            fake.omit_prompt_ids = omit == "prompt"
            fake.omit_token_ids = omit == "tokens"
        home.break_after = 8
        r = env.http.post(_path(chat), headers={"X-Session-Id": sid}, json=_body(chat, 30))
        events = [json.loads(x[6:]) for x in r.text.splitlines()
                  if x.startswith("data: ") and x != "data: [DONE]"]
        assert events[-1]["error"]["code"] == 502, omit
        text = "".join((c.get("delta") or {}).get("content") or "" if chat
                       else c.get("text", "") for e in events[:-1] for c in e["choices"])
        assert full.startswith(text) and 0 < len(text) < len(full), (omit, text)


def test_a_stream_that_broke_before_any_text_starts_again_once(env: Env) -> None:
    """Nothing but the chat role chunk had reached the client: the stream is started again on
    the other worker, without a second role chunk, under the same id."""
    tokens = fake_generate(_prompt(True), 12)
    sid, home = env.home(True)
    for fake in env.fakes.values():
        fake.omit_prompt_ids = True
    home.break_after = 1
    text, choices, _ = _stream(env, True, sid, _body(True, 12))
    assert text == "".join(f" w{t}" for t in tokens)
    assert sum(1 for c in choices if (c.get("delta") or {}).get("role")) == 1


def test_stop_text_against_vllms_rule() -> None:
    """The router's hold-back and stop search, chunk by chunk, give vLLM's text for every
    split of the same text into chunks."""
    text = "the cat sat on the mat, and then the dog came"
    for stops, include in ((["the dog"], False), (["sat", "at on"], False),
                           (["mat,", "zzzzzzzz"], True), (["nowhere"], False)):
        best = min(((text.find(s) + len(s), i, s) for i, s in enumerate(stops)
                    if s in text), default=None)
        want = text if best is None else text[:best[0] if include else best[0] - len(best[2])]
        for size in (1, 2, 3, 7, 50):
            st = StopText(tuple(stops), include=include)
            got, found = "", None
            for start in range(0, len(text), size):
                emitted = st.feed(text[start:start + size], 1)
                got += emitted.text
                if emitted.stop is not None:
                    found = emitted.stop
                    break
            if found is None:
                got += st.finish(None)
            assert got == want, (stops, include, size)
            assert found == (None if best is None else best[2])
