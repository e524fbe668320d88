"""The chaos load's client: a chat session behind several router replicas, as a program behind a
load balancer sees them.

A Kubernetes Service (or any L4 balancer) in front of the router replicas sends each new
connection to a replica that is up; when a replica dies, connections to it fail and the client
retries. `RouterPool` plays that part: it holds every router URL, starts each request on a
replica not marked down, and when a request's connection fails (refused, reset, or the stream
cut before its end) marks that replica down for a few seconds and sends the whole turn again to
another one. Only transport failures are retried; an HTTP error or an error event in the stream
is the answer, and counts as a client error. A turn re-sent that way must still produce the
reference text: greedy decoding over the same messages (the session's KV, where it is restored,
must change nothing).

Streams go through the `openai` client (no retries of its own), over an httpx transport that
timestamps the router's SSE notes (`: kvkeep {...}`): the resumption of a broken stream on
another worker is timed from the last token before the note to the first after it.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from deploy.conversation import Message, NoteTee

__all__ = ["RouterPool", "ChaosSession", "TurnRecord", "Resumption", "Retry"]


class RouterPool:
    """Router URLs and which were seen down lately; shared by every session (thread-safe)."""

    def __init__(self, urls: list[str], *, down_for_s: float = 3.0) -> None:
        if not urls:
            raise ValueError("a router pool needs at least one URL")
        self.urls = list(urls)
        self._down_for = down_for_s
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()

    def order(self, rng: random.Random) -> list[str]:
        """Every URL, those not marked down first, each group in random order."""
        now = time.monotonic()
        with self._lock:
            up = [u for u in self.urls if self._down_until.get(u, 0.0) <= now]
            down = [u for u in self.urls if u not in up]
        rng.shuffle(up)
        down.sort(key=lambda u: self._down_until.get(u, 0.0))
        return up + down

    def mark_down(self, url: str) -> None:
        with self._lock:
            self._down_until[url] = time.monotonic() + self._down_for


class _TimedTap(httpx.BaseTransport):
    """Passes bytes through untouched; keeps the latest response's headers and timed notes."""

    def __init__(self) -> None:
        self._inner = httpx.HTTPTransport()
        self.headers: dict[str, str] = {}
        self.notes: list[tuple[float, dict[str, Any]]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.headers = {}
        self.notes = []
        response = self._inner.handle_request(request)
        self.headers = {k.lower(): v for k, v in response.headers.items()}
        assert isinstance(response.stream, httpx.SyncByteStream)
        notes = self.notes
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=NoteTee(response.stream,
                                             lambda note: notes.append((time.monotonic(), note))),
                              extensions=response.extensions)

    def close(self) -> None:
        self._inner.close()


@dataclass(frozen=True, slots=True)
class Resumption:
    """A stream the router continued on another worker after it broke."""

    resumed_on: str
    after_tokens: int
    gap_s: float | None
    """Last token before the break to first token after it (None: no token after)."""


@dataclass(frozen=True, slots=True)
class Retry:
    """A request whose connection to a router failed, sent again to another replica."""

    router: str
    error: str
    gap_s: float | None = None
    """The failure to the first token of the retried request (None: none came)."""


@dataclass(frozen=True, slots=True)
class TurnRecord:
    session_id: str
    index: int
    text: str
    error: str | None
    started_s: float
    """Monotonic time the turn was sent."""
    seconds: float
    ttft_s: float | None
    router: str | None
    worker: str | None
    route: str | None
    restore_hint: bool
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    resumptions: tuple[Resumption, ...] = ()
    retries: tuple[Retry, ...] = ()


def _transport_errors() -> tuple[type[BaseException], ...]:
    """A failed connection, as the openai client raises it before the answer starts (wrapped)
    and while a stream is read (httpx's own)."""
    import openai

    return (httpx.TransportError, openai.APIConnectionError)


@dataclass
class ChaosSession:
    """One conversation (one session id) through a `RouterPool`, streamed, greedy."""

    pool: RouterPool
    session_id: str
    system: str
    model: str = "tiny"
    timeout_s: float = 120.0
    seed: int = 0
    history: list[Message] = field(default_factory=list)
    _taps: dict[str, _TimedTap] = field(init=False, default_factory=dict)
    _clients: dict[str, Any] = field(init=False, default_factory=dict)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        import openai

        self._rng = random.Random(f"{self.seed}:{self.session_id}")
        for url in self.pool.urls:
            tap = _TimedTap()
            self._taps[url] = tap
            # An httpx client: recent openai releases (built on `httpx2`) accept one as well.
            http_client: Any = httpx.Client(transport=tap)
            self._clients[url] = openai.OpenAI(
                base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=self.timeout_s,
                http_client=http_client)
        if not self.history:
            self.history.append({"role": "system", "content": self.system})

    def ask(self, index: int, user: str, max_tokens: int,
            on_chunk: Callable[[str | None, int], None] | None = None) -> TurnRecord:
        """Stream the answer to `user`, retrying on another router while connections fail
        (until `timeout_s`); on success both messages join the history."""
        messages = [*self.history, {"role": "user", "content": user}]
        started = time.monotonic()
        retries: list[Retry] = []
        failed_at: float | None = None
        while True:
            for url in self.pool.order(self._rng):
                outcome = self._stream(url, messages, max_tokens, on_chunk)
                if isinstance(outcome, _Broken):
                    self.pool.mark_down(url)
                    retries.append(Retry(url, outcome.error))
                    failed_at = time.monotonic()
                    if time.monotonic() - started < self.timeout_s:
                        continue
                    outcome = _Done(error=f"every router failed for {self.timeout_s:.0f}s: "
                                          f"{outcome.error}")
                if failed_at is not None and retries and outcome.first_token_at is not None:
                    retries[-1] = Retry(retries[-1].router, retries[-1].error,
                                        outcome.first_token_at - failed_at)
                record = self._record(index, url, started, outcome, retries)
                if record.error is None:
                    self.history.extend([{"role": "user", "content": user},
                                         {"role": "assistant", "content": record.text}])
                return record
            time.sleep(0.3)  # every replica failed just now: wait as a client would

    def close(self) -> None:
        for client in self._clients.values():
            client.close()

    def _stream(self, url: str, messages: list[Message], max_tokens: int,
                on_chunk: Callable[[str | None, int], None] | None) -> _Done | _Broken:
        tap = self._taps[url]
        done = _Done()
        pieces: list[str] = []
        sent = time.monotonic()
        try:
            stream = self._clients[url].chat.completions.create(
                model=self.model, messages=messages, max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_headers={"X-Session-Id": self.session_id},
                extra_body={"ignore_eos": True})
            for chunk in stream:
                now = time.monotonic()
                for choice in chunk.choices:
                    if choice.delta.content:
                        pieces.append(choice.delta.content)
                        done.token_times.append(now)
                        if done.first_token_at is None:
                            done.first_token_at = now
                done.usage = chunk.usage or done.usage
                if on_chunk is not None and chunk.choices:
                    on_chunk(tap.headers.get("x-kvkeep-worker"), len(pieces))
        except _transport_errors() as exc:
            return _Broken(f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # an HTTP error or an error event: the client's answer
            done.error = f"{type(exc).__name__}: {exc}"
        done.text = "".join(pieces)
        done.sent_at = sent
        done.headers = dict(tap.headers)
        done.notes = list(tap.notes)
        return done

    def _record(self, index: int, url: str, started: float, done: _Done,
                retries: list[Retry]) -> TurnRecord:
        usage = done.usage
        details = getattr(usage, "prompt_tokens_details", None)
        h = done.headers
        return TurnRecord(
            session_id=self.session_id, index=index, text=done.text, error=done.error,
            started_s=started, seconds=time.monotonic() - started,
            ttft_s=None if done.first_token_at is None else done.first_token_at - done.sent_at,
            router=url, worker=h.get("x-kvkeep-worker"), route=h.get("x-kvkeep-route"),
            restore_hint=h.get("x-kvkeep-restore") == "1",
            prompt_tokens=getattr(usage, "prompt_tokens", None),
            cached_tokens=getattr(details, "cached_tokens", None),
            completion_tokens=getattr(usage, "completion_tokens", None),
            resumptions=tuple(_resumptions(done)), retries=tuple(retries))


@dataclass
class _Done:
    text: str = ""
    error: str | None = None
    sent_at: float = 0.0
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    usage: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    notes: list[tuple[float, dict[str, Any]]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Broken:
    error: str


def _resumptions(done: _Done) -> Iterator[Resumption]:
    for at, note in done.notes:
        if "resumed_on" not in note or "after_tokens" not in note:
            continue
        before = [t for t in done.token_times if t <= at]
        after = [t for t in done.token_times if t > at]
        gap = after[0] - before[-1] if before and after else None
        yield Resumption(str(note["resumed_on"]), int(note["after_tokens"]), gap)
