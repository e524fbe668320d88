"""The router core driven without HTTP and without etcd, as a simulator drives it: simulated
clock, synchronous placement on the in-memory session table, metrics and KV events fed
directly, hooks."""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvstore.keys import SessionId
from router.core import RouterCore
from router.decision import Placement, RequestFeatures, RouteReason
from router.errors import NoHealthyWorker
from router.hooks import Outcome
from router.indexer import AllBlocksCleared, BlockRemoved, BlockStored, KVBlockIndex
from router.indexer.events import SHARED
from router.indexer.keys import token_block_keys
from router.membership.workers import WorkerId, WorkerInfo
from router.policy import build_policy
from router.tasks import run_now

W = WorkerId
README = Path(__file__).resolve().parents[1] / "router" / "README.md"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def core_of(n: int, policy: str = "kvkeep", *, clock: Clock | None = None,
            block_size: int = 16, **kwargs: Any) -> RouterCore:
    core = RouterCore(build_policy(policy, rng=random.Random(0)), block_size=block_size,
                      clock=clock, **kwargs)
    for i in range(n):
        core.add_worker(WorkerInfo(W(f"w{i}"), f"sim://w{i}", ("m",)))
        core.set_load(W(f"w{i}"), running=1, waiting=0, kv_usage=0.2)
    return core


def place(core: RouterCore, session: str | None = None, **features: Any) -> Placement:
    sid = SessionId(session) if session is not None else None
    return core.place_now(core.route(RequestFeatures("m", sid, **features)))


def test_the_readme_example_runs_as_documented() -> None:
    block = re.search(r"## The router core.*?```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    lines = block.group(1).strip().splitlines()
    assert len([line for line in lines if not line.startswith(("import", "from"))]) <= 16
    scope: dict[str, Any] = {}
    exec(block.group(1), scope)
    first, second, core = scope["first"], scope["second"], scope["core"]
    assert (first.worker, first.label) == ("w2", "new")  # the worker holding the prefix
    assert second.worker != "w2" and second.label == "failover"
    assert second.restore_from == "w2"
    assert core.session(SessionId("alice")).worker_id == second.worker
    assert len(core.workers()) == 3 and core.status().kv_index_blocks == 0


def test_simulated_time_drives_cooldown_and_suspicion() -> None:
    clock = Clock()
    core = core_of(2, clock=clock)
    home = place(core, "s").worker
    other = W("w1" if home == "w0" else "w0")
    core.set_load(home, running=9, waiting=3, kv_usage=0.5)  # overloaded
    clock.now += 1.0  # younger than the 2 s cooldown: stays
    assert place(core, "s").decision.reason is RouteReason.STICKY
    clock.now += 1.5
    moved = place(core, "s")
    assert (moved.worker, moved.label, moved.restore_from) == (other, "migrated", home)
    assert moved.binding is not None and moved.binding.binding.epoch == 1
    # a broken connection makes a worker suspect for 5 simulated seconds
    core.pool.record_failure(other, hard=True)
    assert not core.usable(core.pool.get(other))  # type: ignore[arg-type]
    clock.now += 5.1
    assert core.usable(core.pool.get(other))  # type: ignore[arg-type]


def test_a_dead_workers_sessions_are_rebound_at_once_and_settle_after_success() -> None:
    core = core_of(3)
    placements = {f"s{i}": place(core, f"s{i}") for i in range(30)}
    for p in placements.values():
        core.finish(p, Outcome(ok=True))
    dead = W("w1")
    orphans = [s for s, p in placements.items() if p.worker == dead]
    assert orphans
    core.remove_worker(dead)
    assert core.sessions.bound_to(dead) == []  # rebound synchronously, no event loop
    for sid in orphans:
        vb = core.session(SessionId(sid))
        assert vb is not None and vb.worker_id != dead and vb.binding.restore_from == dead
        p = place(core, sid)
        assert (p.label, p.restore_from, p.worker) == ("failover", dead, vb.worker_id)
        core.finish(p, Outcome(ok=True))
        settled = core.session(SessionId(sid))
        assert settled is not None and settled.binding.restore_from is None
        assert place(core, sid).label == "sticky"
    core.remove_worker(W("w0"))
    core.remove_worker(W("w2"))
    with pytest.raises(NoHealthyWorker):
        place(core, "s0")


def test_bindings_expire_on_the_simulated_clock() -> None:
    clock = Clock()
    core = core_of(2, clock=clock, session_ttl_s=60.0)
    p = place(core, "gone")
    core.finish(p, Outcome(ok=True))
    clock.now += 59
    core.expire()
    assert core.session(SessionId("gone")) is not None
    clock.now += 2
    core.expire()
    assert core.session(SessionId("gone")) is None
    assert place(core, "gone").label == "new"


def test_metrics_set_directly_decide_load() -> None:
    core = core_of(3, "least-loaded")
    core.set_load(W("w0"), running=10, waiting=0, kv_usage=0.5)
    core.set_load(W("w1"), running=0, waiting=0, kv_usage=0.5)
    core.set_load(W("w2"), running=5, waiting=0, kv_usage=0.5)
    assert place(core).worker == "w1"
    # the pick is charged at once: a burst spreads before the next reading
    picks = [place(core).worker for _ in range(6)]
    assert picks.count(W("w1")) < 6
    core.set_load(W("w1"), running=0, waiting=0, kv_usage=0.5)  # a fresh reading resets it
    assert core.pool.get(W("w1")).pending == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("block_size", [16, 64])
def test_kv_events_fed_directly_steer_token_prompts(block_size: int) -> None:
    core = core_of(4, block_size=block_size)
    prompt = tuple(range(block_size * 4))
    hashes = [101, 102, 103, 104]
    core.apply_kv_events(W("w3"), [BlockStored(hashes, None, prompt, block_size)])
    assert place(core, prompt_tokens=prompt).worker == "w3"
    # vLLM's own decoded maps do the same
    core.apply_kv_events(W("w3"), [AllBlocksCleared()])
    core.apply_kv_events(W("w1"), [{"type": "BlockStored", "block_hashes": hashes,
                                    "parent_block_hash": None, "token_ids": list(prompt),
                                    "block_size": block_size, "medium": "GPU"}])
    assert place(core, prompt_tokens=prompt).worker == "w1"
    core.apply_kv_events(W("w1"), [BlockRemoved(hashes)])
    assert core.status().kv_index_blocks == 0
    # a shared store's blocks count for every worker (storage weight), its own for one
    core.apply_kv_events(W("w0"), [BlockStored(hashes, None, prompt, block_size,
                                               medium="KVKEEP_SHARED")])
    keys = token_block_keys(prompt, block_size)
    assert core.blocks.match(keys) == {SHARED: 2.0}


def test_typed_and_mapped_events_build_the_same_index() -> None:
    typed, mapped = KVBlockIndex(4), KVBlockIndex(4)
    tokens = list(range(16))
    events: list[Any] = [BlockStored([1, 2], None, tokens[:8], 4, medium="CPU"),
                         BlockStored([3, 4], 2, tokens[8:], 4), BlockRemoved([4]),
                         BlockStored([5], None, tokens[:4], 4, medium="KVKEEP_LOCAL")]
    for event in events:
        typed.apply(W("a"), event)
        kind = type(event).__name__
        fields = {k: getattr(event, k) for k in event.__slots__}
        mapped.apply(W("a"), {"type": kind, **fields})
    keys = token_block_keys(tokens, 4)
    assert typed.match(keys) == mapped.match(keys) == {"a": pytest.approx(0.8 + 0.8 + 1.0)}
    assert typed.events_applied == mapped.events_applied == 4


def test_text_prompts_score_approximately_and_sessions_learn_their_tokens() -> None:
    core = core_of(4)
    system = "You are a helpful assistant. " * 20
    route = core.route(RequestFeatures("m", SessionId("t"), prompt_text=system + "hi"))
    assert route.prefix_keys and route.block_keys == ()  # text: no precise keys
    first = core.place_now(route)
    core.finish(first, Outcome(ok=True, prompt_tokens=list(range(40)),
                               output_tokens=list(range(40, 48))))
    # another session with the same system prompt follows the history to the same worker
    assert place(core, "u", prompt_text=system + "hello").worker == first.worker
    # the session's next turn knows its token blocks (prompt + output of the last turn)
    nxt = core.route(RequestFeatures("m", SessionId("t"), prompt_text="more"))
    assert nxt.block_keys == token_block_keys(list(range(48)), 16)
    # a failed attempt teaches nothing
    p = place(core, "v", prompt_text="x")
    core.finish(p, Outcome(ok=False, prompt_tokens=[1] * 32))
    assert core.route(RequestFeatures("m", SessionId("v"))).block_keys == ()


def test_hooks_run_once_per_placement_and_can_be_added() -> None:
    core = core_of(2)
    seen: list[tuple[str, bool]] = []

    class Recorder:
        def post_response(self, placement: Placement, outcome: Outcome) -> None:
            seen.append((placement.worker, outcome.ok))

    core.post_response.append(Recorder())
    p = place(core, prompt_text="a")
    assert [w.inflight for w in core.workers()] == [1, 0] or \
        [w.inflight for w in core.workers()] == [0, 1]
    core.finish(p, Outcome(ok=True))
    assert seen == [(p.worker, True)]
    assert all(w.inflight == 0 and w.inflight_tokens == 0 for w in core.workers())


def test_the_policy_can_be_switched_between_requests() -> None:
    core = core_of(3)
    core.policy = build_policy("round-robin")
    assert [place(core).worker for _ in range(3)] == ["w0", "w1", "w2"]
    core.policy = replace(core.policy, thresholds=replace(core.policy.thresholds,
                                                          max_waiting=1))
    for i in range(3):  # a fresh reading of each: one request queued on w0
        core.set_load(W(f"w{i}"), running=0, waiting=int(i == 0), kv_usage=0.0)
    picks = set()
    for _ in range(4):
        p = place(core)
        picks.add(p.worker)
        core.finish(p, Outcome(ok=True))
    assert picks == {"w1", "w2"}


def test_run_now_refuses_a_coroutine_that_waits() -> None:
    async def waits() -> int:
        await asyncio.sleep(0)
        return 1

    async def does_not() -> int:
        return 2

    assert run_now(does_not()) == 2
    with pytest.raises(RuntimeError, match="waited for I/O"):
        run_now(waits())


def test_thousands_of_placements_without_an_event_loop() -> None:
    """What the simulator does: many sessions, many turns, no loop, no I/O."""
    clock = Clock()
    core = core_of(8, clock=clock)
    rng = random.Random(1)
    live: list[Placement] = []
    for i in range(5000):
        clock.now += 0.001
        live.append(place(core, f"s{rng.randrange(500)}", prompt_text=f"p{i % 50} " * 40))
        if len(live) > 64:
            core.finish(live.pop(0), Outcome(ok=True))
    for p in live:
        core.finish(p, Outcome(ok=True))
    assert len(core.sessions) == 500
    assert sum(w.inflight for w in core.workers()) == 0
    assert len({core.session(SessionId(f"s{i}")).worker_id  # type: ignore[union-attr]
                for i in range(500)}) == 8
