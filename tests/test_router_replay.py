"""`router/streaming/replay.py` on vLLM-shaped chunks: what a replayed stream sends the client.

Unit level: the chunks are built in vLLM 0.32's streaming format (the shapes
tests/test_router_shapes_vllm.py gets from real workers), split at every point, so that the
filter's cut is checked wherever a stream may break. Which requests replay, and why one is
refused, is checked on parsed requests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deploy.local.engines import EngineSettings, vllm_argv
from router.front.api import Endpoint, parse_request
from router.streaming.replay import Replay, ReplayMismatch, replay_refusal, replays


def _chunk(delta: dict[str, Any], ids: list[int] | None, finish: str | None = None,
           cid: str = "chatcmpl-a") -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                              "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": cid, "object": "chat.completion.chunk", "created": 1, "model": "tiny",
            "choices": [choice]}


def content_stream(pieces: list[str], cid: str = "chatcmpl-a", ids: bool = True
                   ) -> list[dict[str, Any]]:
    out = [_chunk({"role": "assistant", "content": ""}, None, cid=cid)]
    out += [_chunk({"content": p}, [100 + i] if ids else None, cid=cid)
            for i, p in enumerate(pieces)]
    out.append(_chunk({}, [2] if ids else None, "stop", cid=cid))
    return out


def tool_stream(args: list[str], call_id: str, cid: str = "chatcmpl-a") -> list[dict[str, Any]]:
    """A named tool call as vLLM streams it: the head with the first piece, then pieces."""
    out = [_chunk({"role": "assistant", "content": ""}, None, cid=cid)]
    for i, piece in enumerate(args):
        call: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
        if i == 0:
            call = {"id": call_id, "type": "function", "index": 0,
                    "function": {"name": "get_weather", "arguments": piece}}
        out.append(_chunk({"tool_calls": [call]}, [200 + i], cid=cid))
    out.append(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": ""}}]}, [2],
                      "stop", cid=cid))
    return out


def client_view(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client reassembles from the chunks it was sent."""
    view: dict[str, Any] = {"content": "", "roles": 0, "ids": set(), "calls": {}, "finish": [],
                            "tokens": []}
    for chunk in chunks:
        view["ids"].add(chunk["id"])
        for choice in chunk["choices"]:
            delta = choice["delta"]
            view["roles"] += "role" in delta
            view["content"] += delta.get("content") or ""
            view["tokens"] += choice.get("token_ids") or []
            for call in delta.get("tool_calls") or ():
                seen = view["calls"].setdefault(call["index"], {"arguments": "", "heads": 0})
                if "id" in call:
                    seen["heads"] += 1
                    seen["id"] = call["id"]
                fn = call.get("function") or {}
                if fn.get("name"):
                    seen["name"] = fn["name"]
                seen["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                view["finish"].append(choice["finish_reason"])
    return view


def relay(replay: Replay, first: list[dict[str, Any]], cut: int, second: list[dict[str, Any]]
          ) -> list[dict[str, Any]]:
    """The client's chunks: `first` up to `cut` recorded, then `second` replayed."""
    sent = []
    for chunk in json.loads(json.dumps(first[:cut])):
        kept = replay.observe(chunk)
        assert kept is not None
        sent.append(kept)
    replay.begin("w2")
    for chunk in json.loads(json.dumps(second)):
        kept = replay.observe(chunk)
        if kept is not None:
            sent.append(kept)
    return sent


PIECES = ['{"', "name", '":"', "Ann", " Lee", '","', "age", '":', "4", "2", "}"]


@pytest.mark.parametrize("cut", range(1, len(PIECES) + 2))
def test_a_replayed_content_stream_reads_as_one_unbroken_stream(cut: int) -> None:
    whole = content_stream(PIECES)
    again = content_stream(PIECES, cid="chatcmpl-b")  # vLLM names every request anew
    view = client_view(relay(Replay(), whole, cut, again))
    assert view["content"] == "".join(PIECES)
    assert view["roles"] == 1 and view["ids"] == {"chatcmpl-a"}
    assert view["tokens"] == [100 + i for i in range(len(PIECES))] + [2]
    assert view["finish"] == ["stop"]


@pytest.mark.parametrize("cut", range(1, 8))
def test_a_replayed_tool_call_keeps_its_id_and_sends_its_head_once(cut: int) -> None:
    args = ['{"', "city", '":"', "Oslo", '","days":', "3", "}"]
    view = client_view(relay(Replay(), tool_stream(args, "call-first"), cut,
                             tool_stream(args, "call-second", cid="chatcmpl-b")))
    call = view["calls"][0]
    # the id the client saw first stays; cut before the head, the client sees the replay's
    assert call["heads"] == 1 and call["name"] == "get_weather"
    assert call["id"] == ("call-first" if cut > 1 else "call-second")
    assert json.loads(call["arguments"]) == {"city": "Oslo", "days": 3}
    assert view["content"] == "" and view["roles"] == 1 and view["finish"] == ["stop"]


def test_replay_chunks_split_elsewhere_still_join_up() -> None:
    """The replay's text arrives in other pieces (no token ids to compare): cut by text."""
    first = content_stream(["ab", "cd", "ef"], ids=False)
    second = content_stream(["a", "bcde", "f", "gh"], ids=False)
    view = client_view(relay(Replay(), first, 3, second))
    assert view["content"] == "abcdefgh"


def test_a_replay_that_differs_stops_before_any_other_text() -> None:
    first = content_stream(['{"a":', '"xy', 'z"}'], ids=False)
    second = content_stream(['{"a":', '"xq', 'q"}'], ids=False)
    replay = Replay()
    sent = relay(Replay(), first, 2, first)  # sanity: the same replay passes
    assert client_view(sent)["content"] == '{"a":"xyz"}'
    with pytest.raises(ReplayMismatch, match="differs from what was sent at character 7"):
        relay(replay, first, 3, second)


def test_a_replay_with_other_token_ids_is_a_mismatch() -> None:
    first = content_stream(["ab", "cd"])
    second = content_stream(["ab", "cd"])
    second[2]["choices"][0]["token_ids"] = [999]  # same text, other tokens
    with pytest.raises(ReplayMismatch, match="other tokens"):
        relay(Replay(), first, 3, second)


def test_a_replay_that_ends_short_is_a_mismatch() -> None:
    first = content_stream(["ab", "cd", "ef"], ids=False)
    with pytest.raises(ReplayMismatch, match="ended before"):
        relay(Replay(), first, 4, content_stream(["ab"], ids=False))


def test_a_replay_calling_another_tool_is_a_mismatch() -> None:
    first = tool_stream(['{"', "city"], "c1")
    second = tool_stream(['{"', "city"], "c2")
    second[1]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] = "get_time"
    with pytest.raises(ReplayMismatch, match="get_time"):
        relay(Replay(), first, 2, second)


def _parse(body: dict[str, Any], endpoint: Endpoint = Endpoint.CHAT) -> Any:
    return parse_request(endpoint, json.dumps({"model": "tiny", **body}).encode(), "s-1")


CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "temperature": 0}


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"regex": "[a-z]+"}},
    {"structured_outputs": {"choice": ["a", "b"]}},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
])
def test_structured_and_tool_streams_replay(extra: dict[str, Any]) -> None:
    creq = _parse({**CHAT, **extra})
    assert not creq.resumable and replays(creq) and replay_refusal(creq) is None


def test_what_does_not_replay() -> None:
    plain = _parse(CHAT)
    assert plain.resumable and not replays(plain)  # resumed by continuation instead
    fmt = {"response_format": {"type": "json_object"}}
    assert not replays(_parse({**CHAT, **fmt, "n": 2}))
    assert not replays(_parse({**CHAT, **fmt, "stream": False}))
    completions = {"prompt": "x", "stream": True, "structured_outputs": {"regex": "a+"}}
    assert replays(_parse(completions, Endpoint.COMPLETIONS))
    assert not replays(_parse({**completions, "echo": True}, Endpoint.COMPLETIONS))
    assert not replays(_parse({**completions, "prompt": ["x", "y"]}, Endpoint.COMPLETIONS))


def test_a_sampled_stream_without_a_seed_is_refused_a_replay() -> None:
    fmt = {"response_format": {"type": "json_object"}}
    sampled = _parse({**CHAT, **fmt, "temperature": 0.7})
    assert replays(sampled)
    assert "without a `seed`" in (replay_refusal(sampled) or "")
    no_temperature = dict(CHAT)
    del no_temperature["temperature"]
    assert replay_refusal(_parse({**no_temperature, **fmt})) is not None
    assert replay_refusal(_parse({**CHAT, **fmt, "temperature": 0.7, "seed": 3})) is None
    logprobs = _parse({**CHAT, **fmt, "logprobs": True})
    assert "log-probabilities" in (replay_refusal(logprobs) or "")


def test_local_workers_serve_tool_calls_as_configured() -> None:
    """deploy/local's workers get a tool-call parser and auto tool choice by default (without
    them vLLM refuses a named tool_choice with 400), none when the operator turns them off."""
    def argv(**kw: Any) -> list[str]:
        return vllm_argv(EngineSettings(Path("/m"), **kw), port=1, events_port=2,
                         etcd_url="http://127.0.0.1:2379")

    default = argv()
    assert default[default.index("--tool-call-parser") + 1] == "pythonic"
    assert "--enable-auto-tool-choice" in default
    assert "--structured-outputs-config" not in default
    named_only = argv(auto_tool_choice=False)
    assert "--tool-call-parser" in named_only and "--enable-auto-tool-choice" not in named_only
    off = argv(tool_call_parser=None)
    assert "--tool-call-parser" not in off and "--enable-auto-tool-choice" not in off
    tight = argv(structured_outputs={"backend": "xgrammar", "disable_any_whitespace": True})
    assert json.loads(tight[tight.index("--structured-outputs-config") + 1]) == {
        "backend": "xgrammar", "disable_any_whitespace": True}
