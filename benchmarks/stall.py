"""Does the store stall vLLM's scheduler? The scheduler half's step time with a slow remote daemon.

    python -m benchmarks.stall --quick --json OUT.json

vLLM asks the connector's scheduler half (`get_num_new_matched_tokens`) about every waiting
request inside `schedule()`, every step. This drives a real `SchedulerSide` the way vLLM does:
each step a wave of new requests arrives (32 blocks each, their KV in a real kvstore daemon),
and every waiting request is asked once per step until it has an answer. The daemon sits behind
a loopback link that delivers each call 50 ms late (`deploy.chaos.slow_link`), as a daemon on
a loaded or distant node would. Three stores, same blocks:

- `memory`: the blocks in a host tier only: the floor (one dictionary read per block);
- `background`: host tier (empty) + the slow daemon, lookups as the connector does them now
  (network tiers on the lookup thread, vLLM told to ask again);
- `inline`: the same store with the lookup done inside the step, as the connector did before
  (what a 50 ms daemon costs every step that has a new request).

Reported per store: the step time p50/p99 (ms), the steps until each request had its answer,
and the answer itself (the blocks found, which must be the same for all three). Ratios are to
the `memory` floor measured in the same run. Issue 18's target: step p99 <= 2 ms with the slow
store.

Then the engine part (`benchmarks/engine_stall.py`, skipped with `--scheduler-only`): decode
ITL on a real engine beside requests restoring from the slow daemon, per `load_mode`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.cli import run_benchmark
from benchmarks.engine_stall import measure_engine
from benchmarks.processes import bench_daemon, slow_link_process
from benchmarks.progress import progress
from connectors.vllm.config import ConnectorConfig
from connectors.vllm.scheduler_side import SchedulerSide
from connectors.vllm.stats import Counts
from kvstore.frame import CodecId, Compression, DType, build_frame
from kvstore.keys import BlockKey, ModelFingerprint, Namespace
from kvstore.store import TieredStore
from kvstore.tiers.base import Tier
from kvstore.tiers.factory import RemoteSpec, build_tiers
from kvstore.tiers.memory.host import HostTier

__all__ = ["main"]

BLOCK_SIZE = 16
BLOCKS_PER_REQUEST = 32
DELAY_S = 0.050
FP = ModelFingerprint("bench/stall", "w", "bfloat16", 2, 2, 32, BLOCK_SIZE, "cpu/tnhd", "raw")
NS = Namespace("default")


@dataclass
class _Arrival:
    """What the scheduler half reads of a vLLM `Request`."""

    request_id: str
    block_hashes: list[bytes]
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    skip_reading_prefix_cache: bool = False
    answered_at_step: int | None = None
    tokens: int | None = None
    all_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.block_hashes) * BLOCK_SIZE + 1


def _arrivals(waves: int, per_wave: int) -> list[list[_Arrival]]:
    return [[_Arrival(f"w{w}r{r}", [bytes([w, r, b % 256, b // 256]) * 8
                                    for b in range(BLOCKS_PER_REQUEST)])
             for r in range(per_wave)] for w in range(waves)]


def _frames(waves: list[list[_Arrival]]) -> list[tuple[BlockKey, bytes]]:
    segment = bytes(4096)  # the bytes do not matter here: only whether the daemon holds them
    out = []
    for wave in waves:
        for arrival in wave:
            # Every second request's KV is held for its first half only: a partial hit.
            held = BLOCKS_PER_REQUEST if int(arrival.request_id.split("r")[1]) % 2 == 0 \
                else BLOCKS_PER_REQUEST // 2
            for h in arrival.block_hashes[:held]:
                key = BlockKey.of(FP, NS, h)
                out.append((key, build_frame(
                    [(segment, Compression.NONE, len(segment))] * 2, codec=CodecId.RAW,
                    dtype=DType.BFLOAT16, layout_id="cpu/tnhd", token_count=BLOCK_SIZE,
                    layer_shape=(2, len(segment) // 4), key_digest=key.digest)))
    return out


def _drive(side: SchedulerSide, waves: list[list[_Arrival]]) -> dict[str, Any]:
    """Steps of vLLM's loop: a wave arrives every step; every waiting request is asked."""
    waiting: list[_Arrival] = []
    steps_ms: list[float] = []
    step = 0
    while step < len(waves) or waiting:
        if step < len(waves):
            waiting.extend(waves[step])
        started = time.perf_counter()
        still = []
        for arrival in waiting:
            tokens, _ = side.get_num_new_matched_tokens(arrival, 0)  # type: ignore[arg-type]
            if tokens is None:
                still.append(arrival)
            else:
                arrival.tokens, arrival.answered_at_step = tokens, step
        steps_ms.append((time.perf_counter() - started) * 1e3)
        waiting = still
        step += 1
        time.sleep(0.002)  # the forward pass a real step spends between schedules
    answered = [a for wave in waves for a in wave]
    wait_steps = [a.answered_at_step - int(a.request_id[1:].split("r")[0])  # type: ignore[operator]
                  for a in answered]
    return {"steps": len(steps_ms),
            "step_ms_p50": round(statistics.median(steps_ms), 3),
            "step_ms_p90": round(_pct(steps_ms, 0.90), 3),
            "step_ms_p99": round(_pct(steps_ms, 0.99), 3),
            "step_ms_max": round(max(steps_ms), 3),
            "steps_to_answer_max": max(wait_steps),
            "blocks_found": sum((a.tokens or 0) // BLOCK_SIZE for a in answered)}


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _side(store: TieredStore, *, inline: bool) -> SchedulerSide:
    config = ConnectorConfig.from_extra({"store": {"host_bytes": 1},
                                         "restore_deadline_ms": 2000})
    side = SchedulerSide(config=config, fingerprint=FP, store=store, block_size=BLOCK_SIZE,
                         num_layers=2, counters=Counts())
    if inline and side._background is not None:
        # The connector before issue 18: the whole lookup inside the step.
        side._background.close()
        side._background = None
    return side


def measure(args: argparse.Namespace) -> dict[str, Any]:
    waves_n, per_wave = (20, 8) if args.quick else (60, 16)
    results: dict[str, Any] = {"delay_ms": DELAY_S * 1e3, "waves": waves_n,
                               "requests_per_wave": per_wave,
                               "blocks_per_request": BLOCKS_PER_REQUEST}
    with tempfile.TemporaryDirectory() as tmp, \
            bench_daemon(Path(tmp) / "d", mem_budget="512MiB", disk_budget="1GiB") as (addr, _):
        # The link runs in a process of its own: its pump threads must not take this
        # process's GIL from the scheduler being measured (a real daemon is elsewhere too).
        link, link_address = slow_link_process(addr, DELAY_S)
        frames = _frames(_arrivals(waves_n, per_wave))
        direct = TieredStore(build_tiers([RemoteSpec(daemons=(("d1", addr),), replicas=1)]))
        try:
            for key, frame in frames:
                # The daemon refuses puts while its disk falls behind (never acknowledging a
                # copy it dropped): give it a moment and send again.
                for _ in range(200):
                    if direct.put(key, frame):
                        break
                    time.sleep(0.05)
                else:
                    raise RuntimeError("the daemon kept refusing puts")
            assert direct.flush(60)
        finally:
            direct.close()
        progress(f"{len(frames)} blocks stored in the daemon")
        try:
            for name in ("memory", "background", "inline"):
                tiers: list[Tier] = [HostTier(256 << 20, page_bytes=16 << 10)]
                if name == "memory":
                    for key, frame in frames:
                        tiers[0].put(key, frame)
                else:
                    tiers += build_tiers([RemoteSpec(daemons=(("d1", link_address),),
                                                     replicas=1, timeout_s=2.0)])
                store = TieredStore(tiers)
                # Connections to the daemon open at start-up in a real engine, not on the
                # first request: open them before measuring.
                store.lookup([BlockKey.of(FP, NS, bytes(32))])
                side = _side(store, inline=name == "inline")
                try:
                    results[name] = _drive(side, _arrivals(waves_n, per_wave))
                finally:
                    side.shutdown()
                    store.close()
                progress(f"{name}: {results[name]}")
        finally:
            link.terminate()
            link.join(10)
    floor = results["memory"]["step_ms_p99"]
    results["scheduler_step_p99_ms_slow_store"] = results["background"]["step_ms_p99"]
    results["scheduler_step_p99_ms_inline_slow_store"] = results["inline"]["step_ms_p99"]
    results["step_p99_ratio_background_to_memory"] = round(
        results["background"]["step_ms_p99"] / floor, 2)
    results["step_p99_ratio_inline_to_memory"] = round(results["inline"]["step_ms_p99"] / floor, 2)
    results["same_answers"] = len({results[n]["blocks_found"]
                                   for n in ("memory", "background", "inline")}) == 1
    results["target_step_p99_ms"] = 2.0
    results["meets_target"] = results["scheduler_step_p99_ms_slow_store"] <= 2.0
    if not args.scheduler_only:
        progress("the engine part: decode ITL beside restores from the slow daemon")
        results["engine_part"] = measure_engine(args.quick)
        for name in ("itl_p99_ratio_slow_store", "itl_p99_ratio_slow_store_sync",
                     "itl_p99_ratio_recompute", "itl_p99_ratio_dead_store",
                     "outputs_identical"):
            results[name] = results["engine_part"][name]
        results["target_itl_p99_ratio"] = 1.15
    return results


def render(results: dict[str, Any]) -> str:
    lines = [f"scheduler step time, {results['requests_per_wave']} new requests a step, "
             f"daemon {results['delay_ms']:.0f} ms away"]
    for name in ("memory", "background", "inline"):
        r = results[name]
        lines.append(f"  {name:10s} p50 {r['step_ms_p50']:8.3f} ms  p99 {r['step_ms_p99']:8.3f} ms"
                     f"  answered within {r['steps_to_answer_max']} steps, "
                     f"{r['blocks_found']} blocks found")
    lines.append(f"  same answers: {results['same_answers']}; target p99 <= 2 ms: "
                 f"{results['meets_target']}")
    if "engine_part" in results:
        for arm, r in results["engine_part"]["engine"].items():
            lines.append(f"  engine {arm:9s} decode ITL p50 {r['itl_ms_p50']:8.2f} ms  p99 "
                         f"{r['itl_ms_p99']:8.2f} ms  arrivals' TTFT {r['arrival_ttft_s']}")
        lines.append(f"  ITL p99 / alone: auto {results['itl_p99_ratio_slow_store']}, sync "
                     f"{results['itl_p99_ratio_slow_store_sync']}, recompute "
                     f"{results['itl_p99_ratio_recompute']} (target <= 1.15 with auto)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    def flags(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--scheduler-only", action="store_true",
                            help="skip the engine part (four vLLM engines, ~3 minutes)")

    return run_benchmark("stall", measure, render, argv, extra_args=flags)


if __name__ == "__main__":
    raise SystemExit(main())
