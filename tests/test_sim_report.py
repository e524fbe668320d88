"""The report has the keys the issue asks for, computed from real (small) simulations, and
the plots are written."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.sim.__main__ import quick_ladder
from benchmarks.sim.cluster import Kill, Simulation
from benchmarks.sim.params import load_params
from benchmarks.sim.plots import failover_plot, ladder_plots
from benchmarks.sim.report import calibration, failover_block, policy_block, summary
from benchmarks.sim.router_adapter import load_policies
from benchmarks.sim.workloads import ChatWorkload, SharedPrefixWorkload


def test_report_keys_and_plots(tmp_path: Path) -> None:
    params = load_params().with_overrides("engine", kv_tokens=16384, block_size=16)
    specs = load_policies()
    blocks = {}
    for name in ("round_robin", "llmd_precise", "kvkeep", "kvkeep_no_store"):
        wl = SharedPrefixWorkload(groups=8, prompts_per_group=3, system_tokens=600,
                                  question_tokens=80, output_tokens=30,
                                  stages=((4, 2), (3, 2), (10, 2)), vocab=params.model.vocab,
                                  block_size=16)
        result = Simulation(params, specs[name], wl, replicas=2).run()
        blocks[name] = policy_block(result, 0.1)
    assert blocks["round_robin"]["qps"] == [3, 10]
    cal = calibration(blocks)
    for key in ("round_robin_output_tok_s_rel_err", "llmd_precise_output_tok_s_rel_err"):
        assert isinstance(cal[key], float) and cal[key] >= 0
    assert set(cal["round_robin_per_rate"]) == {"3", "10"}
    summ = summary(blocks)
    for key in ("kvkeep_vs_round_robin_goodput", "kvkeep_vs_llmd_goodput",
                "kvkeep_min_ratio_vs_llmd_per_qps", "store_adds_goodput_kvkeep"):
        assert key in summ
    for block in blocks.values():
        for key in ("qps", "output_tok_s", "ttft_p50_s", "ttft_p90_s", "goodput_tok_s"):
            assert len(block[key]) == 2
    runs = []
    for store in (True, False):
        wl2 = ChatWorkload(sessions=10, session_rate=4.0, turns=3, system_tokens=300,
                           user_tokens=60, output_tokens=60, think_s=1.0,
                           vocab=params.model.vocab, block_size=16)
        spec = specs["kvkeep"]
        runs.append(Simulation(params, spec, wl2, replicas=2, kills=[Kill(3.0, (0,))],
                               store=store).run())
    fo = failover_block(runs[0], runs[1])
    for key in ("affected_sessions", "lost_sessions", "ttft_p99_affected_with_restore_s",
                "ttft_p99_affected_recompute_s"):
        assert key in fo
    assert fo["affected_sessions"] > 0 and fo["lost_sessions"] == 0
    json.dumps({"policies": blocks, "calibration": cal, "summary": summ, "failover": fo})
    paths = ladder_plots(blocks, tmp_path, "test")
    paths.append(failover_plot([("with", runs[0]), ("without", runs[1])], tmp_path))
    for p in paths:
        assert Path(p).stat().st_size > 1000 and Path(p).read_bytes()[:4] == b"\x89PNG"


def test_quick_ladder_is_the_published_ladder_halved() -> None:
    ladder = quick_ladder(0.5)
    assert ladder[0] == (7.5, 50)
    assert [r for r, _ in ladder[1:]] == [1.5, 5, 10, 20, 30]
    assert [d for _, d in ladder[1:]] == [20, 20, 38, 38, 25]
