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
`router.front.api.max_new_tokens`), or than `token_cap` when it sets none, has overrun the stream
(`StreamOverrun`).

A stream of n > 1 choices is kept per choice (`Choice`: its ids, finish, text offsets, stop
strings), and the answer is finished only once every choice is. Its continuation is one
`/v1/completions` request with a batch of token-id prompts, one per unfinished choice (the
prompt's ids + that choice's), which vLLM answers as choices 0..k of its own; `order` maps
them back to the client's. A choice that finished before the break is not continued. They
share one `max_tokens`: the least any of them may still have, so that vLLM itself ends each
choice at exactly its limit. A choice that may still have more ends that continuation
unfinished ("length" at the continuation's own limit is not passed on), and another round
continues it (`owes_more`; the request director opens it, no worker having failed), until
every choice has its own end: at most one round per choice. The router never cuts a choice at
its limit mid-chunk: vLLM merges the tokens of several steps into one chunk for a reader
slower than its decoding, and a chunk's text cannot be split by token here (a choice once
ended a token past the client's `max_tokens` that way). What one continuation cannot say per
choice (a frequency penalty's `logit_bias`, `min_tokens` still owed differently) is refused
(`resumable_now`). Sampled choices continue conditioned on what the
client was sent: every token once, none lost or doubled, but not the same draws.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.front.api import ClientRequest, Endpoint
from router.streaming.stops import StopText, stop_strings

__all__ = ["StreamState", "StreamOverrun", "Choice"]

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
class Choice:
    """One choice of the answer, as the client has been sent it."""

    index: int
    generated: list[int] = field(default_factory=list)
    """Its token ids (what a continuation resends after the prompt's)."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finished: bool = False
    cut: bool = False
    """The router ended it (a stop string the worker could not see): the worker's rest of it
    is dropped."""
    text_chars: int = 0
    """Characters of its generated text seen so far (its logprobs' text offsets go on from
    here after a break)."""
    offset_base: int = 0
    """`text_chars` when the current continuation started: its text offsets count from 0."""
    continued: int = 0
    """Token ids the current continuation has sent for it."""
    stops: StopText | None = None


@dataclass(slots=True)
class StreamState:
    """What the client has been sent so far, in tokens, per choice; shared across
    resumptions."""

    request: ClientRequest
    prompt_ids: list[int] | None = None
    choice_tokens: dict[int, int] = field(default_factory=dict)
    """Token ids received per choice index, each bounded by the request's per-choice limit."""
    finish_reason: str | None = None
    """Choice 0's finish reason, set once every choice has finished (the answer is whole)."""
    stop_reason: int | str | None = None
    done: bool = False
    usage_sent: bool = False
    chunk_id: str | None = None
    created: int | None = None
    model: str | None = None
    resumed: bool = False
    chunks: int = 0
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
    """The router ended the last unfinished choice itself (a stop string the worker could not
    see across a break): the stream ends here, the worker's rest unread."""
    choices: dict[int, Choice] = field(default_factory=dict)
    """Every choice by its index in the client's stream (all `n` of them from the start)."""
    order: list[int] = field(default_factory=list)
    """The current continuation's prompts: its choice k continues the client's `order[k]`."""
    asked: int = 0
    """The current continuation's `max_tokens` (what each of its prompts may generate)."""
    expected: int = 1
    """Choices the answer has: `n` per prompt."""
    paused: bool = False
    """The current continuation ended a choice at its own `max_tokens`, short of the
    client's: another round is owed (`owes_more`)."""

    def __post_init__(self) -> None:
        req = self.request
        self.expected = _choice_count(req)
        strings = stop_strings(req.body) if req.resumable else ()
        min_tokens = req.body.get("min_tokens")
        for index in range(self.expected):
            choice = self._choice(index)
            if strings:
                choice.stops = StopText(strings, include=not req.strip_stops,
                                        min_tokens=min_tokens if isinstance(min_tokens, int)
                                        else 0)

    @property
    def generated(self) -> list[int]:
        """The token ids of choice 0 (what conversations record and load accounting counts)."""
        return self._choice(0).generated

    @generated.setter
    def generated(self, ids: list[int]) -> None:
        self._choice(0).generated = ids

    @property
    def started(self) -> bool:
        """Whether anything from a worker has reached the client."""
        return self.chunks > 0

    def _choice(self, index: int) -> Choice:
        choice = self.choices.get(index)
        if choice is None:
            choice = self.choices[index] = Choice(index)
        return choice

    def unfinished(self) -> list[int]:
        """The indexes of the choices a continuation must go on with, in order."""
        return [i for i in sorted(self.choices) if not self.choices[i].finished]

    def resumable_now(self) -> str | None:
        """Why this stream cannot be continued elsewhere without replaying what the client
        already has, or changing how the rest is sampled; None when it can."""
        if self.content_sent and (self.prompt_ids is None or self.untracked):
            return "the worker did not return the token ids a resumption needs"
        if self.content_sent and self.expected > 1:
            # One continuation carries every unfinished choice, with one set of sampling
            # parameters: what differs per choice cannot be said in it.
            body = self.request.body
            if body.get("frequency_penalty") not in (None, 0, 0.0):
                return ("a frequency penalty of n > 1 choices cannot be carried (each would "
                        "need its own logit_bias)")
            if len(set(self._min_tokens_left())) > 1:
                return ("the choices still owe different `min_tokens`, which one "
                        "continuation cannot carry")
        return None

    def continuation_prompt(self) -> list[int] | list[list[int]]:
        """A continuation's `prompt`: the prompt's token ids and what the client has of the
        answer; for n > 1, one such prompt per unfinished choice (vLLM's batched prompts,
        each answered as its own choice, `order` maps them back)."""
        assert self.prompt_ids is not None, "a continuation needs the prompt's token ids"
        if self.expected == 1:
            return self.prompt_ids + self.generated
        return [self.prompt_ids + self.choices[i].generated for i in self.unfinished()]

    def remaining_max_tokens(self) -> int:
        """What a continuation may generate: the least any unfinished choice may still have
        (vLLM ends each choice there; those owed more go on in another round, `owes_more`).
        Without a limit in the request, the router's cap: vLLM clamps it to what the model's
        context leaves, as it clamped the original (a continuation without one would get
        completions' default of 16)."""
        limit = self._limit()
        left = [limit - len(self.choices[i].generated) for i in self.unfinished()] \
            or [limit - len(self.generated)]
        return max(0, min(left))

    def owes_more(self) -> bool:
        """Whether a continuation ended (its [DONE]) with choices that stopped at its own
        `max_tokens` short of theirs: another round continues them."""
        return self.paused and not self.ended and self.finish_reason is None

    def remaining_min_tokens(self, min_tokens: int) -> int:
        """A continuation's `min_tokens` for a request asking `min_tokens` per choice (the
        same for every unfinished choice: `resumable_now` refuses a stream where not)."""
        return max(self._min_tokens_left(min_tokens) or [0])

    def _min_tokens_left(self, min_tokens: int | None = None) -> list[int]:
        if min_tokens is None:
            asked = self.request.body.get("min_tokens")
            min_tokens = asked if isinstance(asked, int) and not isinstance(asked, bool) else 0
        ids = [self.choices[i].generated for i in self.unfinished()] or [self.generated]
        return [max(0, min_tokens - len(g)) for g in ids]

    def continue_here(self) -> None:
        """A continuation's stream starts now: its chunks are rewritten from here on."""
        self.resumed = True
        self.order = self.unfinished() if self.expected > 1 else [0]
        self.asked = self.remaining_max_tokens()
        self.paused = False
        for choice in self.choices.values():
            choice.offset_base = choice.text_chars
            choice.continued = 0

    @property
    def completion_tokens(self) -> int:
        """Token ids received over all choices."""
        return sum(self.choice_tokens.values())

    def _limit(self) -> int:
        limit = self.request.max_tokens
        return self.token_cap if limit is None else limit

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
        content = finish = cut = False
        dropped = 0
        kept: list[Any] = []
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                kept.append(choice)
                continue
            state = self._choice(_index(choice))
            if state.cut:  # the router ended it: the worker's rest of it is not sent
                dropped += 1
                continue
            kept.append(choice)
            text = _content(choice)
            state.text_chars += len(text)
            if "prompt_token_ids" in choice:
                p = choice["prompt_token_ids"] if keep else choice.pop("prompt_token_ids")
                prompt = p if p is not None else prompt
            ids = choice.get("token_ids") if keep else choice.pop("token_ids", None)
            if ids:
                self._extend(state, ids)
            elif text:
                self.untracked = True
            if state.stops is not None:
                text = self._hold(state, choice, text, len(ids or ()))
                cut = cut or state.cut
            content = content or bool(text) or bool(ids)
            if choice.get("finish_reason") is not None:
                finish = True
                self._finish(state, choice["finish_reason"], choice.get("stop_reason"))
        if dropped:
            obj["choices"] = kept
        if prompt is not None and self.prompt_ids is None:
            self.prompt_ids = list(prompt)
        self.ended = self.ended or (cut and self.finish_reason is not None)
        if obj.get("usage") is not None:
            if any(c.cut for c in self.choices.values()) and not kept:
                # The worker's count has tokens of a choice the router ended: the client's
                # view instead.
                return self.usage_chunk()
            self.usage_sent = True
        if dropped and not kept and obj.get("usage") is None:
            return None
        if self.restarted:
            if not content and not self.content_sent and not finish:
                return None  # the restarted worker's preamble: the client has it
            obj["id"] = self.chunk_id  # one stream, one id
        self.content_sent = self.content_sent or content
        return obj

    def _finish(self, choice: Choice, reason: str, stop_reason: Any) -> None:
        choice.finish_reason, choice.finished = reason, True
        choice.stop_reason = stop_reason if isinstance(stop_reason, int | str) else None
        if len(self.choices) >= self.expected and all(c.finished for c in
                                                      self.choices.values()):
            first = self._choice(0)
            self.finish_reason, self.stop_reason = first.finish_reason, first.stop_reason

    def _extend(self, choice: Choice, ids: list[int]) -> None:
        choice.generated.extend(ids)
        key = choice.index
        count = self.choice_tokens.get(key, 0) + len(ids)
        self.choice_tokens[key] = count
        bounded = self.request.max_tokens is not None
        limit = self._limit()
        if count > limit:
            what = "the request's limit of" if bounded else "the router's cap of"
            raise StreamOverrun(f"choice {key} of the answer has {count} tokens, over {what} "
                                f"{limit} per choice", bounded=bounded)

    def _hold(self, state: Choice, choice: dict[str, Any], text: str, tokens: int) -> str:
        """Apply the router's stop-string handling to one choice; returns its new text."""
        assert state.stops is not None
        emitted = state.stops.feed(text, tokens)
        out = emitted.text
        finish = choice.get("finish_reason")
        if emitted.stop is not None:
            choice["finish_reason"], choice["stop_reason"] = "stop", emitted.stop
            if finish is None:  # the worker goes on: its rest is dropped
                state.cut = True
        elif finish is not None:
            out += state.stops.finish(choice.get("stop_reason"))
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
            if obj.get("usage") is not None and self.request.include_usage \
                    and not self.paused:
                # The continuation's usage counts the resent tokens as prompt: report the
                # client's view instead. Before the last round's end, nothing: the director
                # sends the usage once every choice has ended.
                return self.usage_chunk()
            return None
        outs = [out for c in choices if isinstance(c, dict)
                for out in (self._translate_choice(c),) if out is not None]
        if not outs:
            return None
        return {"id": self.chunk_id, "object": self._object(), "created": self.created,
                "model": self.model, "choices": outs}

    def _translate_choice(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        """One choice of a continuation's chunk, as the client's choice it continues (None:
        nothing to send)."""
        k = _index(choice)
        order = self.order or [0]  # (set by `continue_here`)
        if not 0 <= k < len(order):
            return None  # no prompt of this continuation: its choices end unfinished
        state = self._choice(order[k])
        if state.finished:
            return None  # ended by the router (a stop string): the worker's rest is not sent
        ids = choice.get("token_ids") or []
        text = choice.get("text") or ""
        finish = choice.get("finish_reason")
        stop_reason = choice.get("stop_reason")
        logprobs = choice.get("logprobs") if self.request.logprobs is not None else None
        raw_chars = len(text)
        state.continued += len(ids)
        # Past the client's own limit is the worker's overrun: the continuation asked for no
        # more than the least any choice may still have (`remaining_max_tokens`).
        self._extend(state, ids)
        if finish == "length" and state.continued >= (self.asked or self._limit()) \
                and len(state.generated) < self._limit():
            # The continuation's own limit, not the client's: another round goes on with it.
            # (Short of what was asked, "length" is vLLM's end: the model's context is full.)
            finish, stop_reason = None, None
            self.paused = True
        if state.stops is not None:
            held: dict[str, Any] = {"finish_reason": finish, "stop_reason": stop_reason}
            text = self._hold(state, held, text, len(ids))
            finish, stop_reason = held["finish_reason"], held["stop_reason"]
        if finish is not None:
            self._finish(state, finish, stop_reason)
            # The router ended the last unfinished choice: the stream ends here.
            self.ended = self.ended or (state.cut and self.finish_reason is not None)
        state.text_chars += raw_chars
        if not text and not ids and finish is None:
            return None
        out: dict[str, Any]
        if self.request.endpoint is Endpoint.CHAT:
            out = {"index": state.index, "delta": {"content": text} if text else {},
                   "logprobs": _chat_logprobs(logprobs, self.request.logprobs or 0),
                   "finish_reason": finish}
        else:
            out = {"index": state.index, "text": text,
                   "logprobs": _shifted_logprobs(logprobs, state.offset_base),
                   "finish_reason": finish, "stop_reason": stop_reason}
        if self.request.endpoint is Endpoint.CHAT and finish is not None:
            out["stop_reason"] = stop_reason
        self.content_sent = True
        if self.request.wants_token_ids:
            out["token_ids"] = ids
        return out


def _index(choice: dict[str, Any]) -> int:
    index = choice.get("index", 0)
    return index if isinstance(index, int) and not isinstance(index, bool) else 0


def _choice_count(req: ClientRequest) -> int:
    """How many choices the answer has: `n` for each prompt (a completions batch of prompts
    numbers its choices prompt by prompt, as vLLM does)."""
    prompt = req.body.get("prompt")
    prompts = 1
    if req.endpoint is Endpoint.COMPLETIONS and isinstance(prompt, list) and prompt \
            and all(isinstance(p, str | list) for p in prompt):
        prompts = len(prompt)
    return max(1, req.n) * prompts


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
