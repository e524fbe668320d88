"""Stop strings across a resumed stream: the router holds text back and finds stops itself.

vLLM, streaming a request with `stop` strings, holds back the last `max(len(stop)) - 1`
characters of its text (they could be the start of a stop string) and drops a stop string it
finds. When such a stream breaks, the held-back text dies with the worker, and the worker that
continues from the token ids never sees the text before the break, so a stop string spanning
the break goes unnoticed. So for a resumable stream with stop strings the router asks workers
for `include_stop_str_in_output` (nothing held back, a found stop string kept in the text) and
does vLLM's part itself, across workers:

- it holds back the same number of characters vLLM would, so the client sees what an unbroken
  vLLM stream sends;
- it looks for the stop strings in the whole text, the part before the break included, with
  vLLM's rule (the stop that completes first wins, ties by list order; none before
  `min_tokens` tokens), and when it finds one that the worker could not see, it ends the
  stream there (`finish_reason` "stop", `stop_reason` the string) and closes the worker's;
- at the end it drops the stop string, unless the client asked for it
  (`include_stop_str_in_output`).

Token ids are counted per chunk: a stop found inside a chunk of several tokens keeps them all.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["stop_strings", "StopText", "Emitted"]


def stop_strings(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The request's stop strings (vLLM's `stop`: a string or a list of them); empty when
    none, or when the field is malformed (the worker's to refuse)."""
    stop = body.get("stop")
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    return ()


@dataclass(frozen=True, slots=True)
class Emitted:
    """What to send the client of one worker chunk: its text, and the stop string the router
    found (the stream ends there), if any."""

    text: str
    stop: str | None = None


@dataclass(slots=True)
class StopText:
    """The router's view of a stream's text for its stop strings (see the module docstring).
    `include`: the client wants a found stop string in its text."""

    stops: tuple[str, ...]
    include: bool = False
    min_tokens: int = 0
    _text: str = ""
    """The generated text the router has seen and not yet sent, plus the sent tail it still
    needs for a stop string that spans the next chunk (at most the longest stop's length)."""
    _unsent: int = 0
    """How many characters at the end of `_text` the client has not been sent."""
    _tokens: int = 0
    _longest: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._longest = max((len(s) for s in self.stops), default=0)

    @property
    def hold(self) -> int:
        """Characters held back while the stream runs (vLLM's `stop_buffer_length`)."""
        return 0 if self.include or not self.stops else self._longest - 1

    def feed(self, text: str, tokens: int) -> Emitted:
        """One chunk's text (the worker holds nothing back) and its token count."""
        # vLLM looks only once more than `min_tokens` tokens exist (from the min_tokens-th
        # token's text on; here from the start of the chunk that passes it).
        checked_from = len(self._text) if self._tokens + tokens > self.min_tokens else None
        self._tokens += tokens
        self._text += text
        self._unsent += len(text)
        if checked_from is not None and text:
            found = self._find(checked_from)
            if found is not None:
                return self._stop_at(*found)
        return Emitted(self._take(self._unsent - self.hold))

    def finish(self, stop_reason: object) -> str:
        """The worker ended the stream itself: the text still held back, without the stop
        string the worker reports it found (`stop_reason`), unless the client wants it."""
        tail = self._text[len(self._text) - self._unsent:] if self._unsent else ""
        self._unsent = 0
        if isinstance(stop_reason, str) and stop_reason and not self.include \
                and tail.endswith(stop_reason) and stop_reason in self.stops:
            tail = tail[:-len(stop_reason)]
        return tail

    def _find(self, checked_from: int) -> tuple[str, int] | None:
        """vLLM's `check_stop_strings` over the text added since `checked_from`: the stop
        string that completes first (ties: list order) and where it starts."""
        best: tuple[str, int] | None = None
        best_end = sys.maxsize
        for stop in self.stops:
            start = self._text.find(stop, max(0, checked_from - len(stop) + 1))
            if start != -1 and start + len(stop) < best_end:
                best, best_end = (stop, start), start + len(stop)
        return best

    def _stop_at(self, stop: str, start: int) -> Emitted:
        end = start + len(stop) if self.include else start
        sent_before = len(self._text) - self._unsent
        out = self._text[sent_before:end] if end > sent_before else ""
        self._unsent = 0
        self._text = self._text[:end]
        return Emitted(out, stop)

    def _take(self, n: int) -> str:
        if n <= 0:
            return ""
        start = len(self._text) - self._unsent
        out = self._text[start:start + n]
        self._unsent -= n
        # Keep only what a stop string spanning the next chunk can still reach.
        cut = max(0, len(self._text) - self._unsent - self._longest)
        if cut > 4096:
            self._text = self._text[cut:]
        return out
