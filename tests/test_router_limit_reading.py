"""How the router reads a request's limits and counts a stream's tokens (issue 22 item 1, trust
review H1): as vLLM 0.32 does, per choice. Unit checks of the parsing and the stream state;
`tests/test_router_client_limits.py` runs the same against real vLLM workers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.errors import BadRequest
from router.front.api import Endpoint, max_new_tokens, parse_request
from router.streaming.resume import resume_body
from router.streaming.state import StreamOverrun, StreamState

CHAT, COMPLETIONS = Endpoint.CHAT, Endpoint.COMPLETIONS


@pytest.mark.parametrize(("endpoint", "fields", "limit"), [
    (CHAT, {"max_tokens": 1, "max_completion_tokens": 48}, 48),  # the H1 probe
    (CHAT, {"max_tokens": 8}, 8),
    (CHAT, {"max_completion_tokens": 8, "max_tokens": None}, 8),
    (CHAT, {"max_completion_tokens": None, "max_tokens": 3}, 3),
    (CHAT, {}, None),  # to the end of the context
    (COMPLETIONS, {}, 16),  # vLLM's default
    (COMPLETIONS, {"max_tokens": None}, 16),
    (COMPLETIONS, {"max_completion_tokens": 5}, 16),  # not a completions field
    (COMPLETIONS, {"max_tokens": 0}, 0),
])
def test_limits_are_read_as_vllm_reads_them(endpoint: Endpoint, fields: dict[str, Any],
                                            limit: int | None) -> None:
    assert max_new_tokens(endpoint, fields) == limit


@pytest.mark.parametrize("fields", [{"max_completion_tokens": -1}, {"max_tokens": "8"},
                                    {"max_completion_tokens": 4, "max_tokens": True}])
def test_an_ill_typed_limit_is_the_clients_400(fields: dict[str, Any]) -> None:
    with pytest.raises(BadRequest) as info:
        max_new_tokens(CHAT, fields)
    assert info.value.param in fields


def _req(endpoint: Endpoint = CHAT, **body: Any) -> Any:
    base: dict[str, Any] = {"model": "m", "stream": True}
    base.update({"messages": [{"role": "user", "content": "x"}]} if endpoint is CHAT
                else {"prompt": "x"})
    base.update(body)
    return parse_request(endpoint, json.dumps(base).encode(), None)


def _chunk(index: int, ids: list[int]) -> dict[str, Any]:
    return {"id": "c", "choices": [{"index": index, "delta": {"content": "t" * len(ids)},
                                    "token_ids": ids}]}


def test_tokens_are_counted_per_choice() -> None:
    """`n: 2, max_tokens: 8` carries 16 ids, 8 a choice (the H1 benign variant); a ninth in one
    choice is an overrun of the request's own limit; load counts all choices."""
    req = _req(n=2, max_tokens=8)
    assert req.max_tokens == 8 and req.features.max_tokens == 16
    state = StreamState(req)
    for _ in range(8):
        state.absorb(_chunk(0, [1]))
        state.absorb(_chunk(1, [2]))
    assert state.choice_tokens == {0: 8, 1: 8} and state.completion_tokens == 16
    assert state.generated == [1] * 8  # choice 0's ids only
    with pytest.raises(StreamOverrun) as info:
        state.absorb(_chunk(1, [3]))
    assert info.value.bounded


def test_an_unbounded_choice_past_the_routers_cap_is_not_the_workers() -> None:
    state = StreamState(_req(), token_cap=4)
    state.absorb(_chunk(0, [1, 2, 3, 4]))
    with pytest.raises(StreamOverrun) as info:
        state.absorb(_chunk(0, [5]))
    assert not info.value.bounded
    # what a resumption of such a stream may still generate: the cap's rest (vLLM clamps it
    # to the context), never completions' default of 16
    assert StreamState(_req(), token_cap=100).remaining_max_tokens() == 100


def test_penalties_carry_across_a_resumption_or_the_stream_is_not_resumed() -> None:
    assert _req(frequency_penalty=0.5).resumable
    assert not _req(presence_penalty=0.5).resumable
    assert _req(presence_penalty=0).resumable
    assert not _req(frequency_penalty=0.5, repetition_penalty=1.2).resumable
    assert _req(repetition_penalty=1.2).resumable
    state = StreamState(_req(frequency_penalty=0.5, logit_bias={"7": 2.0, "9": -1}))
    state.prompt_ids = [100, 101]
    state.generated = [7, 8, 8, 9, 8]
    body = resume_body(state, None)
    assert body["prompt"] == [100, 101, 7, 8, 8, 9, 8]
    assert body["frequency_penalty"] == 0.5
    assert body["logit_bias"] == {"7": 1.5, "8": -1.5, "9": -1.5}
    plain = StreamState(_req(max_tokens=10))
    plain.prompt_ids, plain.generated = [100], [7, 7]
    body = resume_body(plain, None)
    assert "logit_bias" not in body and body["max_tokens"] == 8
