"""The cluster benchmark's pieces that can be checked without its heavy run (3 vLLM workers and
minutes of load): workload sizing, the tools' configs (validated by the installed tools when
their venvs exist), parsing of outputs the tools really wrote (recorded from a benchmark run
into tests/data/cluster/), the summary, plots, and the tool runner's cleanup. No timing asserts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from benchmarks.cluster.configs import (
    SESSION_HEADER,
    aiperf_argv,
    multi_turn_config,
    shared_prefix_config,
    write_config,
)
from benchmarks.cluster.plan import (
    LLMD_PREFIX_FRACTION,
    MODELS,
    MultiTurn,
    Plan,
    Stage,
    full_plan,
    quick_plan,
)
from benchmarks.cluster.plots import write_plots
from benchmarks.cluster.results import (
    ToolOutputError,
    parse_aiperf,
    parse_inference_perf,
    read_aiperf,
    read_inference_perf,
    read_timeline,
)
from benchmarks.cluster.summary import policy_table, ratios, render, render_markdown
from benchmarks.cluster.tools import LoadTools, aiperf_env, inference_perf_env, run_tool
from deploy.local.cluster import REPO_ROOT
from kvstore.errors import ConfigError, DeadlineExceeded, KVKeepError

DATA = Path(__file__).parent / "data" / "cluster"
INFERENCE_PERF = REPO_ROOT / ".venv-inference-perf" / "bin"
AIPERF = REPO_ROOT / ".venv-aiperf" / "bin" / "aiperf"


# --- sizing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("make_plan", [quick_plan, full_plan])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_plans_put_llmd_prefix_pressure_on_the_cluster(make_plan: Any, model: str) -> None:
    plan: Plan = make_plan(model)
    sp = plan.shared_prefix
    cluster_kv = plan.kv_tokens_per_worker * plan.workers
    # The prefixes are llm-d's 73 % of the cluster's KV (up to one block per worker).
    assert abs(LLMD_PREFIX_FRACTION - 0.732) < 0.001
    assert sp.resident_tokens / cluster_kv == pytest.approx(
        LLMD_PREFIX_FRACTION, abs=plan.block_size * plan.workers / cluster_kv)
    # Round robin needs every group's system prompt on every worker, which does not fit;
    # one group per worker's share does.
    assert sp.groups * sp.system_tokens > plan.kv_tokens_per_worker
    assert sp.resident_tokens / plan.workers < plan.kv_tokens_per_worker
    assert plan.kv_tokens_per_worker % plan.block_size == 0
    shape = plan.model
    assert plan.kv_cache_bytes == plan.kv_tokens_per_worker * shape.layers * 2 * \
        shape.kv_heads * (shape.hidden // shape.heads) * 4
    assert plan.multi_turn.longest_prompt(plan.multi_turn_stages) < plan.max_model_len


def test_plan_refuses_sessions_that_outgrow_the_model() -> None:
    plan = quick_plan()
    long_sessions = MultiTurn(groups=1, sessions_per_group=2, system_tokens=400,
                              question_tokens=100, output_tokens=50)
    with pytest.raises(ConfigError, match="max_model_len"):
        replace(plan, multi_turn=long_sessions, multi_turn_stages=(Stage(1.0, 20),))
    with pytest.raises(ConfigError):
        replace(plan, kill_worker="w9")
    with pytest.raises(ConfigError):
        replace(plan, workers=1)
    with pytest.raises(ConfigError):
        Stage(0.0, 10)


# --- the tools' inputs ----------------------------------------------------------------------
def _common(tmp_path: Path) -> dict[str, Any]:
    return {"base_url": "http://127.0.0.1:1", "model_name": "tiny",
            "tokenizer_dir": tmp_path / "tok", "out_dir": tmp_path / "out"}


def test_configs_say_what_llmd_runs(tmp_path: Path) -> None:
    plan = quick_plan()
    sp = shared_prefix_config(plan.shared_prefix, plan.shared_prefix_stages, **_common(tmp_path))
    assert sp["api"] == {"type": "completion", "streaming": True}
    assert sp["server"]["ignore_eos"] is True
    assert sp["load"]["type"] == "poisson"
    assert [s["rate"] for s in sp["load"]["stages"]] == [s.rate for s in plan.shared_prefix_stages]
    assert sp["data"]["shared_prefix"]["num_groups"] == plan.shared_prefix.groups
    assert "enable_multi_turn_chat" not in sp["data"]["shared_prefix"]
    mt = multi_turn_config(plan.multi_turn, plan.multi_turn_stages, **_common(tmp_path))
    assert mt["api"]["session_id_header_key"] == SESSION_HEADER
    assert mt["data"]["shared_prefix"]["enable_multi_turn_chat"] is True
    # JSON is YAML: inference-perf reads the file as written.
    path = write_config(mt, tmp_path / "mt.yaml")
    assert json.loads(path.read_text()) == mt


def _inference_perf_python() -> Path:
    python = INFERENCE_PERF / "python"
    if not os.access(python, os.X_OK):
        pytest.skip("no .venv-inference-perf (`make bench-cluster` creates it)")
    return python


def test_inference_perf_accepts_the_configs(tmp_path: Path) -> None:
    """Both configs pass the installed inference-perf's own schema (pydantic, strict)."""
    python = _inference_perf_python()
    plan = full_plan()
    paths = [
        write_config(shared_prefix_config(plan.shared_prefix, plan.shared_prefix_stages,
                                          **_common(tmp_path)), tmp_path / "sp.yaml"),
        write_config(multi_turn_config(plan.multi_turn, plan.multi_turn_stages,
                                       **_common(tmp_path)), tmp_path / "mt.yaml"),
    ]
    check = ("import sys\nfrom inference_perf.config import read_config\n"
             "for p in sys.argv[1:]:\n"
             "    c = read_config(p)\n"
             "    print(c.data.type.value, c.load.type.value, c.api.session_id_header_key,"
             " c.data.shared_prefix.enable_multi_turn_chat)\n")
    done = subprocess.run([str(python), "-c", check, *map(str, paths)], capture_output=True,
                          text=True, timeout=120, env=inference_perf_env(), check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()[-2:]
    assert lines == ["shared_prefix poisson None False",
                     f"shared_prefix poisson {SESSION_HEADER} True"]
    # A config the tool would reject is rejected (the check can fail).
    bad = json.loads(paths[0].read_text())
    bad["data"]["shared_prefix"]["no_such_field"] = 1
    write_config(bad, tmp_path / "bad.yaml")
    done = subprocess.run([str(python), "-c", check, str(tmp_path / "bad.yaml")],
                          capture_output=True, text=True, timeout=120, env=inference_perf_env(),
                          check=False)
    assert done.returncode != 0


def test_aiperf_knows_every_flag_we_pass(tmp_path: Path) -> None:
    if not os.access(AIPERF, os.X_OK):
        pytest.skip("no .venv-aiperf (`make bench-cluster` creates it)")
    argv = aiperf_argv(AIPERF, quick_plan().aiperf, **_common(tmp_path))
    assert argv[1] == "profile"
    flags = [a for a in argv[2:] if a.startswith("--")]
    assert {"--num-prefix-prompts", "--prefix-prompt-length", "--streaming"} <= set(flags)
    env = {**aiperf_env(), "COLUMNS": "250"}
    done = subprocess.run([str(AIPERF), "profile", "--help"], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    for flag in flags:
        assert f" {flag} " in done.stdout or f" {flag}\n" in done.stdout, flag


def test_tools_are_found_or_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="make bench-cluster"):
        LoadTools.find(tmp_path / "none", tmp_path / "none2")
    fake = tmp_path / "tool"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert LoadTools.find(fake, fake) == LoadTools(fake, fake)
    assert "HF_HUB_OFFLINE" not in aiperf_env()
    assert inference_perf_env()["HF_HUB_OFFLINE"] == "1"


# --- the tools' outputs (recorded from a real benchmark run) ---------------------------------
def test_reads_inference_perf_reports() -> None:
    summary, stages = read_inference_perf(DATA / "inference-perf")
    raw = json.loads((DATA / "inference-perf" / "summary_lifecycle_metrics.json").read_text())
    assert summary.tool == "inference-perf"
    assert summary.successes == raw["successes"]["count"] > 0
    assert summary.requests == summary.successes + summary.errors
    ttft = raw["successes"]["latency"]["time_to_first_token"]
    assert (summary.ttft_mean_s, summary.ttft_p50_s, summary.ttft_p90_s) == \
        (ttft["mean"], ttft["median"], ttft["p90"])
    assert summary.output_tok_s == raw["successes"]["throughput"]["output_tokens_per_sec"]
    assert summary.cached_fraction == pytest.approx(
        raw["successes"]["prompt_tokens"]["cached"] / raw["successes"]["prompt_tokens"]["total"])
    assert len(stages) >= 2
    assert [s.stage for s in stages] == sorted(s.stage for s in stages)
    assert sum(s.load.requests for s in stages) == summary.requests
    assert all(s.requested_rate and s.requested_rate > 0 for s in stages)


def test_reads_aiperf_export_in_seconds() -> None:
    summary = read_aiperf(DATA / "aiperf")
    raw = json.loads((DATA / "aiperf" / "profile_export_aiperf.json").read_text())
    assert raw["time_to_first_token"]["unit"] == "ms"
    assert summary.ttft_mean_s == pytest.approx(raw["time_to_first_token"]["avg"] / 1000)
    assert summary.ttft_p90_s == pytest.approx(raw["time_to_first_token"]["p90"] / 1000)
    assert summary.successes == raw["request_count"]["avg"]
    assert summary.output_tok_s == raw["output_token_throughput"]["avg"]
    assert summary.requests == summary.successes + summary.errors


def test_failed_requests_are_counted_as_errors() -> None:
    raw = json.loads((DATA / "aiperf" / "profile_export_aiperf.json").read_text())
    raw["error_request_count"] = {"unit": "requests", "avg": 3.0}
    summary = parse_aiperf(raw)
    assert summary.errors == 3
    assert summary.requests == summary.successes + 3
    ip = json.loads((DATA / "inference-perf" / "summary_lifecycle_metrics.json").read_text())
    ip["failures"]["count"] = 2
    assert parse_inference_perf(ip).errors == 2
    # Every request failed: no latency block, no made-up TTFT.
    none_ok = {"successes": {"count": 0}, "failures": {"count": 5}}
    empty = parse_inference_perf(none_ok)
    assert (empty.requests, empty.errors, empty.ttft_mean_s) == (5, 5, None)


def test_malformed_outputs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ToolOutputError, match="missing"):
        read_inference_perf(tmp_path)
    (tmp_path / "profile_export_aiperf.json").write_text("{not json")
    with pytest.raises(ToolOutputError, match="not JSON"):
        read_aiperf(tmp_path)
    with pytest.raises(ToolOutputError, match=r"successes\.count"):
        parse_inference_perf({"failures": {"count": 0}})
    with pytest.raises(ToolOutputError):
        parse_aiperf({"schema_version": "1.4"})


def test_reads_a_kill_runs_per_request_timeline(tmp_path: Path) -> None:
    points = read_timeline(DATA / "inference-perf-kill")
    raw = json.loads((DATA / "inference-perf-kill" / "per_request_lifecycle_metrics.json")
                     .read_text())
    assert len(points) == len(raw)
    assert points == sorted(points, key=lambda p: p.start_s)
    assert all(p.session and p.session.startswith("user_session_") for p in points)
    assert {p.ttft_s for p in points} == {e["computed_metrics"]["time_to_first_token"]
                                          for e in raw}
    # Without computed metrics the first streamed chunk gives (nearly) the same TTFT; a
    # request with an error has none.
    for entry in raw:
        del entry["computed_metrics"]
    raw[0]["error"] = {"error_type": "ClientConnectorError", "error_msg": "refused"}
    (tmp_path / "per_request_lifecycle_metrics.json").write_text(json.dumps(raw))
    fallback = read_timeline(tmp_path)
    failed = [p for p in fallback if p.ttft_s is None]
    assert len(failed) == 1
    by_start = {p.start_s: p.ttft_s for p in points}
    for p in fallback:
        if p.ttft_s is not None:
            assert p.ttft_s == pytest.approx(by_start[p.start_s], abs=0.05)


# --- summary and plots ----------------------------------------------------------------------
def _run(ttft: float, tok_s: float, probe: float = 0.2) -> dict[str, Any]:
    summary = {"requests": 10, "successes": 10, "errors": 0, "ttft_mean_s": ttft,
               "ttft_p50_s": ttft, "ttft_p90_s": 2 * ttft, "ttft_p99_s": 3 * ttft,
               "output_tok_s": tok_s, "requests_per_s": 1.0, "cached_fraction": 0.5}
    stages = [{"requested_rate": r, "achieved_rate": r, **summary} for r in (1.0, 2.0)]
    kill = {"worker": "w2", "at_s": 3.0, "router_noticed_after_s": 2.1,
            "sessions_bound_to_killed_worker": ["user_session_1"],
            "after_kill": {"requests": 4, "failed": 0, "ttft_mean_s": ttft},
            "affected_sessions_after_kill": {"requests": 1, "failed": 0},
            "timeline": [[0.0, ttft, "user_session_0"], [4.0, None, "user_session_1"]]}
    return {"policy": "x", "shared_prefix": {"tool": "inference-perf", "summary": summary,
                                             "stages": stages,
                                             "machine_probe": {"uncached_prefill_s": probe},
                                             "server": {"local_prefix_hit_fraction": 0.4}},
            "multi_turn_kill": {"tool": "inference-perf", "summary": summary, "kill": kill},
            "aiperf_shared_prefix": {"failed": "KVKeepError: boom"}}


def test_summary_reports_ratios_to_round_robin_and_what_the_store_adds(tmp_path: Path) -> None:
    # kvkeep ran while the machine was twice as slow (its probe says so).
    runs = {"round_robin": _run(0.4, 50.0), "kvkeep": _run(0.1, 100.0, probe=0.4),
            "kvkeep_no_store": _run(0.2, 80.0)}
    table = policy_table(runs)
    assert set(table["kvkeep"]) == {"shared_prefix", "multi_turn_kill"}  # failed one left out
    assert table["kvkeep"]["multi_turn_kill"]["kill"]["sessions_bound_to_killed_worker"] == 1
    r = ratios(table)
    assert r["kvkeep_vs_round_robin"]["shared_prefix"] == {
        "ttft_mean": 0.25, "ttft_p90": 0.25, "output_tok_s": 2.0, "ttft_mean_over_probe": 0.125}
    assert table["kvkeep"]["shared_prefix"]["local_prefix_hit_fraction"] == 0.4
    # No probe for a workload: no normalised figure rather than a made-up one.
    assert r["kvkeep_vs_round_robin"]["multi_turn_kill"]["ttft_mean_over_probe"] is None
    assert r["store_adds_kvkeep"]["shared_prefix"]["ttft_mean"] == 0.5
    text = render({"policies": table, "summary": r, "runs": runs})
    assert "FAILED kvkeep aiperf_shared_prefix" in text
    assert "kill w2 at 3.0s" in text
    md = render_markdown({"policies": table}).splitlines()
    assert "| shared_prefix | kvkeep | 10 / 10 | 0 | 0.100 |" in "\n".join(md)
    assert any(line.startswith("| kvkeep | 3.0 s | 2.10 s | 1 | 4 / 0 |") for line in md)
    plots = write_plots({"policies": table, "runs": runs}, tmp_path)
    assert {p.name for p in plots} == {"cluster-policies.png", "cluster-shared-prefix-ladder.png",
                                       "cluster-kill-timeline.png"}
    for p in plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- running a tool -------------------------------------------------------------------------
def _gone(pid: int) -> bool:
    """Not running: no such process, or a zombie waiting for a parent that may never reap it
    (an orphan's new parent in a container is not always a reaping init)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_run_tool_stops_the_whole_group_on_timeout(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    # The tool forks a child that would outlive it: the group is stopped, child included.
    script = f"sleep 60 & echo $! > {pidfile}; wait"
    with pytest.raises(DeadlineExceeded, match="still running"):
        run_tool("sleeper", ["/bin/sh", "-c", script], log_path=tmp_path / "s.log",
                 env=dict(os.environ), timeout_s=1.0)
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child)


def test_run_tool_reports_a_failing_tool_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(KVKeepError, match="exited with 3") as info:
        run_tool("failing", [sys.executable, "-c", "print('no report'); raise SystemExit(3)"],
                 log_path=tmp_path / "f.log", env=dict(os.environ), timeout_s=60)
    assert "no report" in str(info.value)
    assert run_tool("ok", [shutil.which("true") or "/bin/true"], log_path=tmp_path / "t.log",
                    env=dict(os.environ), timeout_s=60) >= 0
