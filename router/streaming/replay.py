"""Resuming a broken stream that a continuation cannot carry: by replaying the whole request.

A structured-output stream (`response_format` json_schema / json_object, `structured_outputs`
regex / choice / grammar, the older `guided_*` fields) or a tool-call stream (`tools`) cannot
be continued with `/v1/completions` from the delivered tokens, as plain text is
(`resume.py`): vLLM's grammar starts at the first generated token, so a continuation
would be held to a new JSON document (or regex match) after a prefix that already began one,
and a named or required `tool_choice` is itself a grammar (the tool's parameters schema) plus
the chat endpoint's rewriting of the answer into `tool_calls` deltas, which completions cannot
give. vLLM 0.32 has no way to start a grammar from a prefix.

So such a stream is resumed by sending the client's original request again to another worker
and skipping what the client already has: the replay must reproduce it exactly. Every field the
client was sent of the answer (its text, and per tool call its id, name and arguments; the
token ids too when the worker returned them) is recorded while it is relayed (`Replay.observe`
in recording mode); on the replay each chunk is checked against that record and only what lies
past it reaches the client (`Replay.observe` in replay mode). The ids vLLM makes up for the
answer (the chunk id, each tool call's id) keep the values the client first saw.

A replay is deterministic only where decoding is: greedy (`temperature` 0) or seeded, on
workers serving the same model in the same dtype (what failover needs anyway). A sampled
request without a `seed` is refused a replay up front (`replay_refusal`). Where the replay
differs anyway, nothing of it reaches the client past the last character that agreed: the
stream ends with an OpenAI-shaped error event (`ReplayMismatch`), never with text that does
not continue what was sent (for a grammar: never non-conforming text).

Cost: the replay regenerates the delivered tokens, one decode step each (its prompt's KV is
restored from the store where the worker has kvkeep's connector); the client waits for them
with no bytes in between.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.front.api import ClientRequest, Endpoint

__all__ = ["REPLAY_FIELDS", "Replay", "ReplayMismatch", "replays", "replay_refusal"]

# Fields whose stream resumes by replay (see the module docstring). Other fields that block a
# continuation (`echo`, `suffix`, `prompt_logprobs`) block a replay too: see `replays`.
REPLAY_FIELDS = ("tools", "functions", "response_format", "structured_outputs", "guided_json",
                 "guided_regex", "guided_choice", "guided_grammar")
_BLOCKING = ("suffix", "prompt_logprobs", "echo", "best_of")


class ReplayMismatch(Exception):
    """The replay differs from what the client was sent: the stream ends with an error."""


def replays(creq: ClientRequest) -> bool:
    """Whether a broken stream of `creq` resumes by replay (else: by continuation, or not)."""
    body = creq.body
    if not creq.stream or creq.n != 1 or creq.resumable:
        return False
    if not any(body.get(k) for k in REPLAY_FIELDS) or any(body.get(k) for k in _BLOCKING):
        return False
    prompt = body.get("prompt")
    return creq.endpoint is Endpoint.CHAT or isinstance(prompt, str) or (
        isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))


def replay_refusal(creq: ClientRequest) -> str | None:
    """Why a replay of `creq` could not reproduce what was sent (None: it can be tried)."""
    body = creq.body
    temperature = body.get("temperature")
    greedy = isinstance(temperature, int | float) and temperature == 0
    if not greedy and body.get("seed") is None:
        # vLLM's default temperature is 1: without a seed no two runs agree.
        return "a sampled stream (temperature > 0) without a `seed` cannot be replayed"
    if creq.logprobs is not None:
        return "a replay does not carry the log-probabilities of a structured or tool stream"
    return None


@dataclass(slots=True)
class _Text:
    """One field of the answer (content, or a tool call's arguments): what the client was
    sent, and how much of it the replay has reproduced so far."""

    sent: str = ""
    replayed: int = 0

    def take(self, piece: str, where: str) -> str:
        """The part of the replay's `piece` past what was sent; raises if the rest differs."""
        start = self.replayed
        overlap = self.sent[start:start + len(piece)]
        if piece[:len(overlap)] != overlap:
            raise ReplayMismatch(f"the replay's {where} differs from what was sent at "
                                 f"character {start + _common(overlap, piece)}")
        self.replayed += len(piece)
        new = piece[len(overlap):]
        self.sent += new
        return new

    @property
    def behind(self) -> bool:
        return self.replayed < len(self.sent)


@dataclass(slots=True)
class _Tool:
    id: str | None = None
    name: str | None = None
    arguments: _Text = field(default_factory=_Text)
    replayed_head: bool = False
    """The replay has sent this call's head (id, type, name) again (dropped for the client)."""


@dataclass(slots=True)
class Replay:
    """What the client has of choice 0, recorded while relaying, and the filter that skips it
    on a replay. One per stream, across any number of replays."""

    content: _Text = field(default_factory=_Text)
    tools: dict[int, _Tool] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    replayed_tokens: int = 0
    role_sent: bool = False
    chunk_id: str | None = None
    replaying: bool = False
    caught_up: bool = True
    worker: str = ""

    def begin(self, worker: str) -> None:
        """A replay's stream starts now, on `worker`."""
        self.replaying, self.caught_up, self.worker = True, False, worker
        self.content.replayed = 0
        self.replayed_tokens = 0
        for tool in self.tools.values():
            tool.arguments.replayed = 0
            tool.replayed_head = False

    def observe(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """One worker chunk: recorded (before any replay), or, on a replay, checked against
        what was sent and cut to what lies past it (None: nothing of it is new)."""
        if self.chunk_id is None:
            self.chunk_id = obj.get("id") if isinstance(obj.get("id"), str) else None
        if not self.replaying:
            for choice in _choices(obj):
                self._record(choice)
            return obj
        if self.chunk_id is not None:
            obj["id"] = self.chunk_id  # one stream, one id
        kept = []
        for choice in _choices(obj):
            if self._replay(choice):
                kept.append(choice)
        finish = any(c.get("finish_reason") is not None for c in _choices(obj))
        if not self.caught_up:
            self.caught_up = not self._behind()
            if finish and not self.caught_up:
                raise ReplayMismatch(f"the replay on {self.worker} ended before it reached "
                                     "what was sent")
        if "choices" in obj and isinstance(obj["choices"], list):
            if not kept and obj["choices"] and obj.get("usage") is None:
                return None
            obj["choices"] = kept
        return obj

    def _behind(self) -> bool:
        return (self.content.behind or self.replayed_tokens < len(self.tokens)
                or any(t.arguments.behind or (t.name is not None and not t.replayed_head)
                       for t in self.tools.values()))

    def _record(self, choice: dict[str, Any]) -> None:
        self.content.sent += _content(choice)
        self.tokens.extend(_ids(choice))
        delta = choice.get("delta")
        if isinstance(delta, dict):
            self.role_sent = self.role_sent or "role" in delta
            for call in _calls(delta):
                tool = self.tools.setdefault(call["index"], _Tool())
                fn = _function(call)
                tool.id = call.get("id") if isinstance(call.get("id"), str) else tool.id
                if isinstance(fn.get("name"), str):
                    tool.name = fn["name"]
                if isinstance(fn.get("arguments"), str):
                    tool.arguments.sent += fn["arguments"]

    def _replay(self, choice: dict[str, Any]) -> bool:
        """Cut one choice of a replayed chunk to what is new; False: nothing is."""
        new = False
        ids = _ids(choice)
        if ids:
            skip = max(0, min(len(ids), len(self.tokens) - self.replayed_tokens))
            if ids[:skip] != self.tokens[self.replayed_tokens:self.replayed_tokens + skip]:
                raise ReplayMismatch(f"the replay on {self.worker} generated other tokens "
                                     f"than were sent, after token {self.replayed_tokens}")
            self.tokens.extend(ids[skip:])  # past the record: new, and the record's now
            self.replayed_tokens += len(ids)
            choice["token_ids"] = ids[skip:]
            new = new or len(ids) > skip
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if self.role_sent:
                delta.pop("role", None)
            text = delta.get("content")
            if isinstance(text, str) and text:
                delta["content"] = self._new_text(self.content, text, "content")
                new = new or bool(delta["content"])
            calls = []
            for call in _calls(delta):
                kept = self._replay_call(call)
                if kept is not None:
                    calls.append(kept)
            if "tool_calls" in delta:
                if calls:
                    delta["tool_calls"] = calls
                    new = True
                else:
                    del delta["tool_calls"]
        elif isinstance(choice.get("text"), str) and choice["text"]:
            choice["text"] = self._new_text(self.content, choice["text"], "text")
            new = new or bool(choice["text"])
        return new or choice.get("finish_reason") is not None

    def _new_text(self, text: _Text, piece: str, where: str) -> str:
        try:
            out = text.take(piece, where)
        except ReplayMismatch as exc:
            raise ReplayMismatch(f"{exc} (replay on {self.worker})") from None
        if out and not self.caught_up and self._behind():
            # New text while another field still lags: the replay took another path.
            raise ReplayMismatch(f"the replay on {self.worker} went past what was sent in its "
                                 f"{where} before reproducing the rest")
        return out

    def _replay_call(self, call: dict[str, Any]) -> dict[str, Any] | None:
        index = call["index"]
        fn = _function(call)
        tool = self.tools.get(index)
        if tool is None:  # a call the client has not seen: all of it is new
            tool = self.tools[index] = _Tool()
            tool.replayed_head = True
            if self._behind():
                raise ReplayMismatch(f"the replay on {self.worker} began a tool call the "
                                     "client had not been sent before reproducing the rest")
            self._record({"delta": {"tool_calls": [call]}})
            tool.arguments.replayed = len(tool.arguments.sent)
            return call
        name = fn.get("name")
        if isinstance(name, str) and tool.name is not None:
            if name != tool.name:
                raise ReplayMismatch(f"the replay on {self.worker} called {name!r}, not "
                                     f"{tool.name!r}")
            tool.replayed_head = True
            for key in ("id", "type"):
                call.pop(key, None)  # the client has the call's head (and its first id)
            fn.pop("name", None)
        elif isinstance(name, str):  # a head the client never got (only arguments were)
            tool.name = name
            tool.replayed_head = True
            if tool.id is not None:
                call["id"] = tool.id
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            fn["arguments"] = self._new_text(tool.arguments, args, f"tool call {index} "
                                             "arguments")
            if not fn["arguments"]:
                fn.pop("arguments")
        return call if fn or "id" in call else None


def _choices(obj: dict[str, Any]) -> list[dict[str, Any]]:
    # Only choice 0 exists: a replayed stream has n = 1.
    return [c for c in obj.get("choices") or () if isinstance(c, dict)]


def _content(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def _ids(choice: dict[str, Any]) -> list[int]:
    ids = choice.get("token_ids")
    return [t for t in ids if isinstance(t, int)] if isinstance(ids, list) else []


def _calls(delta: dict[str, Any]) -> list[dict[str, Any]]:
    calls = delta.get("tool_calls")
    if not isinstance(calls, list):
        return []
    return [c for c in calls if isinstance(c, dict) and isinstance(c.get("index"), int)]


def _function(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    return fn if isinstance(fn, dict) else {}


def _common(a: str, b: str) -> int:
    """Length of the common prefix of `a` and `b`."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
