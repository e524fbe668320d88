"""What a client has been sent of a stream, in tokens, and the rewriting of a continuation's
chunks into the original stream's format.

The router asks workers for `return_token_ids`, so the first chunk carries the prompt's token
ids and every chunk the ids of its tokens. `StreamState` keeps them (and strips them from what
the client sees unless it asked), so when a stream breaks the router knows the exact tokens
already delivered and can continue on another worker with `prompt = prompt_ids + generated`
and the remaining `max_tokens`. Chunks of the continuation (a `/v1/completions` stream) are
rewritten into the client's format with the original id, created and model, so the client
sees one uninterrupted stream; logprobs too (chat entries rebuilt from the continuation's
completions logprobs, completions text offsets moved past the text already sent).

A stream with stop strings has its text held back and its stop strings found by the router
(`stops.StopText`, see `router/streaming/stops.py`). What a stream may be resumed from is
tracked too: a continuation needs the prompt's token ids and the ids of every token whose text
reached the client; without them (a worker that ignores `return_token_ids`) it would replay
the start of the answer, so it is refused instead (`resumable_now`). Token ids are counted per
choice index: a choice with more than the request's per-choice limit (read as vLLM reads it,
`router.api.max_new_tokens`), or than `token_cap` when it sets none, has overrun the stream
(`StreamOverrun`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.api import ClientRequest, Endpoint
from router.streaming.stops import StopText, stop_strings

__all__ = ["StreamState", "StreamOverrun"]

DEFAULT_TOKEN_CAP = 1 << 20


class StreamOverrun(Exception):
    """One choice of the stream carried more token ids than it may: the stream ends with an
    error, never resumed (what it would resume from is what the worker got wrong).

    `bounded`: the request's own limit was passed (a worker that generates past what it was
    asked; vLLM never does when the limit is read as it reads it, `max_new_tokens`). False:
    the request set no limit and the router's own cap (`token_cap`) was passed, an answer the
    client sized: never the worker's failure."""

    def __init__(self, message: str, *, bounded: bool) -> None:
        super().__init__(message)
        self.bounded = bounded


@dataclass(slots=True)
class StreamState:
    """What the client has been sent so far, in tokens; shared across resumptions."""

    request: ClientRequest
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    """The token ids of choice 0 (the one a stream resumes: only n = 1 streams do)."""
    choice_tokens: dict[int, int] = field(default_factory=dict)
    """Token ids received per choice index, each bounded by the request's per-choice limit."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    done: bool = False
    usage_sent: bool = False
    chunk_id: str | None = None
    created: int | None = None
    model: str | None = None
    resumed: bool = False
    chunks: int = 0
    text_chars: int = 0
    """Characters of generated text sent so far (counted for streams that ask for logprobs,
    the only ones whose continuation needs it)."""
    offset_base: int = 0
    """`text_chars` when the current continuation started: its text offsets count from 0."""
    token_cap: int = DEFAULT_TOKEN_CAP
    """Token ids a choice may carry when its request does not bound them (`max_tokens`)."""
    content_sent: bool = False
    """Whether any generated text or token has reached the client."""
    untracked: bool = False
    """A chunk carried text without its token ids: the delivered tokens are not known."""
    restarted: bool = False
    """The stream was restarted from the original request (nothing had been delivered): the
    new worker's preamble (a chat role chunk) is not sent twice."""
    ended: bool = False
    """The router found a stop string the worker could not see (across a break): the
    stream ends here, the worker's rest unread."""
    stops: StopText | None = None

    def __post_init__(self) -> None:
        req = self.request
        strings = stop_strings(req.body) if req.resumable else ()
        if strings:
            min_tokens = req.body.get("min_tokens")
            self.stops = StopText(strings, include=not req.strip_stops,
                                  min_tokens=min_tokens if isinstance(min_tokens, int) else 0)

    @property
    def started(self) -> bool:
        """Whether anything from a worker has reached the client."""
        return self.chunks > 0

    def resumable_now(self) -> str | None:
        """Why this stream cannot be continued elsewhere without replaying what the client
        already has, or None when it can."""
        if self.content_sent and (self.prompt_ids is None or self.untracked):
            return "the worker did not return the token ids a resumption needs"
        return None

    def continue_here(self) -> None:
        """A continuation's stream starts now: its chunks are rewritten from here on."""
        self.resumed = True
        self.offset_base = self.text_chars

    def remaining_max_tokens(self) -> int:
        """What a continuation may still generate. Without a limit in the request, the
        router's cap: vLLM clamps it to what the model's context leaves, as it clamped the
        original (a continuation without one would get completions' default of 16)."""
        limit = self.request.max_tokens
        return max(0, (self.token_cap if limit is None else limit) - len(self.generated))

    @property
    def completion_tokens(self) -> int:
        """Token ids received over all choices."""
        return sum(self.choice_tokens.values())

    def absorb(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Record one worker chunk and return what the client should get (None: nothing)."""
        self.chunks += 1
        if self.resumed:
            return self._translate(obj)
        if self.chunk_id is None:
            self.chunk_id, self.created, self.model = obj.get("id"), obj.get("created"), \
                obj.get("model")
        keep = self.request.wants_token_ids
        prompt = obj.get("prompt_token_ids") if keep else obj.pop("prompt_token_ids", None)
        content = False
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            text = _content(choice)
            self.text_chars += len(text)
            if "prompt_token_ids" in choice:
                p = choice["prompt_token_ids"] if keep else choice.pop("prompt_token_ids")
                prompt = p if p is not None else prompt
            ids = choice.get("token_ids") if keep else choice.pop("token_ids", None)
            if ids:
                self._extend(choice.get("index", 0), ids)
            elif text:
                self.untracked = True
            if self.stops is not None and choice.get("index", 0) == 0:
                text = self._hold(choice, text, len(ids or ()))
            content = content or bool(text) or bool(ids)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")
        if prompt is not None and self.prompt_ids is None:
            self.prompt_ids = list(prompt)
        if obj.get("usage") is not None:
            self.usage_sent = True
        if self.restarted:
            if not content and not self.content_sent and self.finish_reason is None:
                return None  # the restarted worker's preamble: the client has it
            obj["id"] = self.chunk_id  # one stream, one id
        self.content_sent = self.content_sent or content
        return obj

    def _extend(self, index: object, ids: list[int]) -> None:
        key = index if isinstance(index, int) and not isinstance(index, bool) else 0
        if key == 0:
            self.generated.extend(ids)
        count = self.choice_tokens.get(key, 0) + len(ids)
        self.choice_tokens[key] = count
        bounded = self.request.max_tokens is not None
        limit = self.request.max_tokens if self.request.max_tokens is not None \
            else self.token_cap
        if count > limit:
            what = "the request's limit of" if bounded else "the router's cap of"
            raise StreamOverrun(f"choice {key} of the answer has {count} tokens, over {what} "
                                f"{limit} per choice", bounded=bounded)

    def _hold(self, choice: dict[str, Any], text: str, tokens: int) -> str:
        """Apply the router's stop-string handling to one choice; returns its new text."""
        assert self.stops is not None
        emitted = self.stops.feed(text, tokens)
        out = emitted.text
        finish = choice.get("finish_reason")
        if emitted.stop is not None:
            choice["finish_reason"], choice["stop_reason"] = "stop", emitted.stop
            self.ended = finish is None  # the worker goes on: its stream is cut here
        elif finish is not None:
            out += self.stops.finish(choice.get("stop_reason"))
        _set_content(choice, out)
        return out

    def usage(self) -> dict[str, int]:
        prompt = len(self.prompt_ids or ())
        completion = self.completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def usage_chunk(self) -> dict[str, Any]:
        self.usage_sent = True
        return {"id": self.chunk_id, "object": self._object(), "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage()}

    def _object(self) -> str:
        return "chat.completion.chunk" if self.request.endpoint is Endpoint.CHAT \
            else "text_completion"

    def _translate(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """A chunk of the `/v1/completions` continuation, in the original stream's format."""
        choices = obj.get("choices") or []
        if not choices:
            if obj.get("usage") is not None and self.request.include_usage:
                # The continuation's usage counts the resent tokens as prompt: report the
                # client's view instead.
                return self.usage_chunk()
            return None
        choice = choices[0]
        ids = choice.get("token_ids") or []
        self._extend(0, ids)
        text = choice.get("text") or ""
        raw_chars = len(text)
        if self.stops is not None:
            text = self._hold(choice, text, len(ids))
        finish = choice.get("finish_reason")
        if finish is not None:
            self.finish_reason = finish
            self.stop_reason = choice.get("stop_reason")
        if not text and not ids and finish is None:
            self.text_chars += raw_chars
            return None
        out: dict[str, Any]
        logprobs = choice.get("logprobs") if self.request.logprobs is not None else None
        if self.request.endpoint is Endpoint.CHAT:
            out = {"index": 0, "delta": {"content": text} if text else {},
                   "logprobs": _chat_logprobs(logprobs, self.request.logprobs or 0),
                   "finish_reason": finish}
        else:
            out = {"index": 0, "text": text,
                   "logprobs": _shifted_logprobs(logprobs, self.offset_base),
                   "finish_reason": finish, "stop_reason": choice.get("stop_reason")}
        if self.request.endpoint is Endpoint.CHAT and finish is not None:
            out["stop_reason"] = choice.get("stop_reason")
        self.text_chars += raw_chars
        self.content_sent = True
        if self.request.wants_token_ids:
            out["token_ids"] = ids
        return {"id": self.chunk_id, "object": self._object(), "created": self.created,
                "model": self.model, "choices": [out]}


def _content(choice: dict[str, Any]) -> str:
    """A choice's generated text: a chat delta's content, or a completion's text."""
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def _set_content(choice: dict[str, Any], text: str) -> None:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        if text or "content" in delta:
            delta["content"] = text
    else:
        choice["text"] = text


def _shifted_logprobs(logprobs: Any, chars_before: int) -> Any:
    """A continuation's completions logprobs, its text offsets moved past the text already
    sent (they count from the start of the generated text)."""
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("text_offset"), list):
        return logprobs
    return {**logprobs, "text_offset": [o + chars_before if isinstance(o, int) else o
                                        for o in logprobs["text_offset"]]}


def _chat_logprobs(logprobs: Any, top: int) -> dict[str, Any] | None:
    """Completions logprobs (`tokens`, `token_logprobs`, `top_logprobs` maps) in the chat
    format (`content`: per token its text, logprob, UTF-8 bytes and the `top` best)."""
    if not isinstance(logprobs, dict):
        return None
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    content = []
    for token, value, best in zip(tokens, values, tops, strict=False):
        ranked = sorted(best.items(), key=lambda item: -item[1]) if isinstance(best, dict) \
            else []
        content.append({
            "token": token, "logprob": _chat_logprob(value),
            "bytes": list(str(token).encode("utf-8", errors="replace")),
            "top_logprobs": [{"token": t, "logprob": _chat_logprob(v),
                              "bytes": list(str(t).encode("utf-8", errors="replace"))}
                             for t, v in ranked[:top]]})
    return {"content": content}


def _chat_logprob(value: Any) -> float:
    # As vLLM's chat endpoint: -inf (and a missing value) become -9999.0, JSON has no -inf.
    return max(float(value), -9999.0) if isinstance(value, int | float) else -9999.0
