"""The daemons a remote tier talks to, and how it talks to them.

One `DaemonClient` and one circuit breaker per daemon, kept in step with discovery; every call
guarded (the breaker hears transport failures only, a refusal is an answer), transient write
failures retried within a deadline, calls to several daemons fanned out in parallel, background
jobs (ack=one copies, repairs) tracked until flushed, and the tier's counters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from kvstore.cluster.discovery import DaemonInfo
from kvstore.errors import DeadlineExceeded, KVKeepError, TierUnavailable
from kvstore.net.daemon_client import DaemonClient
from kvstore.tiers.remote.config import RemoteConfig
from kvstore.tiers.remote.resilience import CircuitBreaker

__all__ = ["Peer", "PeerSet", "call_timeout"]

_log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")
# Retired clients kept open before closing the oldest: another thread may be mid-call on one.
_RETIRED_KEPT = 16


def call_timeout(deadline: float, cap: float) -> float:
    """The time one call may take: what is left of `deadline`, at most `cap`."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceeded("remote call deadline passed")
    return min(remaining, cap)


@dataclass(slots=True)
class Peer:
    info: DaemonInfo
    client: DaemonClient
    breaker: CircuitBreaker


class PeerSet:
    """The registered daemons, their breakers, the fan-out pool and the counters. Thread-safe."""

    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self._retired: list[DaemonClient] = []
        self._pool = ThreadPoolExecutor(config.fanout_threads, thread_name_prefix="kvkeep-remote")
        self._background: set[Future[None]] = set()
        self._counts: dict[str, int] = defaultdict(int)
        self._closed = False

    # -- membership ---------------------------------------------------------------------------

    def on_members(self, members: Mapping[str, DaemonInfo]) -> None:
        """Discovery's callback: open clients for new daemons, retire those that left."""
        cfg = self.config
        with self._lock:
            if self._closed:
                return
            for node in list(self._peers):
                peer = self._peers[node]
                if node not in members or members[node].address != peer.info.address:
                    # Closed later: another thread may be mid-call on this channel.
                    self._retired.append(self._peers.pop(node).client)
                elif members[node].started_at != peer.info.started_at:
                    peer.info = members[node]
                    peer.breaker.reset()  # a restarted daemon deserves a fresh try
                    # ... and may listen on another data port.
                    peer.client.set_data_address(members[node].data_address or None)
            for node, info in members.items():
                if node not in self._peers:
                    self._peers[node] = Peer(
                        info, DaemonClient(node, info.address, token=cfg.token, tls=cfg.tls,
                                           data_address=info.data_address or None,
                                           data_plane=cfg.data_plane),
                        CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown,
                                       cfg.breaker_max_cooldown))
            excess = max(len(self._retired) - _RETIRED_KEPT, 0)
            retired, self._retired = self._retired[:excess], self._retired[excess:]
        for client in retired:
            client.close()

    def members(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    def peers(self) -> list[tuple[str, Peer]]:
        with self._lock:
            return list(self._peers.items())

    def peer(self, node: str) -> Peer | None:
        with self._lock:
            return self._peers.get(node)

    def usable(self, node: str) -> bool:
        """Registered and not behind an open breaker (does not consume a half-open probe)."""
        peer = self.peer(node)
        return peer is not None and peer.breaker.state != "open"

    def allow(self, peer: Peer) -> bool:
        """Whether a call to `peer` may go now (this may take a half-open breaker's probe)."""
        if peer.breaker.allow():
            return True
        self.count("skipped")
        return False

    def checked(self, node: str) -> Peer:
        """The daemon `node`, or TierUnavailable if it left or its breaker is open."""
        peer = self.peer(node)
        if peer is None:
            raise TierUnavailable(f"daemon {node} left")
        if not self.allow(peer):
            raise TierUnavailable(f"daemon {node} is behind an open circuit breaker")
        return peer

    def failed(self, peer: Peer, exc: KVKeepError) -> None:
        peer.breaker.record_failure()
        self.count("errors")
        _log.info("daemon %s failed: %s", peer.info.node_id, exc)

    # -- calls --------------------------------------------------------------------------------

    def guard(self, peer: Peer, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """One call; feeds the breaker (transport failures only) and translates nothing.
        A refusal (a full disk, a spent budget, a bad request) is an answer: the daemon is
        well, and a half-open breaker's probe must not stay pending on it."""
        try:
            result = fn(*args, **kwargs)
        except (TierUnavailable, DeadlineExceeded) as exc:
            self.failed(peer, exc)
            raise
        except KVKeepError:
            peer.breaker.record_success()
            raise
        peer.breaker.record_success()
        return result

    def with_retry(self, peer: Peer, deadline: float, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args, timeout=...)`, retrying transient failures per the RetryPolicy within the
        deadline (which the caller sized to the work); the breaker hears only the outcome."""
        delays = self.config.retry.delays()
        while True:
            timeout = call_timeout(deadline, deadline - time.monotonic())
            try:
                result = fn(*args, timeout=timeout)
            except TierUnavailable as exc:
                delay = next(delays, None)
                if delay is None or not self.config.retry.sleep_within(delay, deadline):
                    self.failed(peer, exc)
                    raise
                continue
            except DeadlineExceeded as exc:
                self.failed(peer, exc)
                raise
            except KVKeepError:  # a refusal (TierFull: disk full, budget): not retried here
                peer.breaker.record_success()
                raise
            peer.breaker.record_success()
            return result

    def fanout(self, calls: Mapping[str, Callable[[], T]]) -> dict[str, T | KVKeepError]:
        """Run one call per daemon in parallel; a failure becomes that daemon's result."""
        if not calls:
            return {}
        if len(calls) == 1:  # no thread hop for the common single-daemon case
            ((node, call),) = calls.items()
            return {node: capture(call)}
        futures = {node: self._pool.submit(capture, call) for node, call in calls.items()}
        return {node: fut.result() for node, fut in futures.items()}

    # -- background work ----------------------------------------------------------------------

    def submit(self, fn: Callable[..., None], *args: object) -> None:
        """Run `fn(*args)` on the pool; `flush` waits for it. Failures are logged."""
        with self._lock:
            if self._closed:
                return
            try:
                fut = self._pool.submit(_run_background, fn, *args)
            except RuntimeError:  # pool shut down concurrently
                return
            self._background.add(fut)
        fut.add_done_callback(self._background_done)

    def _background_done(self, fut: Future[None]) -> None:
        with self._lock:
            self._background.discard(fut)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for background writes (ack=one copies, read repairs); False on timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._background)
            if not pending:
                return True
            for fut in pending:
                remaining = None if end is None else max(end - time.monotonic(), 0.0)
                try:
                    fut.result(remaining)
                except TimeoutError:
                    return False
                except Exception:  # logged by the job itself
                    pass

    # -- counters and lifecycle ---------------------------------------------------------------

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def mark_closed(self) -> bool:
        """Refuse new members and background jobs; False if already closed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def shutdown(self) -> None:
        """Stop the pool and close every client (after `mark_closed` and a flush)."""
        self._pool.shutdown(wait=True)
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
            retired, self._retired = self._retired, []
        for peer in peers:
            peer.client.close()
        for client in retired:
            client.close()


def capture(call: Callable[[], T]) -> T | KVKeepError:
    """`call()`, with a KVKeepError returned instead of raised."""
    try:
        return call()
    except KVKeepError as exc:
        return exc


def _run_background(fn: Callable[..., None], *args: object) -> None:
    try:
        fn(*args)
    except KVKeepError as exc:
        _log.info("background remote write failed: %s", exc)
    except Exception:
        _log.exception("background remote write crashed")
