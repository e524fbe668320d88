"""A chat session as a user's program sees it: the `openai` client, streaming, greedy.

The router reports what happened in response headers (`X-KVKeep-*`) and, for events during a
stream (a resumption on another worker), in SSE comment lines (`: kvkeep {...}`) that OpenAI
clients skip. To show both without giving up the real client, the client's HTTP transport is
tapped: `TapTransport` passes every byte through untouched and keeps the headers and the
comment lines of the latest response on the side.

References ("what the answer is without any failure") are computed with a plain HTTP request
carrying a `cache_salt`: vLLM mixes the salt into block hashes (and the connector into the
namespace), so a reference neither reads nor warms the KV that the session under test uses.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["NoteTee", "TapTransport", "ChatSession", "Turn", "reference_answer", "Message",
           "REFERENCE_SALT"]

Message = dict[str, str]
REFERENCE_SALT = "kvkeep-reference"


class NoteTee(httpx.SyncByteStream):
    """Yields the response body unchanged, handing each SSE comment note (`: kvkeep {...}`) to
    `on_note` as it passes."""

    def __init__(self, inner: httpx.SyncByteStream,
                 on_note: Callable[[dict[str, Any]], None]) -> None:
        self._inner = inner
        self._on_note = on_note
        self._pending = b""

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._scan(chunk)
            yield chunk

    def close(self) -> None:
        self._inner.close()

    def _scan(self, chunk: bytes) -> None:
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            if line.startswith(b": kvkeep "):
                try:
                    note = json.loads(line[len(b": kvkeep "):])
                except ValueError:
                    continue
                if isinstance(note, dict):
                    self._on_note(note)


class TapTransport(httpx.BaseTransport):
    """An httpx transport that records the latest response's headers and kvkeep SSE notes."""

    def __init__(self, inner: httpx.BaseTransport | None = None) -> None:
        self._inner = inner or httpx.HTTPTransport()
        self.headers: dict[str, str] = {}
        self.notes: list[dict[str, Any]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        self.headers = {k.lower(): v for k, v in response.headers.items()}
        self.notes = []
        assert isinstance(response.stream, httpx.SyncByteStream)
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=NoteTee(response.stream, self.notes.append),
                              extensions=response.extensions)

    def close(self) -> None:
        self._inner.close()


@dataclass(slots=True)
class Turn:
    """One streamed answer as the client saw it, plus what the router said about it."""

    text: str
    chunks: int
    seconds: float
    headers: dict[str, str]
    notes: list[dict[str, Any]]
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """vLLM's usage `prompt_tokens_details.cached_tokens`: local prefix-cache hits plus tokens
    the connector loaded, as counted when the request was admitted."""
    error: str | None = None

    @property
    def worker(self) -> str | None:
        return self.headers.get("x-kvkeep-worker")

    @property
    def route(self) -> str | None:
        return self.headers.get("x-kvkeep-route")

    @property
    def restore_hint(self) -> bool:
        return self.headers.get("x-kvkeep-restore") == "1"

    @property
    def resumptions(self) -> list[dict[str, Any]]:
        return [n for n in self.notes if "resumed_on" in n and "after_tokens" in n]

    @property
    def summary_note(self) -> dict[str, Any]:
        """The router's end-of-stream note (final worker, resumptions); {} if none."""
        return next((n for n in reversed(self.notes) if "completion_tokens" in n), {})


@dataclass
class ChatSession:
    """A multi-turn conversation through the router: one `openai` client, one session id."""

    base_url: str
    session_id: str
    model: str = "tiny"
    system: str | None = None
    timeout_s: float = 120.0
    history: list[Message] = field(default_factory=list)
    _tap: TapTransport = field(init=False, default_factory=TapTransport)
    _client: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        import openai

        # An httpx client: recent openai releases (built on `httpx2`) accept one as well.
        http_client: Any = httpx.Client(transport=self._tap)
        self._client = openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0,
            timeout=self.timeout_s, http_client=http_client)
        if self.system is not None and not self.history:
            self.history.append({"role": "system", "content": self.system})

    @property
    def serving_worker(self) -> str | None:
        """The worker the router chose for the latest request (known once its headers are in;
        a stream resumed elsewhere is not reflected)."""
        return self._tap.headers.get("x-kvkeep-worker")

    def messages_for(self, user: str) -> list[Message]:
        """The request's messages if the user says `user` next."""
        return [*self.history, {"role": "user", "content": user}]

    def ask(self, user: str, max_tokens: int,
            on_chunk: Callable[[int], None] | None = None) -> Turn:
        """Stream the answer to `user`; on success both messages join the history.

        `ignore_eos` (a vLLM extension) keeps answer lengths fixed: a random-weight model
        may otherwise stop at an end-of-sequence token it picks by chance.
        """
        messages = self.messages_for(user)
        started = time.monotonic()
        pieces: list[str] = []
        usage: Any = None
        error: str | None = None
        try:
            stream = self._client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_headers={"X-Session-Id": self.session_id},
                extra_body={"ignore_eos": True})
            for chunk in stream:
                for choice in chunk.choices:
                    pieces.append(choice.delta.content or "")
                usage = chunk.usage or usage
                if on_chunk is not None and chunk.choices:
                    on_chunk(len(pieces))
        except Exception as exc:  # the client's whole failure surface: report, never hide
            error = f"{type(exc).__name__}: {exc}"
        text = "".join(pieces)
        turn = Turn(text=text, chunks=len(pieces), seconds=time.monotonic() - started,
                    headers=dict(self._tap.headers), notes=list(self._tap.notes), error=error)
        if usage is not None:
            turn.completion_tokens = usage.completion_tokens
            turn.prompt_tokens = usage.prompt_tokens
            details = getattr(usage, "prompt_tokens_details", None)
            turn.cached_tokens = getattr(details, "cached_tokens", None)
        if error is None:
            self.history.extend([{"role": "user", "content": user},
                                 {"role": "assistant", "content": text}])
        return turn

    def close(self) -> None:
        self._client.close()


def reference_answer(base_url: str, messages: list[Message], max_tokens: int, *,
                     model: str = "tiny", salt: str = REFERENCE_SALT,
                     timeout_s: float = 120.0) -> str:
    """The greedy answer to `messages` from one unbroken, non-streamed request to `base_url`
    (a worker, or a router: without a session id it is routed statelessly)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "cache_salt": salt}
    resp = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=timeout_s)
    resp.raise_for_status()
    return str(resp.json()["choices"][0]["message"]["content"])
