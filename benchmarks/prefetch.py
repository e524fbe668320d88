"""Prefetch on the failover hint: the next turn's TTFT on the new worker, with and without.

    python -m benchmarks.prefetch --quick --json OUT.json

A session's worker dies; the router rebinds the session to a survivor, and the session's next
turn arrives `--pause` seconds later (2 s). The survivor's connector restores the session's
KV from the store either way; what differs is where it lies when the turn arrives:

- `without`: on the kvstore daemon only. The turn's lookup and load go to the daemon, which sits
  behind a loopback link that delivers each call `--delay-ms` late (50 ms: a daemon on a loaded
  or distant node; `deploy.chaos.slow_link`);
- `with`: in the survivor's host RAM, pulled there on the router's hint
  (`connectors.vllm.prefetch`), written by the router's own `SessionTable.bind` exactly as the
  failover's rebinding writes it.

Real parts: an etcd, a `kvstore.daemon` registered in it (advertising the slow link, its TCP
data plane off so every byte crosses the link), and two in-process vLLM engines on a dummy-
weight Llama (hidden 1024, 8 layers with --quick): the "old" worker computes each session's
first turn and checkpoints it (blocks and manifest) to the daemon, then goes away; the
survivor serves every second turn. Sessions alternate between the arms, so drift in the
machine's speed hits both. Also measured in the same run: each second turn again with its KV
in host RAM (`host`: the best a prefetch can do), each recomputed with no restore
(`recompute`: what the store must beat), the greedy outputs of every arm against the
recompute (`outputs_identical`), and the machine's loopback TCP (`baseline`).

Writes {"ttft_s": {"with": [...], "without": [...], "host": [...], "recompute": [...]},
"prefetch_ttft_ratio": median(with) / median(without), "restored_tokens": {...},
"prefetched_blocks": n, "outputs_identical": bool, "link_delay_ms": d, ...}.
Target (issue 18): prefetch_ttft_ratio <= 0.7.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.baselines import tcp_loopback_gbps
from benchmarks.cli import as_json, run_benchmark
from benchmarks.processes import bench_daemon, free_port, slow_link_process
from benchmarks.progress import progress
from benchmarks.restore import BLOCK, bench_model, generate, kv_config, random_prompts, vllm_engine
from deploy.local.services import start_etcd
from kvstore.keys import ModelFingerprint, Namespace, SessionId, SessionKey
from kvstore.store import TieredStore
from kvstore.tiers.factory import RemoteSpec, build_tiers

__all__ = ["main", "run"]

SURVIVOR = "survivor"
ROUTER_PREFIX = "/kvkeep"
NEW_TOKENS = 32  # the next turn's own tokens, after the first turn's prompt and answer


def _rebind(etcd_url: str, session: str, to: str) -> None:
    """The failover's rebinding of `session` onto worker `to`, as the winning router writes it
    (router/membership/failover.py -> SessionTable.bind, prefetch hint included)."""
    from router.membership.workers import WorkerId
    from router.state.etcd import EtcdBackend
    from router.state.sessions import SessionTable

    async def run() -> None:
        backend = EtcdBackend(etcd_url, ROUTER_PREFIX)
        await backend.start()
        try:
            won, _ = await SessionTable(backend, 600.0).bind(
                SessionId(session), WorkerId(to), "bench", expected=None, reason="failover",
                restore_from=WorkerId("old"), prefetch=True)
            if not won:
                raise RuntimeError(f"the rebinding of {session} lost its compare-and-swap")
        finally:
            await backend.close()
    asyncio.run(run())


def _connector() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def _wait_checkpointed(daemon: str, fp: ModelFingerprint, sessions: Sequence[str],
                       blocks: int, step: Callable[[], object], timeout_s: float = 120.0
                       ) -> None:
    """Until every session's manifest on the daemon names its `blocks` full blocks. `step`
    runs an engine step: saves are confirmed, and manifests written, in the steps after the
    one that computed them, and an in-process engine steps only inside a generate."""
    store = TieredStore(build_tiers([RemoteSpec(daemons=(("bench", daemon),), replicas=1)]))
    try:
        deadline = time.monotonic() + timeout_s
        for session in sessions:
            key = SessionKey.of(fp, Namespace("default"), session)
            while True:
                manifest = store.get_manifest(key)
                if manifest is not None and len(manifest.block_hashes) >= blocks:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"session {session} not checkpointed after "
                                       f"{timeout_s:.0f} s")
                step()
                time.sleep(0.05)
    finally:
        store.close()


def run(*, quick: bool, context: int = 2048, sessions_per_arm: int | None = None,
        pause_s: float = 2.0, delay_ms: float = 50.0, hidden: int = 1024,
        layers: int | None = None) -> dict[str, Any]:
    layers = layers or (8 if quick else 16)
    per_arm = sessions_per_arm or (3 if quick else 6)
    names = [f"s{i}" for i in range(2 * per_arm)]
    arms = {name: ("with" if i % 2 else "without") for i, name in enumerate(names)}
    first = dict(zip(names, random_prompts(len(names), context, seed=7), strict=True))
    engine_kwargs = {"load_format": "dummy", "skip_tokenizer_init": True,
                     "max_model_len": context + 2 * NEW_TOKENS + 64,
                     "kv_cache_memory_bytes": 1 << 30,
                     "max_num_batched_tokens": max(4096, context + 2 * NEW_TOKENS + 64)}
    results: dict[str, Any] = {"context_tokens": context, "link_delay_ms": delay_ms,
                               "pause_s": pause_s, "sessions_per_arm": per_arm,
                               "baseline": {"loopback_tcp_gbps": round(tcp_loopback_gbps(), 2)}}
    with tempfile.TemporaryDirectory(prefix="kvkeep-prefetch-") as tmp_name:
        tmp = Path(tmp_name)
        model = tmp / "model"
        results["model"] = bench_model(model, hidden, layers)
        port = free_port()
        link, link_address = slow_link_process(f"127.0.0.1:{port}", delay_ms / 1000)
        try:
            with start_etcd(tmp) as etcd, bench_daemon(
                    tmp / "daemon", mem_budget="4GiB", disk_budget="8GiB", port=port,
                    extra=["--etcd", etcd.url, "--advertise", link_address,
                           "--data-listen", "off"]) as (direct, _):
                remote = {"etcd": etcd.url, "replicas": 1, "timeout_ms": 10000}
                progress("the old worker: first turns, checkpointed to the daemon")
                second: dict[str, list[int]] = {}
                with vllm_engine(model, kv_config({"host_bytes": 1 << 30, "remote": remote,
                                                   "name": "old"}), **engine_kwargs) as llm:
                    fingerprint = _connector().fingerprint
                    for name in names:
                        (answer,), _ = generate(llm, [first[name]], 1, {"session_id": name})
                        second[name] = [*first[name], *answer,
                                        *random_prompts(1, NEW_TOKENS, seed=hash(name) % 1000)[0]]
                    filler = random_prompts(1, 8, seed=99)
                    _wait_checkpointed(direct, fingerprint, names, context // BLOCK,
                                       lambda: generate(llm, filler, 1))
                progress("the survivor: every next turn, hinted or not")
                ttft: dict[str, list[float]] = {"with": [], "without": [], "host": [],
                                                "recompute": []}
                restored: dict[str, list[int]] = {"with": [], "without": []}
                outputs: dict[str, tuple[int, ...]] = {}
                with vllm_engine(model, kv_config(
                        {"host_bytes": 1 << 30, "remote": remote, "name": "survivor"},
                        prefetch={"worker_id": SURVIVOR, "prefix": ROUTER_PREFIX}),
                        **engine_kwargs) as llm:
                    prefetcher = _connector().prefetcher
                    if prefetcher is None or not prefetcher.wait_synced(15.0):
                        raise RuntimeError("the survivor's prefetch did not start")
                    for name in names:
                        # Both arms' sessions are rebound the same way; only the hint's
                        # worker differs (the "without" one goes to a worker that is not
                        # there, so nobody prefetches it).
                        _rebind(etcd.url, name, SURVIVOR if arms[name] == "with"
                                else "elsewhere")
                        time.sleep(pause_s)
                        params = {"session_id": name, "restore_reason": "failover",
                                  "previous_worker": "old"}
                        start = time.perf_counter()
                        (out,), (cached,) = generate(llm, [second[name]], 1, params)
                        ttft[arms[name]].append(time.perf_counter() - start)
                        restored[arms[name]].append(cached)
                        outputs[name] = out
                    counts = dict(_connector().counters().as_dict())
                    results["prefetched_blocks"] = int(counts.get("prefetch_blocks", 0))
                    results["prefetch_missing"] = int(counts.get("prefetch_missing", 0))
                    progress("the host floor: each next turn again, its KV in host RAM")
                    for name in names:
                        llm.reset_prefix_cache()
                        start = time.perf_counter()
                        generate(llm, [second[name]], 1)
                        ttft["host"].append(time.perf_counter() - start)
                    progress("the floor: each next turn recomputed, nothing restored")
                    identical = True
                    for name in names:
                        llm.reset_prefix_cache()
                        start = time.perf_counter()
                        (out,), (cached,) = generate(llm, [second[name]], 1, {"restore": "none"})
                        ttft["recompute"].append(time.perf_counter() - start)
                        identical = identical and out == outputs[name] and cached == 0
        finally:
            link.terminate()
            link.join(10)
    med = {arm: statistics.median(times) for arm, times in ttft.items()}
    results.update(
        ttft_s={arm: [round(t, 4) for t in times] for arm, times in ttft.items()},
        ttft_median_s={arm: round(t, 4) for arm, t in med.items()},
        restored_tokens=restored,
        prefetch_ttft_ratio=round(med["with"] / med["without"], 3),
        with_over_recompute=round(med["with"] / med["recompute"], 3),
        without_over_recompute=round(med["without"] / med["recompute"], 3),
        outputs_identical=identical,
        target={"prefetch_ttft_ratio_max": 0.7})
    return results


def main(argv: Sequence[str] | None = None) -> int:
    def shape(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--context", type=int, default=2048)
        parser.add_argument("--sessions", type=int, help="sessions per arm")
        parser.add_argument("--pause", type=float, default=2.0,
                            help="seconds between the rebinding and the next turn")
        parser.add_argument("--delay-ms", type=float, default=50.0,
                            help="the slow link's added latency per call")

    def measure(args: argparse.Namespace) -> dict[str, Any]:
        return run(quick=args.quick, context=args.context, sessions_per_arm=args.sessions,
                   pause_s=args.pause, delay_ms=args.delay_ms)

    return run_benchmark("prefetch", measure, as_json, argv, extra_args=shape)


if __name__ == "__main__":
    sys.exit(main())
