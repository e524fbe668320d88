"""The simulator's only contact with the router: its core (`router.core.RouterCore`), driven in
simulated time.

Every routing decision is the router's code: `RouterCore.route` (text-chunk keys, token-block
keys, a session's remembered blocks), `RouterCore.place_now` (the session rules, migration
cooldown and compare-and-swap binding on the in-memory backend, then the pre-request hooks:
optimistic charging, routing history), `RouterCore.finish` (release, the session's tokens, the
restore hint settled), `set_load` (scraped metrics), `apply_kv_events` (vLLM's KV-event maps
into the `KVBlockIndex`), `remove_worker` (lease expired: caches forgotten, sessions rebound
with a restore hint), `WorkerPool.record_failure` (a broken stream or refused connection).
Policies are the router's presets (`router.policy.policy_preset`) with the weights, thresholds
and soft filters of `policies.toml`; the core's clock is the simulation's.

What this module adds is the glue the HTTP front does (`router/front/dispatch.py`: place, finish
once per attempt, mark a failed worker) and the translation from the simulator's requests to
`RequestFeatures`.
"""

from __future__ import annotations

import dataclasses
import random
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.keys import SessionId
from router.context import DecisionContext
from router.core import RouterCore
from router.decision import Placement, RequestFeatures, RouteRequest
from router.errors import RouterError
from router.hooks import FAILED, Outcome
from router.indexer.keys import TEXT_CHUNK_CHARS, text_prefix_keys
from router.membership.workers import WorkerId, WorkerInfo
from router.policy import Policy, PolicySpec, Thresholds, policy_preset
from router.tokenize.cache import TokenCache

__all__ = ["SimPolicy", "load_policies", "DEFAULT_POLICIES", "SimRouter", "Routed",
           "RouteRefused", "RouterInput"]

DEFAULT_POLICIES = Path(__file__).with_name("policies.toml")


@dataclass(frozen=True, slots=True)
class SimPolicy:
    """One simulated policy: a router policy, its overrides and what the router is shown."""

    name: str
    router_policy: str
    weights: Mapping[str, float] = field(default_factory=dict)
    # a scorer's own parameters by scorer name, e.g. {"precise-prefix": {"storage_weight": 0.2}}
    scorer_parameters: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    thresholds: Mapping[str, float] = field(default_factory=dict)
    input: str = "text"
    store: bool = False
    sessions: bool = True
    approx_chunk_chars: int = TEXT_CHUNK_CHARS
    approx_max_chunks: int | None = None
    approx_lru_per_server: int | None = None
    group: str = "main"
    # overrides of the policy's `tokenize` settings (router/tokenize/prompts.py),
    # e.g. {mode = "off"}
    tokenize: Mapping[str, Any] = field(default_factory=dict)
    store_events: bool = True  # the connector announces checkpointed blocks as KV events
    # False: the policy's soft filters removed (the proposed router change: when no worker
    # passes them, the scheduler ranks by least utilisation and ignores every score; the
    # thresholds cannot express "off", since KV usage reaches 1.0 at saturation)
    soft_filters: bool = True
    # the policy's soft filters replaced (router filter names), for every placement and for
    # session placements
    filters: Sequence[str] | None = None
    session_filters: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if self.input not in ("text", "tokens"):
            raise ValueError(f"policy {self.name}: input must be 'text' or 'tokens'")
        self.build()  # the router's own checks: unknown names, bad thresholds

    def router_thresholds(self) -> Thresholds:
        """The router's `Thresholds` with this policy's overrides (TOML numbers to the field
        types: counts stay integers)."""
        defaults = policy_preset(self.router_policy).thresholds
        values: dict[str, Any] = {}
        for name, value in self.thresholds.items():
            current = getattr(defaults, name)
            values[name] = int(value) if isinstance(current, int) else float(value)
        return dataclasses.replace(defaults, **values)

    def router_spec(self) -> PolicySpec:
        """The router's `PolicySpec` of this policy: its preset with this policy's weights,
        scorer parameters, thresholds, tokenize settings and filters."""
        spec = policy_preset(self.router_policy).with_weights(self.weights)
        if self.scorer_parameters:
            spec = dataclasses.replace(spec, scorers=tuple(
                dataclasses.replace(s, parameters=tuple(
                    {**dict(s.parameters), **self.scorer_parameters.get(s.name, {})}.items()))
                for s in spec.scorers))
        spec = dataclasses.replace(spec, thresholds=self.router_thresholds())
        if self.tokenize:
            spec = dataclasses.replace(spec, tokenize=dataclasses.replace(spec.tokenize,
                                                                          **self.tokenize))
        if self.filters is not None:
            spec = dataclasses.replace(spec, filters=tuple(self.filters))
        if self.session_filters is not None:
            spec = dataclasses.replace(spec, session_filters=tuple(self.session_filters))
        if not self.soft_filters:
            spec = dataclasses.replace(spec, filters=(), session_filters=())
        return spec

    def build(self, seed: int = 0) -> Policy:
        """The router's policy, built (its checks: unknown names, bad thresholds)."""
        return self.router_spec().build(random.Random(seed))

    @property
    def uses_kv_events(self) -> bool:
        return any(s.name in ("precise-prefix", "best-prefix") for s, _ in self.build().scorers)

    @property
    def router_tokenizes(self) -> bool:
        """Text prompts the router tokenizes itself (a worker's /tokenize round trip), as the
        router does when its policy matches token blocks and `tokenize.mode` is not off."""
        spec = self.router_spec()
        return self.input == "text" and spec.reads_token_blocks and spec.tokenize.enabled

    def with_weights(self, **weights: float) -> SimPolicy:
        return dataclasses.replace(self, weights={**self.weights, **weights})


def load_policies(path: Path = DEFAULT_POLICIES) -> dict[str, SimPolicy]:
    with path.open("rb") as f:
        raw = tomllib.load(f)
    return {name: SimPolicy(name=name, **body) for name, body in raw.items()}


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


class SimRouter:
    """One router replica running `spec` over `workers`, in simulated time `now`."""

    def __init__(self, spec: SimPolicy, workers: Sequence[str], *, model: str,
                 block_size: int, now: Callable[[], float], seed: int = 0,
                 tokenize_s: Callable[[int], float] = lambda tokens: 0.0) -> None:
        self.spec = spec
        self.model = model
        self.core = RouterCore(spec.build(seed), block_size=block_size, clock=now)
        # The router tokenizing text prompts: its own cache (router/tokenize/cache.py), and a
        # /tokenize round trip of `tokenize_s(tokens)` for a prompt it has not cached; a
        # prompt asked for again while its round trip runs waits for the same one.
        self.tokenizes = spec.router_tokenizes
        self.tokenize_s = tokenize_s
        self.token_cache = TokenCache(spec.router_spec().tokenize.cache_tokens)
        self._tokenized_at: dict[bytes, float] = {}
        if spec.approx_lru_per_server is not None:
            self.core.history.capacity = spec.approx_lru_per_server * len(workers)
        for w in workers:
            self.core.add_worker(WorkerInfo(WorkerId(w), f"http://{w}", (model,)))
        self.uses_kv_events = spec.uses_kv_events
        self.decisions: dict[str, int] = {}

    def close(self) -> None:
        """Nothing to release: the core holds no sockets or tasks."""

    # --- requests ---------------------------------------------------------------------------
    def tokenize_wait(self, req: RouterInput) -> float:
        """Seconds until the router can route `req`: the /tokenize round trip of a text
        prompt it tokenizes and has not cached (0 for anything else)."""
        if not self.tokenizes:
            return 0.0
        key = repr(req.key).encode()
        now = self.core.clock()
        ready = self._tokenized_at.get(key)
        if ready is not None:
            if ready > now:
                return ready - now  # its round trip is under way
            del self._tokenized_at[key]
        if self.token_cache.get(key) is not None:
            return 0.0
        tokens = route_tokens(req)
        self.token_cache.put(key, tokens)
        wait = self.tokenize_s(len(tokens))
        self._tokenized_at[key] = now + wait
        return wait

    def place(self, req: RouterInput, tried: frozenset[str] = frozenset()) -> Routed:
        """What the HTTP front does per attempt: route, place (decide, bind, hooks)."""
        core = self.core
        route = core.route(self._features(req), frozenset(WorkerId(w) for w in tried))
        if self.spec.approx_max_chunks is not None or \
                self.spec.approx_chunk_chars != TEXT_CHUNK_CHARS:
            limit = self.spec.approx_max_chunks or 512
            text = req.text if self.spec.input == "text" else " ".join(map(str, route_tokens(req)))
            route = dataclasses.replace(route, prefix_keys=text_prefix_keys(
                text, self.spec.approx_chunk_chars, limit))
        self._count_soft_fallback(route)
        try:
            placement = core.place_now(route)
        except RouterError as exc:
            raise RouteRefused(exc.status, str(exc)) from exc
        label = placement.label
        self.decisions[label] = self.decisions.get(label, 0) + 1
        return Routed(placement.worker, label, placement.restore_from, placement)

    def release(self, routed: Routed) -> None:
        """The attempt ended without an answer to keep (moved elsewhere)."""
        self.core.finish(routed.placement, FAILED)

    def failed(self, routed: Routed, *, hard: bool) -> None:
        """The worker failed this attempt (connection refused, broken stream)."""
        self.core.finish(routed.placement, FAILED)
        self.core.pool.record_failure(routed.placement.worker, hard=hard)

    def succeeded(self, routed: Routed, prompt: Sequence[int], output: Sequence[int]) -> None:
        """A stream ended with [DONE] and returned its token ids."""
        self.core.pool.record_success(routed.placement.worker)
        self.core.finish(routed.placement, Outcome(True, prompt, output))

    # --- what the router learns from the workers ---------------------------------------------
    def scraped(self, worker: str, running: int, waiting: int, kv_usage: float,
                now: float) -> None:
        self.core.set_load(WorkerId(worker), running=running, waiting=waiting,
                           kv_usage=kv_usage)

    def kv_events(self, worker: str, events: list[dict[str, Any]], now: float) -> None:
        """One batch of a worker's KV events (vLLM's maps, as the subscriber decodes them)."""
        self.core.apply_kv_events(WorkerId(worker), events)

    def worker_gone(self, worker: str) -> int:
        """The worker's lease expired: the core forgets it and rebinds its sessions (with a
        restore hint). Returns how many sessions moved."""
        wid = WorkerId(worker)
        before = len(self.core.sessions.bound_to(wid))
        self.core.remove_worker(wid)
        return before - len(self.core.sessions.bound_to(wid))

    def bound_sessions(self, worker: str) -> list[str]:
        return [str(s) for s in self.core.sessions.bound_to(WorkerId(worker))]

    def knows(self, worker: str) -> bool:
        return WorkerId(worker) in self.core.pool

    @property
    def index_blocks(self) -> int:
        return len(self.core.blocks)

    # --- private -----------------------------------------------------------------------------
    def _count_soft_fallback(self, route: RouteRequest) -> None:
        """Diagnostics only (decides nothing): would the policy's own soft filters leave no
        usable worker for this stateless request? Counted as `soft_filter_fallback`. (The
        scheduler then scores all of them; until the filters were split into every-placement
        and session-only ones it ranked by least utilisation and ignored every score.)"""
        core = self.core
        policy = core.policy
        if not policy.soft_filters or route.session_id is not None:
            return
        ctx = DecisionContext(route, core.clock())
        kept = [w for w in core.pool.states() if w.usable(ctx.now)]
        for soft in policy.soft_filters:
            kept = soft.apply(ctx, kept)
        if not kept:
            self.decisions["soft_filter_fallback"] = \
                self.decisions.get("soft_filter_fallback", 0) + 1

    def _features(self, req: RouterInput) -> RequestFeatures:
        session = SessionId(req.session) if req.session is not None and self.spec.sessions \
            else None
        if self.spec.input == "tokens":
            return RequestFeatures(self.model, session, prompt_tokens=route_tokens(req),
                                   max_tokens=req.max_tokens)
        if self.tokenizes:  # what `PromptTokenizer.features` gives: the text and its ids
            return RequestFeatures(self.model, session, prompt_tokens=route_tokens(req),
                                   prompt_text=req.text, max_tokens=req.max_tokens)
        return RequestFeatures(self.model, session, prompt_text=req.text,
                               max_tokens=req.max_tokens)


def route_tokens(req: RouterInput) -> tuple[int, ...]:
    tokens = req.tokens
    return tuple(tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)
