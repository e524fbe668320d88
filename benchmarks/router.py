"""Router benchmarks: decision latency, proxy overhead, and a policy replay.

    python -m benchmarks.router --quick --json OUT.json

- Decision latency: `RouterCore.decide` + its pre-request hooks with >= 100,000 bound sessions
  and >= 64 workers carrying load, prefix history and a KV-event index; p50/p99 in
  microseconds. `place_us`: the whole synchronous `place_now` (the in-memory session table's
  lookup and CAS included), what a simulator driving the core pays per request.
- Proxy overhead: 64 concurrent streams against a fast fake streaming server, straight to it and
  through a router (separate processes, same run, same client); per-request time to the last
  byte, p50/p99 in ms. The router path includes everything a real request pays: parsing, the
  decision, `return_token_ids` asked of the worker and stripped per chunk, SSE relay.
- Policy replay (not timed): a discrete-event simulation of multi-turn sessions with skewed
  activity on a few workers, routed by the real `RouterCore` under each policy, reporting mean and
  p99 TTFT. It reproduces Dynamo's finding that plain stickiness loses to round robin, and
  shows whether the `kvkeep` policy does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.cli import as_json, run_benchmark
from benchmarks.plots import RatioPanel
from benchmarks.processes import free_port, stop_process
from benchmarks.progress import progress
from kvstore.keys import SessionId
from router.core import RouterCore
from router.decision import Placement, RouteReason, RouteRequest
from router.errors import Saturated
from router.hooks import FAILED, Outcome
from router.indexer import BlockStored, text_prefix_keys
from router.membership.workers import WorkerId, WorkerInfo
from router.policy import build_policy
from router.tasks import run_now

__all__ = ["decision_latency", "proxy_overhead", "replay", "main"]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- decision latency ------------------------------------------------------------------------
def decision_latency(sessions: int = 100_000, workers: int = 64, decisions: int = 20_000,
                     seed: int = 0) -> dict[str, Any]:
    """`RouterCore.decide` + its pre-request hooks (load charged, history recorded): what the
    router does per request between parsing and sending, without the binding write. Then
    `place_us`: the whole `place_now` of the same requests, with every session bound in the
    in-memory table (a binding CAS where one changes): what a simulator pays per request."""
    rng = random.Random(seed)
    now = 0.0
    core = RouterCore(build_policy("kvkeep", rng=rng), block_size=32, clock=lambda: now)
    ids = [WorkerId(f"w{i:03d}") for i in range(workers)]
    for wid in ids:
        core.add_worker(WorkerInfo(wid, f"http://{wid}", ("m",)))
        core.set_load(wid, running=rng.randint(0, 30), waiting=rng.randint(0, 3),
                      kv_usage=rng.random() * 0.9)
    # Prompts share one of 100 system prompts (~2 KiB) and then diverge.
    systems = [f"system prompt {k} " * 120 for k in range(100)]
    bound: dict[SessionId, WorkerId] = {}
    for i in range(sessions):
        bound[SessionId(f"s{i}")] = ids[i % workers]
        if i < 20_000:
            keys = text_prefix_keys(systems[i % 100] + f"user {i}")
            core.history.record(keys, ids[i % workers])
    for w in ids[:32]:  # KV events: half the workers report their cached blocks
        tokens = [rng.randrange(1000) for _ in range(32 * 64)]
        core.apply_kv_events(w, [BlockStored(list(range(64)), None, tokens, 32)])
    requests = []
    for i in range(decisions):
        sid: SessionId | None = SessionId(f"s{rng.randrange(sessions)}") if i % 4 else None
        text = systems[rng.randrange(100)] + f"user turn {i}"
        requests.append((RouteRequest("m", sid, text_prefix_keys(text), (), 600),
                         bound.get(sid) if sid else None))
    times = []
    clock = time.perf_counter_ns
    for req, b in requests:
        start = clock()
        placement = Placement(core.decide(req, b), None, req)
        core.admit(placement)
        times.append((clock() - start) / 1000.0)
        core.finish(placement, FAILED)
    for sid, wid in bound.items():
        run_now(core.sessions.bind(sid, wid, "m", expected=None, reason="new",
                                   restore_from=None))
    now += 60.0  # past the migration cooldown: bound sessions may move, as in the decisions
    placing = []
    for req, _ in requests:
        start = clock()
        placement = core.place_now(req)
        placing.append((clock() - start) / 1000.0)
        core.finish(placement, FAILED)
    return {"p50": round(_pct(times, 0.5), 2), "p99": round(_pct(times, 0.99), 2),
            "place_p50": round(_pct(placing, 0.5), 2), "place_p99": round(_pct(placing, 0.99), 2),
            "sessions": sessions, "workers": workers}


# --- proxy overhead --------------------------------------------------------------------------
_FAKE_SERVER = r'''
import asyncio, json, sys
from aiohttp import web
CHUNKS = int(sys.argv[2])
INTERVAL = float(sys.argv[3])
async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "fake"}]})
async def health(request):
    return web.Response()
async def metrics(request):
    return web.Response(text='vllm:num_requests_running{engine="0"} 0\n')
async def completions(request):
    body = await request.json()
    ids = bool(body.get("return_token_ids"))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    loop = asyncio.get_running_loop()
    start = loop.time()
    for i in range(CHUNKS):
        if i and INTERVAL:
            # Chunk i is due at start + i * INTERVAL, like an engine's decode steps: a slow
            # reader (or a CPU shared with the router) delays a chunk, not every later one.
            await asyncio.sleep(max(0.0, start + i * INTERVAL - loop.time()))
        choice = {"index": 0, "text": " tok", "logprobs": None,
                  "finish_reason": "length" if i == CHUNKS - 1 else None, "stop_reason": None}
        if ids:
            choice["token_ids"] = [i]
            if i == 0:
                choice["prompt_token_ids"] = list(range(64))
        chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "fake",
                 "choices": [choice]}
        await resp.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode()
                         + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp
app = web.Application()
app.router.add_get("/v1/models", models)
app.router.add_get("/health", health)
app.router.add_get("/metrics", metrics)
app.router.add_post("/v1/completions", completions)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
'''


def _wait_http(url: str, timeout: float = 30.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as resp:
            if resp.status == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready")


async def _load(url: str, concurrency: int, total: int, session_ids: bool,
                stagger_s: float = 0.0) -> tuple[list[float], list[float]]:
    """`concurrency` clients, each sending its next request when the last ends, until `total`
    have run; returns (TTFT ms, TTLB ms) per request.

    Each client starts after a random delay in [0, `stagger_s`): with equal stream lengths,
    clients that all start at once stay in lock-step waves forever, which measures a burst
    of 64 simultaneous requests rather than 64 concurrent streams.
    """
    import aiohttp

    times: list[float] = []
    firsts: list[float] = []
    body = {"model": "fake", "prompt": "hello " * 64, "max_tokens": 32, "stream": True,
            "temperature": 0}
    rng = random.Random(1)
    per_client = [total // concurrency + (1 if i < total % concurrency else 0)
                  for i in range(concurrency)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def client(c: int, count: int) -> None:
            await asyncio.sleep(rng.random() * stagger_s)
            for k in range(count):
                headers = {"X-Session-Id": f"s{c}-{k % 8}"} if session_ids else {}
                start = time.perf_counter()
                first = None
                async with http.post(url, json=body, headers=headers) as resp:
                    async for _ in resp.content:
                        if first is None:
                            first = time.perf_counter()
                end = time.perf_counter()
                times.append((end - start) * 1000)
                firsts.append(((first or end) - start) * 1000)

        await asyncio.gather(*(client(c, n) for c, n in enumerate(per_client)))
    return firsts, times


def _cpu_s(pid: int | None = None) -> float | None:
    """CPU seconds (user + system) of process `pid`, or of the whole machine's busy time when
    None; None where /proc is not available."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        if pid is None:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
            return (sum(fields) - fields[3] - fields[4]) / tick  # all but idle and iowait
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / tick
    except (OSError, ValueError, IndexError):
        return None


class _CpuMeter:
    """CPU used by the router, the fake worker, the load client (this process) and everything
    else on the machine while one path is measured."""

    def __init__(self, router: int, worker: int) -> None:
        self.pids = {"router": router, "worker": worker, "client": os.getpid()}
        self.used: dict[str, dict[str, float]] = {}
        self.wall: dict[str, float] = {}

    def measure(self, path: str, run: Any) -> Any:
        before = {k: _cpu_s(p) for k, p in self.pids.items()} | {"machine": _cpu_s()}
        start = time.monotonic()
        result = run()
        self.wall[path] = self.wall.get(path, 0.0) + time.monotonic() - start
        used = self.used.setdefault(path, {})
        for key, value in before.items():
            now = _cpu_s(None if key == "machine" else self.pids[key])
            if value is not None and now is not None:
                used[key] = used.get(key, 0.0) + now - value
        return result


def proxy_overhead(concurrency: int = 64, requests: int = 1280, chunks: int = 32,
                   interval_ms: float = 10.0, rounds: int = 8) -> dict[str, Any]:
    """Direct vs routed latency at `concurrency` open streams, in alternating rounds (ABBA)
    so that the machine's drift hits both paths alike; one client for both paths.

    The fake worker sends its `chunks` chunks on a fixed schedule `interval_ms` apart (100
    tokens/s per stream, faster than real models decode), like an engine whose decode steps do
    not wait for the HTTP side: a chunk the router delays does not push back the later ones.
    It has no compute, so all latency beyond the pacing is HTTP and the router. The `*_ms_*`
    fields are the time to the last byte of a stream, the `ttft_*` fields the time to its first
    chunk; `paired_*_delta_ms` the median over rounds of routed minus direct p50 in adjacent
    rounds. `cpu` says what the router and the worker cost per request and how busy the rest of
    the machine was (cores), since on a small shared machine that decides the figures.
    """
    load_before = os.getloadavg()
    with fake_worker_behind_router(chunks, interval_ms / 1000) as served:
        urls = {"direct": f"{served.worker_url}/v1/completions",
                "routed": f"{served.router_url}/v1/completions"}
        stagger = chunks * interval_ms / 1000
        for path, url in urls.items():  # warm-up: connections, caches, the router's state
            asyncio.run(_load(url, concurrency, concurrency * 2, path == "routed", stagger))
        meter = _CpuMeter(served.router_pid, served.worker_pid)
        first: dict[str, list[float]] = {"direct": [], "routed": []}
        last: dict[str, list[float]] = {"direct": [], "routed": []}
        medians: dict[str, list[tuple[float, float]]] = {"direct": [], "routed": []}
        for r in range(rounds):
            for path in ("direct", "routed") if r % 4 in (0, 3) else ("routed", "direct"):
                f, t = meter.measure(path, lambda p=path: asyncio.run(_load(
                    urls[p], concurrency, requests // rounds, p == "routed", stagger)))
                first[path] += f
                last[path] += t
                medians[path].append((statistics.median(t), statistics.median(f)))
    d_first, d_last, r_first, r_last = first["direct"], last["direct"], first["routed"], \
        last["routed"]
    pairs = list(zip(medians["direct"], medians["routed"], strict=True))
    cpu: dict[str, Any] = {"cores": os.cpu_count()}
    for path, used in meter.used.items():
        n = len(last[path])
        if "router" in used and path == "routed":
            cpu["router_ms_per_request"] = round(used["router"] * 1000 / n, 3)
        for who in ("worker", "client"):
            if who in used:
                cpu[f"{who}_ms_per_request_{path}"] = round(used[who] * 1000 / n, 3)
        if {"machine", "router", "worker", "client"} <= used.keys():
            # Cores kept busy by other programs meanwhile (other jobs on a shared machine).
            cpu[f"other_cores_busy_{path}"] = round(max(0.0, used["machine"] - used["router"]
                                                        - used["worker"] - used["client"])
                                                    / meter.wall[path], 2)
    cpu["loadavg_1m"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    return {"direct_ms_p50": round(statistics.median(d_last), 3),
            "routed_ms_p50": round(statistics.median(r_last), 3),
            "direct_ms_p99": round(_pct(d_last, 0.99), 3),
            "routed_ms_p99": round(_pct(r_last, 0.99), 3),
            "concurrency": concurrency,
            "direct_ttft_ms_p50": round(statistics.median(d_first), 3),
            "routed_ttft_ms_p50": round(statistics.median(r_first), 3),
            "direct_ttft_ms_p99": round(_pct(d_first, 0.99), 3),
            "routed_ttft_ms_p99": round(_pct(r_first, 0.99), 3),
            "paired_p50_delta_ms": round(statistics.median(r[0] - d[0] for d, r in pairs), 3),
            "paired_ttft_p50_delta_ms": round(statistics.median(r[1] - d[1] for d, r in pairs),
                                              3),
            "requests_per_path": len(d_last), "chunks_per_stream": chunks,
            "chunk_interval_ms": interval_ms, "cpu": cpu}


@dataclass(frozen=True, slots=True)
class RoutedFake:
    """A fake worker (`_FAKE_SERVER`) and a `kvkeep router serve` in front of it."""

    worker_url: str
    router_url: str
    worker_pid: int
    router_pid: int


@contextlib.contextmanager
def fake_worker_behind_router(chunks: int, interval_s: float) -> Iterator[RoutedFake]:
    """Start the fake worker (`chunks` chunks `interval_s` apart per stream) and a router whose
    one static worker it is; both stopped at the end."""
    fake_port, router_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", _FAKE_SERVER, str(fake_port), str(chunks),
                               str(interval_s)], env=env)]
    try:
        _wait_http(f"http://127.0.0.1:{fake_port}/health")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvstore.commands", "router", "serve",
             "--listen", f"127.0.0.1:{router_port}", "--log-level", "WARNING",
             "--worker", f"fake=http://127.0.0.1:{fake_port}"], env=env))
        _wait_http(f"http://127.0.0.1:{router_port}/health")
        _wait_models(f"http://127.0.0.1:{router_port}/v1/models")
        yield RoutedFake(f"http://127.0.0.1:{fake_port}", f"http://127.0.0.1:{router_port}",
                         procs[0].pid, procs[1].pid)
    finally:
        for p in reversed(procs):
            stop_process(p, timeout=10.0)


def _wait_models(url: str, timeout: float = 20.0) -> None:
    """Until the router lists a model: its static worker's agent has registered it."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=1) as r:
            if json.loads(r.read())["data"]:
                return
        time.sleep(0.05)
    raise TimeoutError("router has no worker")


# --- policy replay ---------------------------------------------------------------------------
@dataclass
class _SimWorker:
    slots: int
    running: int = 0
    queue: list[tuple[float, Placement, int, bool]] = field(default_factory=list)
    cache: OrderedDict[int, int] = field(default_factory=OrderedDict)  # session -> tokens
    cached_tokens: int = 0


def replay(policy: str, *, workers: int = 4, sessions: int = 64, turns: int = 3000,
           rate_per_s: float = 10.0, slots: int = 8, kv_capacity_tokens: int = 200_000,
           max_turns: int = 20, store: bool | None = None, seed: int = 0) -> dict[str, Any]:
    """Simulate multi-turn sessions with Zipf-skewed activity; return TTFT statistics.

    `sessions` conversations run at once; conversation i gets a share of the arrivals
    proportional to 1 / (i + 1)^1.1, and after `max_turns` turns it is replaced by a new one.
    Cost model: prefill 20k tokens/s, a KV restore from the store 4x cheaper than prefill, 2 s
    of decode per request, `slots` concurrent requests per worker, FIFO beyond. A turn adds a
    400-token question and a 300-token answer to a 2000-token system prompt. `store` (default:
    on for `kvkeep` only) lets a moved session restore its KV instead of recomputing it.
    """
    rng = random.Random(seed)
    store = policy == "kvkeep" if store is None else store
    prefill_s, restore_s, decode_s = 1 / 20_000, 1 / 80_000, 2.0
    now = 0.0
    core = RouterCore(build_policy(policy, rng=random.Random(seed)), clock=lambda: now)
    wids = [WorkerId(f"w{i}") for i in range(workers)]
    sim = {w: _SimWorker(slots) for w in wids}
    for w in wids:
        core.add_worker(WorkerInfo(w, f"sim://{w}", ("m",)))
    weights = [1.0 / (i + 1) ** 1.1 for i in range(sessions)]
    context = [2000] * sessions  # system prompt
    generation = [0] * sessions
    turn = [0] * sessions
    binding: dict[int, WorkerId] = {}
    events: list[tuple[float, int, str, Any]] = []
    seq = 0
    for _ in range(turns):
        now += rng.expovariate(rate_per_s)
        heapq.heappush(events, (now, seq, "arrive", rng.choices(range(sessions), weights)[0]))
        seq += 1
    ttft: list[float] = []
    hits = rejected = 0

    def publish(w: WorkerId) -> None:
        s = sim[w]
        core.set_load(w, running=s.running, waiting=len(s.queue),
                      kv_usage=min(1.0, s.cached_tokens / kv_capacity_tokens))

    def cache_put(s: _SimWorker, sid: int, tokens: int) -> None:
        s.cached_tokens += tokens - s.cache.pop(sid, 0)
        s.cache[sid] = tokens
        while s.cached_tokens > kv_capacity_tokens and s.cache:
            _, freed = s.cache.popitem(last=False)
            s.cached_tokens -= freed

    def start(placement: Placement, arrived: float, sid: int, restore: bool) -> None:
        nonlocal seq, hits
        s = sim[placement.worker]
        s.running += 1
        have = s.cache.get(sid, 0)
        ctx = context[sid] + 400
        if have:
            hits += 1
            cost = (ctx - have) * prefill_s
        elif restore and store:
            cost = context[sid] * restore_s + 400 * prefill_s
        else:
            cost = ctx * prefill_s
        ttft.append(now - arrived + cost)
        context[sid] = ctx + 300
        cache_put(s, sid, context[sid])
        heapq.heappush(events, (now + cost + decode_s, seq, "finish", placement))
        seq += 1

    while events:
        now, _, kind, arg = heapq.heappop(events)
        if kind == "arrive":
            slot = int(arg)
            turn[slot] += 1
            if turn[slot] > max_turns:  # the conversation ends; a new one takes its place
                turn[slot], context[slot] = 1, 2000
                generation[slot] += 1
                binding.pop(slot, None)
            sid = slot
            # Chunk keys of the conversation so far: what a prefix scorer would match.
            keys = tuple(hash((slot, generation[slot], k)) & 0xFFFFFFFF
                         for k in range(context[sid] // 500))
            req = RouteRequest("m", SessionId(f"s{slot}.{generation[slot]}"), keys,
                               tokens=context[sid] + 400)
            try:
                d = core.decide(req, binding.get(sid))
            except Saturated:
                rejected += 1
                continue
            placement = Placement(d, None, req)
            core.admit(placement)
            binding[sid] = d.worker
            s = sim[d.worker]
            restore = d.reason in (RouteReason.MIGRATED, RouteReason.FAILOVER)
            if s.running < s.slots:
                start(placement, now, sid, restore)
            else:
                s.queue.append((now, placement, sid, restore))
            publish(d.worker)
        else:
            core.finish(arg, Outcome(ok=True))
            w = arg.worker
            s = sim[w]
            s.running -= 1
            if s.queue:
                arrived, queued, sid, restore = s.queue.pop(0)
                start(queued, arrived, sid, restore)
            publish(w)
    return {"policy": policy, "store": store, "mean_ttft_s": round(statistics.mean(ttft), 3),
            "p99_ttft_s": round(_pct(ttft, 0.99), 3), "cache_hit_rate": round(hits / turns, 3),
            "rejected": rejected}


def plots(result: dict[str, Any]) -> list[RatioPanel]:
    """The router path over the direct one, and each policy's TTFT over round robin's."""
    proxy = result["proxy"]
    overhead = {f"time to last byte {q}": proxy[f"routed_ms_{q}"] / proxy[f"direct_ms_{q}"]
                for q in ("p50", "p99")
                if proxy.get(f"routed_ms_{q}") and proxy.get(f"direct_ms_{q}")}
    replay = result["replay"]
    base = replay["round-robin"]
    ttft = {f"{policy} {stat}": figures[stat] / base[stat]
            for policy, figures in replay.items() if policy != "round-robin"
            for stat in ("mean_ttft_s", "p99_ttft_s") if base.get(stat) and stat in figures}
    return [RatioPanel("proxy: through the router over straight to the server", overhead,
                       baseline="direct", better="lower"),
            RatioPanel("policy replay: TTFT over round robin's", ttft,
                       baseline="round robin", better="lower")]


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("router", measure, as_json, argv, plots=plots)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    decisions = 20_000 if args.quick else 100_000
    requests = 1280 if args.quick else 6400
    result: dict[str, Any] = {}
    progress(f"decision latency: {decisions} decisions, 100k sessions, 64 workers")
    dl = decision_latency(decisions=decisions)
    result["decision_us"] = {"p50": dl["p50"], "p99": dl["p99"]}
    result["place_us"] = {"p50": dl["place_p50"], "p99": dl["place_p99"]}
    result["sessions"], result["workers"] = dl["sessions"], dl["workers"]
    progress(f"proxy overhead: {requests} streams, direct and through a router")
    result["proxy"] = proxy_overhead(requests=requests)
    turns = 3000 if args.quick else 10_000
    result["replay"] = {}
    for policy in ("round-robin", "session-only", "least-loaded", "llm-d", "kvkeep"):
        progress(f"policy replay: {policy}, {turns} turns")
        result["replay"][policy] = replay(policy, turns=turns)
    progress(f"policy replay: kvkeep without the store, {turns} turns")
    result["replay"]["kvkeep-no-store"] = replay("kvkeep", turns=turns, store=False)
    return result


if __name__ == "__main__":
    sys.exit(main())
