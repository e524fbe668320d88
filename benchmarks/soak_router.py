"""The router half of `python -m benchmarks.soak`: sessions and prefixes churning through
`RouterCore` (in this process) and through `kvkeep router serve` (a subprocess, against a fake
OpenAI worker on loopback), with resident memory sampled all along.

Every request is a new session whose prompt starts with one of `PREFIXES` shared system
prompts, rotating, and ends with text of its own; its answer returns prompt and output token
ids (so the router remembers the session's blocks), and the workers announce the blocks they
cached (KV events). The router keeps nothing per request beyond what its bounded indexes and
session table allow, so once those bounds apply its RSS must stay flat; `structures` reports
the size of each of RouterCore's per-session and per-prefix structures at the end, so that a
growth can be told apart.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

from benchmarks.router import fake_worker_behind_router
from benchmarks.soak import SAMPLES, _summary, rss_mib

__all__ = ["soak_router_core", "soak_router_http"]

PREFIXES = 200
WARMUP_SHARE = 0.3
_WORKERS = 16


BOUNDED_TTL_S = 30.0
"""`bounded` runs: bindings expire after this much simulated time (a request every 10 ms)."""


def soak_router_core(sessions: int, seed: int = 0, *, bounded: bool = False) -> dict[str, Any]:
    """`sessions` new sessions through one RouterCore (place, finish with token ids, KV
    events), sampling this process's RSS. Default limits (`router.limits.Limits`), or with
    `bounded`, caps small enough to be reached within the run and bindings that expire (a
    simulated clock): what the RSS does once every bound applies."""
    from kvstore.keys import SessionId
    from router.core import RouterCore
    from router.decision import RequestFeatures
    from router.hooks import Outcome
    from router.indexer import BlockStored
    from router.limits import Limits
    from router.membership.workers import WorkerId, WorkerInfo
    from router.policy import build_policy

    rng = random.Random(seed)
    now = [0.0]
    if bounded:
        limits = Limits(max_sessions=max(sessions, 1), history_keys=20_000,
                        session_block_keys=50_000, kv_blocks_per_worker=200,
                        shared_kv_blocks=2_000)
        core = RouterCore(build_policy("kvkeep", rng=rng), block_size=32, limits=limits,
                          session_ttl_s=BOUNDED_TTL_S, clock=lambda: now[0])
    else:
        core = RouterCore(build_policy("kvkeep", rng=rng), block_size=32)
    workers = [WorkerId(f"w{i:02d}") for i in range(_WORKERS)]
    for wid in workers:
        core.add_worker(WorkerInfo(wid, f"http://{wid}", ("m",)))
        core.set_load(wid, running=0, waiting=0, kv_usage=0.1)
    systems = [[rng.randrange(10, 30000) for _ in range(256)] for _ in range(PREFIXES)]
    pid = os.getpid()
    every = max(sessions // SAMPLES, 1)
    samples: list[tuple[int, float]] = []
    started = time.perf_counter()
    for i in range(sessions):
        if bounded:
            now[0] += 0.01
            if i % 100 == 0 and core._own_state is not None:
                core._own_state.reap()  # what its reaper task does every 100 ms
        own = [rng.randrange(10, 30000) for _ in range(96)]
        prompt = tuple(systems[i % PREFIXES] + own)
        features = RequestFeatures("m", SessionId(f"soak-{i}"), prompt_tokens=prompt,
                                   max_tokens=32)
        placement = core.place_now(core.route(features))
        output = [rng.randrange(10, 30000) for _ in range(32)]
        core.finish(placement, Outcome(ok=True, prompt_tokens=prompt, output_tokens=output))
        if i % 4 == 0:  # the worker announces what it cached (new blocks, chained)
            tokens = list(prompt[256:256 + 64])
            core.apply_kv_events(placement.decision.worker, [BlockStored(
                [rng.getrandbits(63), rng.getrandbits(63)], None, tokens, 32)])
        if i % every == 0 or i == sessions - 1:
            samples.append((i, rss_mib(pid)[0]))
    elapsed = time.perf_counter() - started
    status = core.status()
    structures = {"sessions": status.sessions, "kv_index_blocks": status.kv_index_blocks,
                  "routing_history_keys": len(core.history),
                  "session_blocks": len(core.session_blocks._keys),
                  "history_capacity": core.history.capacity,
                  "session_blocks_capacity": core.session_blocks.capacity}
    result = {"items": sessions, "requests_per_s": round(sessions / elapsed, 1),
              "structures": structures, **_summary(samples, int(sessions * WARMUP_SHARE),
                                                   sessions)}
    result.pop("samples")
    return result


def soak_router_http(sessions: int, concurrency: int = 16) -> dict[str, Any]:
    """`sessions` new sessions through `kvkeep router serve` (one request each, streamed),
    sampling the router process's RSS."""
    with fake_worker_behind_router(8, 0.0) as served:
        samples: list[tuple[int, float]] = []
        started = time.perf_counter()
        errors = asyncio.run(_drive(f"{served.router_url}/v1/completions", sessions,
                                    concurrency, served.router_pid, samples))
        elapsed = time.perf_counter() - started
    result = {"items": sessions, "requests_per_s": round(sessions / elapsed, 1),
              "errors": errors, **_summary(samples, int(sessions * WARMUP_SHARE), sessions)}
    result.pop("samples")
    return result


async def _drive(url: str, total: int, concurrency: int, pid: int,
                 samples: list[tuple[int, float]]) -> int:
    import aiohttp

    rng = random.Random(2)
    systems = [" ".join(f"sys{p}-{k}" for k in range(200)) for p in range(PREFIXES)]
    every = max(total // SAMPLES, 1)
    done = errors = 0
    next_id = 0

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def client() -> None:
            nonlocal done, errors, next_id
            while next_id < total:
                i = next_id
                next_id += 1
                body = {"model": "fake", "prompt": systems[i % PREFIXES]
                        + f" user {i} {rng.random()}", "max_tokens": 8, "stream": True}
                try:
                    async with http.post(url, json=body,
                                         headers={"X-Session-Id": f"soak-{i}"}) as resp:
                        async for _ in resp.content:
                            pass
                        errors += int(resp.status != 200)
                except aiohttp.ClientError:
                    errors += 1
                done += 1
                if done % every == 0 or done == total:
                    samples.append((done, rss_mib(pid)[0]))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return errors
