"""The routing policy as a config file: the shipped example, overrides by flags, bad files."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from pathlib import Path

import pytest

from kvstore.commands.kvkeep import build_parser
from kvstore.errors import ConfigError
from kvstore.keys import SessionId
from router.commands import config_from_args
from router.config import RouterConfig
from router.decision import RouteRequest
from router.filters import GpuFilter, KVThresholdFilter, QueueThresholdFilter
from router.limits import Limits
from router.membership.workers import WorkerId, WorkerInfo, WorkerLoad, WorkerPool
from router.policy import Thresholds, policy_preset
from router.policy_file import load_policy_file, resolve_policy
from router.scheduler import Scheduler
from router.scorers import LoadAwareScorer

EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "router" / "policy.yaml"


def _write(tmp_path: Path, text: str, name: str = "policy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _config(*flags: str) -> RouterConfig:
    return config_from_args(build_parser().parse_args(["router", "serve", *flags]))


def test_the_shipped_example_spells_out_the_default_policy() -> None:
    given = load_policy_file(EXAMPLE)
    assert given.resolve() == policy_preset("kvkeep")
    # every threshold is in it, so it documents them all
    assert set(given.thresholds) == {f.name for f in dataclasses.fields(Thresholds)}
    assert given.filters == ("gpu",)
    assert given.session_filters == ("kv-threshold", "queue-threshold")
    assert given.tokenize == {"mode": "worker", "timeout_s": 0.25, "cache_tokens": 16_000_000,
                              "retry_after_s": 10.0}
    assert _config("--policy-config", str(EXAMPLE)).policy == _config().policy
    # and every limit, at its default; an empty allow-list is the loopback default
    assert set(given.limits) == {f.name for f in dataclasses.fields(Limits)}
    assert _config("--policy-config", str(EXAMPLE)).limits == Limits(
        max_sessions_per_tenant=Limits().sessions_per_tenant)
    assert not _config("--policy-config", str(EXAMPLE)).workers_allow.configured
    built = given.resolve().build(random.Random(0))
    assert [type(f) for f in built.soft_filters] == [GpuFilter]
    assert [type(f) for f in built.session_filters] == [KVThresholdFilter,
                                                       QueueThresholdFilter]


def test_a_partial_file_keeps_the_rest_and_its_limits_decide(tmp_path: Path) -> None:
    """The new-session queue limit and the GPU limits, hard-coded before, come from the file
    (JSON here) and change where new sessions go."""
    path = _write(tmp_path, json.dumps({"thresholds": {
        "queue_new_session": 4, "gpu_max_temp_c": 70, "gpu_max_mem_frac": 0.5}}), "p.json")
    spec = load_policy_file(path).resolve()
    base = policy_preset("kvkeep")
    assert spec.scorers == base.scorers and spec.filters == base.filters
    assert spec.thresholds == dataclasses.replace(base.thresholds, queue_new_session=4,
                                                  gpu_max_temp_c=70.0, gpu_max_mem_frac=0.5)
    pool = WorkerPool()
    for wid, temp, mem, running, kv in (("hot", 75.0, 0.1, 0, 0.0), ("full", 40.0, 0.6, 0, 0.0),
                                        ("busy", 40.0, 0.1, 4, 0.0), ("ok", 40.0, 0.1, 3, 0.5)):
        pool.upsert(WorkerInfo(WorkerId(wid), f"http://{wid}", ("m",), gpu_temp_c=temp,
                               gpu_mem_frac=mem)).load = WorkerLoad(running, 0, kv, 0.0)
    sched = Scheduler(pool, spec.build(random.Random(0)))
    picks = {sched.decide(RouteRequest("m", session_id=SessionId(f"s{i}"))).worker
             for i in range(20)}
    assert picks == {"ok"}  # the only one under all three of the file's limits
    # the queue limit is a new-session rule: a stateless request passes only the GPU limits,
    # and busy's free KV outscores ok's shorter queue
    assert {sched.decide(RouteRequest("m")).worker for _ in range(20)} == {"busy"}
    default = Scheduler(pool, base.build(random.Random(0)))
    assert "hot" in {default.decide(RouteRequest("m")).worker for _ in range(40)}


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, """
policy: kvkeep
scorers: [{name: prefix, weight: 1}, {name: load-aware, weight: 2, parameters: {cap: 16}}]
thresholds: {kv_new_session: 0.7, max_waiting: 10}
""")
    spec = _config("--policy-config", str(path), "--kv-threshold", "0.9",
                   "--weights", "prefix=4,queue=1").policy
    assert spec.thresholds.kv_new_session == 0.9 and spec.thresholds.max_waiting == 10
    assert spec.weights == {"prefix": 4.0, "load-aware": 2.0, "queue": 1.0}
    scorers = {s.name: s for s, _ in spec.build().scorers}
    assert isinstance(scorers["load-aware"], LoadAwareScorer) and \
        scorers["load-aware"].cap == 16
    # --policy swaps the preset under the file: its session rules and picker, the file's rest
    swapped = _config("--policy-config", str(path), "--policy", "session-only").policy
    assert (swapped.name, swapped.sticky, swapped.migrate, swapped.picker) == (
        "session-only", True, False, "round-robin")
    assert swapped.thresholds.max_waiting == 10 and swapped.weights["prefix"] == 1.0
    # without a file, the flags alone, as before
    plain = _config("--policy", "llm-d", "--max-waiting", "7").policy
    assert plain == dataclasses.replace(policy_preset("llm-d"),
                                        thresholds=Thresholds(max_waiting=7))
    with pytest.raises(ConfigError, match=r"^policy config command line: thresholds\.max_wait"):
        resolve_policy(thresholds={"max_waiting": 0})


@pytest.mark.parametrize(("text", "names"), [
    ("polic: kvkeep\n", "unknown field `polic`"),
    ("policy: fastest\n", "unknown policy 'fastest'"),
    ("thresholds: {kv_new_sesion: 0.8}\n", "unknown field `kv_new_sesion` - at `$.thresholds`"),
    ("thresholds: {kv_new_session: 1.5}\n", "thresholds.kv_new_session must be in (0, 1]"),
    ("thresholds: {queue_new_session: 2.5}\n", "`$.thresholds.queue_new_session`"),
    ("thresholds: {max_waiting: yes}\n", "`$.thresholds.max_waiting`"),
    ("thresholds: {gpu_max_mem_frac: 0}\n", "thresholds.gpu_max_mem_frac must be in (0, 1]"),
    ("scorers: [{name: prefix, weigth: 1}]\n", "unknown field `weigth` - at `$.scorers[0]`"),
    ("scorers: [{name: queue, weight: 1}, {name: magic, weight: 1}]\n",
     "scorers[1].name: unknown scorer 'magic'"),
    ("scorers: [{name: queue, weight: -2}]\n", "scorers[0].weight: negative weight"),
    ("scorers: [{name: load-aware, weight: 1, parameters: {size: 3}}]\n",
     "scorers[0].parameters.size: load-aware has no parameter 'size'"),
    ("scorers: [{name: load-aware, weight: 1, parameters: {cap: 1.5}}]\n",
     "scorers[0].parameters.cap: 1.5 is not a valid int"),
    ("filters: [kv-threshold, hot]\n", "filters[1]: unknown filter 'hot'"),
    ("picker: best\n", "picker: unknown picker 'best'"),
    ("sessions: {sticky: false}\n", "sessions.migrate needs sessions.sticky"),
    ("sessions: {sticky: maybe}\n", "`$.sessions.sticky`"),
    ("scorers: [oops\n", "policy config"),
    ("- just a list\n", "Expected `object`"),
])
def test_bad_configs_name_the_file_and_key(tmp_path: Path, text: str, names: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_policy_file(path)
    message = str(caught.value)
    assert message.startswith(f"policy config {path}: ")
    assert names in message


def test_a_bad_file_stops_the_router_before_it_serves(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    args = build_parser().parse_args(
        ["router", "serve", "--policy-config", str(tmp_path / "missing.yaml")])
    with caplog.at_level(logging.ERROR):
        assert args.handler(args) == 2
    assert "missing.yaml: cannot read it" in caplog.text
