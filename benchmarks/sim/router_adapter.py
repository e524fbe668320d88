"""The simulator's only contact with the router: the router's own objects, driven in simulated
time.

Every routing decision is the router's code: `RouterService.route_request` (text-chunk keys,
token-block keys, the session's remembered blocks), `RouterService.place` (the session rules,
migration cooldown and compare-and-swap binding on the in-process backend),
`Scheduler.decide` / `commit` (filters, scorers, picker, optimistic charging), `WorkerPool`
(scraped load, releases, failures), `KVEventSubscriber.handle` (vLLM's msgpack KV-event batches
into the `KVBlockIndex`), `Registry.delete_worker` and `Rebinder.rebind` (a dead worker's
sessions moved with a restore hint). Policies come from `router.policy.build_policy` with the
weights and thresholds of `policies.toml`.

What this module adds is the glue the HTTP proxy does (`Proxy._place`, `_release`, `_failed`)
and the clock: the router reads wall time directly in two places that matter here
(`router/service.py` `place`: `time.time()` for the migration cooldown;
`router/workers.py` `record_failure`: `time.monotonic()` for suspect windows), so while a
simulation runs those modules' `time` is a shim that answers simulated time. When the router
exposes an injectable clock, `simulated_time` goes and nothing else changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np

import router.service as _service_module
import router.workers as _workers_module
from kvstore.errors import ConfigError
from router.api import Endpoint, parse_request
from router.config import RouterConfig
from router.context import DecisionContext
from router.errors import RouterError
from router.indexer.keys import TEXT_CHUNK_CHARS, text_prefix_keys
from router.indexer.subscriber import KVEventSubscriber
from router.policy import Thresholds, build_policy
from router.registry import Registry
from router.scheduler import Scheduler
from router.scorers import SCORERS
from router.service import Placement, RouterService
from router.workers import WorkerId, WorkerInfo, WorkerLoad

__all__ = ["PolicySpec", "load_policies", "DEFAULT_POLICIES", "SimRouter", "Routed",
           "RouteRefused", "simulated_time", "RouterInput"]

DEFAULT_POLICIES = Path(__file__).with_name("policies.toml")


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """One simulated policy: a router policy, its overrides and what the router is shown."""

    name: str
    router_policy: str
    weights: Mapping[str, float] = field(default_factory=dict)
    thresholds: Mapping[str, float] = field(default_factory=dict)
    input: str = "text"
    store: bool = False
    sessions: bool = True
    approx_chunk_chars: int = TEXT_CHUNK_CHARS
    approx_max_chunks: int | None = None
    approx_lru_per_server: int | None = None
    group: str = "main"
    store_events: bool = True  # the connector announces checkpointed blocks as KV events
    # False: the policy's soft filters removed (the proposed router change: when no worker
    # passes them, the scheduler ranks by least utilisation and ignores every score; the
    # thresholds cannot express "off", since KV usage reaches 1.0 at saturation)
    soft_filters: bool = True

    def __post_init__(self) -> None:
        if self.input not in ("text", "tokens"):
            raise ValueError(f"policy {self.name}: input must be 'text' or 'tokens'")
        # build_policy itself raises a bare KeyError on an unknown scorer (only the command
        # line's parse_weights checks names): check with the router's own table
        unknown = set(self.weights) - set(SCORERS)
        if unknown:
            raise ConfigError(f"policy {self.name}: unknown scorers {sorted(unknown)}; "
                              f"known: {sorted(SCORERS)}")
        build_policy(self.router_policy, weights=self.weights,
                     thresholds=self.router_thresholds())  # fails early on a bad name

    def router_thresholds(self) -> Thresholds:
        """The router's `Thresholds` with this policy's overrides (TOML numbers to the field
        types: counts stay integers)."""
        defaults = Thresholds()
        values: dict[str, Any] = {}
        for name, value in self.thresholds.items():
            current = getattr(defaults, name)
            values[name] = int(value) if isinstance(current, int) else float(value)
        return Thresholds(**values)

    @property
    def uses_kv_events(self) -> bool:
        policy = build_policy(self.router_policy, weights=self.weights)
        return any(s.name in ("precise-prefix", "best-prefix") for s, _ in policy.scorers)

    def with_weights(self, **weights: float) -> PolicySpec:
        return dataclasses.replace(self, weights={**self.weights, **weights})


def load_policies(path: Path = DEFAULT_POLICIES) -> dict[str, PolicySpec]:
    with path.open("rb") as f:
        raw = tomllib.load(f)
    return {name: PolicySpec(name=name, **body) for name, body in raw.items()}


@dataclass(frozen=True, slots=True)
class RouterInput:
    """A request as a client sends it: the prompt as text and as token ids (which the router
    is given depends on the policy's `input`), the output budget, the session."""

    key: object  # equal keys: equal prompts (the parsed request is reused)
    text: str
    tokens: Sequence[int] | np.ndarray[Any, Any]
    max_tokens: int
    session: str | None


@dataclass(frozen=True, slots=True)
class Routed:
    """Where the router sent a request, and why."""

    worker: str
    reason: str
    restore_from: str | None
    placement: Placement = field(repr=False)


class RouteRefused(Exception):
    """The router answered with an error (503 no worker, 429 saturated)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Clock:
    """Stands in for the `time` module inside router modules that read the wall clock."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.time = now
        self.monotonic = now
        self.perf_counter = time.perf_counter


@contextlib.contextmanager
def simulated_time(now: Callable[[], float]) -> Iterator[None]:
    modules = (_service_module, _workers_module)
    attr = "time"  # each module's `import time`
    saved = [getattr(m, attr) for m in modules]
    shim = _Clock(now)
    for m in modules:
        setattr(m, attr, shim)
    try:
        yield
    finally:
        for m, t in zip(modules, saved, strict=True):
            setattr(m, attr, t)


class SimRouter:
    """One router replica running `spec` over `workers`, in simulated time `now`."""

    def __init__(self, spec: PolicySpec, workers: Sequence[str], *, model: str,
                 block_size: int, now: Callable[[], float], seed: int = 0) -> None:
        self.spec = spec
        self.model = model
        thresholds = spec.router_thresholds()
        config = RouterConfig(policy=spec.router_policy, weights=tuple(spec.weights.items()),
                              thresholds=thresholds, block_size=block_size)
        svc = RouterService(config)
        svc.backend.clock = now  # type: ignore[attr-defined]
        svc.sessions.clock = now
        policy = build_policy(config.policy, weights=dict(config.weights),
                              thresholds=thresholds, rng=random.Random(seed))
        if not spec.soft_filters:
            policy = dataclasses.replace(policy, soft_filters=())
        svc.scheduler = Scheduler(svc.pool, policy, history=svc.history, blocks=svc.blocks,
                                  clock=now)
        svc.rebinder.scheduler = svc.scheduler
        if spec.approx_lru_per_server is not None:
            svc.history.capacity = spec.approx_lru_per_server * len(workers)
        self.service = svc
        self.subscriber = KVEventSubscriber(svc.blocks)
        self._gone: list[WorkerId] = []
        self.registry = Registry(svc.pool, self._gone.append, self.subscriber, svc.history)
        for w in workers:
            self.registry.put_worker(WorkerInfo(WorkerId(w), f"http://{w}", (model,)))
        self._loop = asyncio.new_event_loop()
        self._parsed: dict[object, Any] = {}
        self._seq: dict[str, int] = {}
        self.uses_kv_events = spec.uses_kv_events
        self.decisions: dict[str, int] = {}

    def close(self) -> None:
        self._loop.close()
        self.subscriber._ctx.term()

    # --- requests ---------------------------------------------------------------------------
    def place(self, req: RouterInput, tried: frozenset[str] = frozenset()) -> Routed:
        """`Proxy._place`: route, decide and bind, commit the pick."""
        svc = self.service
        creq = self._parse(req)
        route = svc.route_request(creq, frozenset(WorkerId(w) for w in tried))
        if self.spec.approx_max_chunks is not None or \
                self.spec.approx_chunk_chars != TEXT_CHUNK_CHARS:
            limit = self.spec.approx_max_chunks or 512
            route = dataclasses.replace(route, prefix_keys=text_prefix_keys(
                creq.prompt_text, self.spec.approx_chunk_chars, limit))
        self._count_soft_fallback(route)
        try:
            placement = self._loop.run_until_complete(svc.place(creq, route))
        except RouterError as exc:
            raise RouteRefused(exc.status, str(exc)) from exc
        svc.scheduler.commit(route, placement.decision)
        label = placement.label
        self.decisions[label] = self.decisions.get(label, 0) + 1
        restore = placement.restore_from
        return Routed(placement.worker, label, restore, placement)

    def release(self, routed: Routed) -> None:
        """`Proxy._release`: the request ended (done, failed or moved)."""
        p = routed.placement
        self.service.pool.release(p.worker, p.route.tokens)

    def failed(self, routed: Routed, *, hard: bool) -> None:
        """`Proxy._failed`: the worker failed this request (connection refused, broken
        stream)."""
        self.release(routed)
        self.service.pool.record_failure(routed.placement.worker, hard=hard)

    def succeeded(self, routed: Routed, prompt: Sequence[int], output: Sequence[int]) -> None:
        """A stream ended with [DONE]: remember the session's tokens, settle the binding."""
        svc = self.service
        self.release(routed)
        svc.pool.record_success(routed.placement.worker)
        session = routed.placement.route.session_id
        if session is None:
            return
        svc.remember_tokens(session, list(prompt), list(output))
        self._loop.run_until_complete(self._settle(routed.placement))

    async def _settle(self, placement: Placement) -> None:
        svc = self.service
        svc.settle(placement)
        pending = list(svc._background)
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    # --- what the router learns from the workers ---------------------------------------------
    def scraped(self, worker: str, running: int, waiting: int, kv_usage: float,
                now: float) -> None:
        self.service.pool.update_load(WorkerId(worker), WorkerLoad(running, waiting,
                                                                   kv_usage, now))

    def kv_events(self, worker: str, events: list[dict[str, Any]], now: float) -> None:
        """One batch of a worker's KV events, as vLLM's ZMQ publisher frames it."""
        seq = self._seq.get(worker, -1) + 1
        self._seq[worker] = seq
        payload = msgpack.packb([now, events, 0])
        self.subscriber.handle(WorkerId(worker), [b"kv", seq.to_bytes(8, "big", signed=True),
                                                  payload])

    def worker_gone(self, worker: str) -> int:
        """The worker's lease expired: the registry forgets it and its sessions are rebound
        (with a restore hint). Returns how many sessions moved."""
        wid = WorkerId(worker)
        self.registry.delete_worker(wid)
        moved = 0
        while self._gone:
            gone = self._gone.pop()
            moved += self._loop.run_until_complete(self.service.rebinder.rebind(gone))
        return moved

    def bound_sessions(self, worker: str) -> list[str]:
        return [str(s) for s in self.service.sessions.bound_to(WorkerId(worker))]

    @property
    def index_blocks(self) -> int:
        return len(self.service.blocks)

    # --- private -----------------------------------------------------------------------------
    def _count_soft_fallback(self, route: Any) -> None:
        """Diagnostics only (decides nothing): would the policy's own soft filters leave no
        usable worker for this request, so that the scheduler ranks by least utilisation and
        ignores every score? Counted as `soft_filter_fallback`."""
        svc = self.service
        policy = svc.scheduler.policy
        if not policy.soft_filters or route.session_id is not None:
            return
        ctx = DecisionContext(route, svc.scheduler._clock())
        kept = [w for w in svc.pool.states() if w.usable(ctx.now)]
        for soft in policy.soft_filters:
            kept = soft.apply(ctx, kept)
        if not kept:
            self.decisions["soft_filter_fallback"] = \
                self.decisions.get("soft_filter_fallback", 0) + 1

    def _parse(self, req: RouterInput) -> Any:
        session = req.session if self.spec.sessions else None
        cache_key = (req.key, session, req.max_tokens)
        creq = self._parsed.get(cache_key)
        if creq is not None:
            return creq
        tokens = req.tokens
        prompt: Any = req.text if self.spec.input == "text" else (
            tokens.tolist() if hasattr(tokens, "tolist") else list(tokens))
        body = {"model": self.model, "prompt": prompt, "max_tokens": req.max_tokens,
                "stream": True, "ignore_eos": True}
        creq = parse_request(Endpoint.COMPLETIONS, json.dumps(body).encode(), session)
        if req.key is not None:
            if len(self._parsed) > 4096:
                self._parsed.clear()
            self._parsed[cache_key] = creq
        return creq
