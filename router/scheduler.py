"""The decision pipeline: filters -> session rules -> scorers -> weighted sum -> picker.

`Scheduler.decide` is synchronous and touches no network: it reads the pool, the request's
facts, the session's current worker and the prefix indexes, and returns a `Decision`. What
follows a pick (the load charged at once, the routing history taught the prompt) is the
router core's pre-request hooks (`router/hooks.py`).

Order of the rules, for a request of a session bound to worker B:
1. hard filters (usable, serves the model, not excluded); none left: 503;
2. B passes and is not overloaded (policy `migrate`): B (sticky) - its KV is there;
   B overloaded: choose among the others (migrated, KV restored from the store);
   B gone or failing: choose among the others (failover, KV restored);
3. saturation: nobody with room left in its queue: 429 with Retry-After;
4. new placements only: soft filters (KV usage < 85 %, queue, GPU). If they leave nobody, the
   least-utilised workers take the session instead of the hot ones that hold its prefix;
5. weighted sum of scores; the picker's first is the choice. A send that fails before the
   response starts is decided again without the failed worker (fresh load, fresh failure
   marks), which is the next-ranked worker when nothing else changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from router.context import DecisionContext
from router.decision import Decision, RouteReason, RouteRequest
from router.errors import NoHealthyWorker, Saturated
from router.filters import ExcludeFilter, ModelFilter, SaturationFilter, UsableFilter
from router.indexer.events import KVBlockIndex
from router.indexer.history import RoutingHistory
from router.membership.workers import WorkerId, WorkerPool, WorkerState
from router.pickers import LeastUtilisedPicker
from router.policy import Policy, Thresholds

__all__ = ["Scheduler", "overloaded"]

_HARD = (UsableFilter(), ModelFilter(), ExcludeFilter())
_LEAST_UTILISED = LeastUtilisedPicker()


def overloaded(bound: WorkerState, others: Sequence[WorkerState], th: Thresholds) -> bool:
    """Whether a session should leave `bound` for one of `others`.

    Only when moving helps: another candidate must be less loaded. A restore from the store
    costs less than queueing behind a hot worker, but more than staying on a busy one that is
    no busier than the rest.
    """
    if not others:
        return False
    best = min(others, key=lambda w: w.queue)
    if bound.waiting >= th.migrate_waiting and best.waiting < bound.waiting:
        return True
    # Both an absolute and a relative gap: 4 requests matter on a worker running 6, not on
    # one running 200 (where moving would trade a KV restore for nothing).
    return (bound.queue - best.queue >= th.migrate_imbalance
            and bound.queue >= th.migrate_ratio * best.queue)


class Scheduler:
    """Decides where each request goes under one `Policy`."""

    __slots__ = ("_clock", "_policy", "_saturation", "blocks", "history", "pool")

    def __init__(self, pool: WorkerPool, policy: Policy, *, history: RoutingHistory | None = None,
                 blocks: KVBlockIndex | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.history = history
        self.blocks = blocks
        self._clock = clock
        self._policy = policy
        self._saturation = SaturationFilter(policy.thresholds.max_waiting)

    @property
    def policy(self) -> Policy:
        return self._policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        """Switch policies between decisions (a reconfiguration, a simulator's sweep)."""
        self._policy = policy
        self._saturation = SaturationFilter(policy.thresholds.max_waiting)

    def decide(self, request: RouteRequest, bound: WorkerId | None = None, *,
               migrate: bool = True) -> Decision:
        """Where `request` goes; `bound` is its session's current worker, if any.

        `migrate=False` keeps a usable bound worker whatever its load: used when another
        replica has just bound the session, so that two replicas do not move it back and forth
        on slightly different load views.

        Raises `NoHealthyWorker` (503) or `Saturated` (429); never blocks.
        """
        policy = self.policy
        ctx = DecisionContext(request, self._clock(), bound, self.history, self.blocks)
        candidates: list[WorkerState] = self.pool.states()
        for hard in _HARD:
            candidates = hard.apply(ctx, candidates)
        if not candidates:
            raise NoHealthyWorker(f"no healthy worker serves model {request.model!r}")

        previous: WorkerId | None = None
        reason: RouteReason | None
        if request.session_id is None:
            reason = RouteReason.STATELESS
        elif bound is None:
            reason = RouteReason.NEW
        elif policy.sticky:
            mine = next((w for w in candidates if w.worker_id == bound), None)
            if mine is not None:
                others = [w for w in candidates if w is not mine]
                if not (migrate and policy.migrate
                        and overloaded(mine, others, policy.thresholds)):
                    return Decision(bound, RouteReason.STICKY)
                reason, previous, candidates = RouteReason.MIGRATED, bound, others
            else:
                reason, previous = RouteReason.FAILOVER, bound
        else:
            reason = None  # a baseline without session rules: named after the pick

        open_ = self._saturation.apply(ctx, candidates)
        if not open_:
            raise Saturated(f"all {len(candidates)} workers for {request.model!r} are saturated",
                            retry_after_s=1)
        choice = self._rank(ctx, open_, session=reason is not RouteReason.STATELESS)[0].worker_id
        if reason is None:
            if choice == bound:
                reason = RouteReason.STICKY
            else:
                alive = any(w.worker_id == bound for w in candidates)
                reason = RouteReason.MIGRATED if alive else RouteReason.FAILOVER
                previous = bound
        return Decision(choice, reason, previous)

    def _rank(self, ctx: DecisionContext, candidates: list[WorkerState], *, session: bool
              ) -> list[WorkerState]:
        policy = self.policy
        filters = policy.soft_filters + policy.session_filters if session \
            else policy.soft_filters
        if filters:
            kept = candidates
            for soft in filters:
                kept = soft.apply(ctx, kept)
            if not kept and session:
                # A session placed on a hot worker stays there for its later turns: the
                # least-utilised take it, whatever its prefix says.
                return _LEAST_UTILISED.rank(candidates, ())
            # A stateless request that no worker passes is scored over all of them: ranking
            # by utilisation alone would throw away the prefix it shares with others.
            candidates = kept or candidates
        if not policy.scorers:  # every weight 0: the picker sees equal scores
            return policy.picker.rank(candidates, [0.0] * len(candidates))
        totals = [0.0] * len(candidates)
        for scorer, weight in policy.scorers:
            for i, s in enumerate(scorer.score(ctx, candidates)):
                totals[i] += weight * s
        return policy.picker.rank(candidates, totals)
