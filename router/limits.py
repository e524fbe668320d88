"""The router's bounds: what one replica holds in memory, what it accepts from a worker, and how
many sessions a tenant (and everyone together) may open.

Every structure that grows with traffic has a cap here, so a flood of new sessions, prompts or
KV events, or a hostile worker, costs the router at most what these say:

- sessions: `max_sessions` bindings in all and `max_sessions_per_tenant` per API-key tenant
  (counted over the bindings every replica shares, plus this replica's not yet accepted ones);
  a new session past either is a 429 that says which limit it hit. Unset, a tenant may hold a
  tenth of `max_sessions` (`TENANT_SHARE`), so one tenant opening sessions until the total is
  reached cannot lock every other tenant out of new ones (trust-review M10); a router without
  API keys has one tenant, whose cap is the total (`kvkeep router serve` sets that);
- the prefix indexes: `kv_blocks_per_worker` entries per worker from its KV events (about
  300 B each), `shared_kv_blocks` for a shared store's blocks, `history_keys` prefix keys of
  routing history, `session_block_keys` token-block keys of sessions' last turns in all;
- a worker's KV-event stream: `kv_event_bytes_per_s` and `kv_event_blocks_per_s` per worker
  (with `kv_event_burst_s` of slack), `kv_event_max_message_bytes` per ZMQ message; what is
  over is dropped and counted, and the index under-reports (a weaker prefix score, never a
  wrong answer);
- what a worker sends back: `max_response_bytes` for a non-streaming answer (and any error
  body), `max_event_bytes` for one SSE event of a stream (the first carries the prompt's token
  ids: 16 MiB is some 2M tokens), `max_stream_tokens` token ids per choice of a stream when
  the request does not bound them itself. What the client sized is the client's (trust review
  H1): a 2xx answer over `max_response_bytes` is its 413, a stream past `max_stream_tokens`
  ends with a 413 error event, and neither counts against the worker. A worker past the
  others (an error body, one SSE event) has failed the request: it is tried elsewhere or the
  stream resumed elsewhere, and the failure is counted.

`Limits()` is what a replica runs with unless configured (the `limits:` section of the config
file, `--max-sessions`, `--max-sessions-per-tenant`); the router core takes the same object.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import aiohttp

from kvstore.errors import ConfigError
from router.errors import UpstreamTooLarge

__all__ = ["Limits", "TokenBucket", "read_capped", "METRICS_MAX_BYTES", "MODELS_MAX_BYTES",
           "TENANT_SHARE", "TOKENIZE_MAX_BYTES"]

METRICS_MAX_BYTES = 4 << 20
"""A worker's `/metrics` page (vLLM's is some tens of KiB)."""
MODELS_MAX_BYTES = 1 << 20
"""A worker's `/v1/models` answer."""
TOKENIZE_MAX_BYTES = 16 << 20
"""A worker's `/tokenize` answer (some 2M token ids: more than any context)."""
TENANT_SHARE = 10
"""Without `max_sessions_per_tenant`, a tenant may hold `max_sessions // TENANT_SHARE`."""


@dataclass(frozen=True, slots=True)
class Limits:
    """See the module docstring. `max_sessions_per_tenant` None: a tenth of `max_sessions`
    (at least 1)."""

    max_sessions: int = 1_000_000
    max_sessions_per_tenant: int | None = None
    max_workers: int = 1024
    kv_blocks_per_worker: int = 262_144
    shared_kv_blocks: int = 1_000_000
    history_keys: int = 1_000_000
    session_block_keys: int = 4_000_000
    kv_event_bytes_per_s: int = 8 << 20
    kv_event_blocks_per_s: int = 50_000
    kv_event_burst_s: float = 2.0
    kv_event_max_message_bytes: int = 16 << 20
    max_response_bytes: int = 64 << 20
    max_event_bytes: int = 16 << 20
    max_stream_tokens: int = 1 << 20

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value <= 0:
                raise ConfigError(f"{f.name} must be > 0, not {value}")
        if self.max_event_bytes < 1024 or self.max_response_bytes < 1024:
            raise ConfigError("max_event_bytes and max_response_bytes must be >= 1024")

    @property
    def sessions_per_tenant(self) -> int:
        if self.max_sessions_per_tenant is None:
            return max(1, self.max_sessions // TENANT_SHARE)
        return min(self.max_sessions_per_tenant, self.max_sessions)


@dataclass(slots=True)
class TokenBucket:
    """`rate` units per second with `burst` units of slack: `take(n)` is False (and takes
    nothing) when `n` would overdraw it. One per worker and per budget."""

    rate: float
    burst: float
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _level: float = -1.0
    _at: float = 0.0

    def take(self, n: float) -> bool:
        now = self.clock()
        if self._level < 0:
            self._level, self._at = self.burst, now
        self._level = min(self.burst, self._level + (now - self._at) * self.rate)
        self._at = now
        if n > self._level:
            return False
        self._level -= n
        return True


async def read_capped(resp: aiohttp.ClientResponse, limit: int, what: str) -> bytes:
    """The whole body of `resp`, or `UpstreamTooLarge` as soon as it passes `limit` bytes
    (a declared Content-Length over it fails before anything is read)."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise UpstreamTooLarge(f"{what} declares {declared} bytes, over the {limit} limit")
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(64 << 10):
        size += len(chunk)
        if size > limit:
            raise UpstreamTooLarge(f"{what} is over the {limit}-byte limit")
        parts.append(chunk)
    return b"".join(parts)
