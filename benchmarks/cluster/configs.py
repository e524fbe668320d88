"""The load generators' own inputs: inference-perf config files and aiperf command lines.

inference-perf reads YAML; JSON is YAML, so the configs are written with `json` and need no
YAML library here. Both tools are given the served model's tokenizer directory, so their token
counts are the engine's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.cluster.plan import AiperfLoad, MultiTurn, SharedPrefix, Stage

__all__ = ["SESSION_HEADER", "inference_perf_config", "shared_prefix_config",
           "multi_turn_config", "aiperf_argv", "write_config"]

SESSION_HEADER = "X-Session-Id"


def _stages(stages: tuple[Stage, ...]) -> list[dict[str, float | int]]:
    return [{"rate": s.rate, "duration": s.duration_s} for s in stages]


def inference_perf_config(data: dict[str, Any], stages: tuple[Stage, ...], *, base_url: str,
                          model_name: str, tokenizer_dir: Path, out_dir: Path, seed: int,
                          session_header: str | None = None) -> dict[str, Any]:
    """A whole inference-perf config: streaming text completions with `ignore_eos` (what llm-d
    runs), Poisson arrivals, summary + per-stage + per-request reports into `out_dir`."""
    api: dict[str, Any] = {"type": "completion", "streaming": True}
    if session_header is not None:
        api["session_id_header_key"] = session_header
    return {
        "api": api,
        "server": {"type": "vllm", "model_name": model_name, "base_url": base_url,
                   "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer_dir)},
        "data": data,
        # One client process: the machine's cores are the workers'. 100 in-flight requests
        # per process is far above what three CPU workers reach, so arrivals stay Poisson.
        "load": {"type": "poisson", "num_workers": 1, "worker_max_concurrency": 100,
                 "base_seed": seed, "stages": _stages(stages)},
        "report": {"request_lifecycle": {
            "summary": True, "per_stage": True, "per_request": True,
            # Timings only: the prompts would make the per-request file megabytes long.
            "per_request_fields": {"request": False, "response": False,
                                   "response_chunks": False, "computed_metrics": True}}},
        "storage": {"local_storage": {"path": str(out_dir)}},
    }


def shared_prefix_config(workload: SharedPrefix, stages: tuple[Stage, ...], **common: Any
                         ) -> dict[str, Any]:
    data = {"type": "shared_prefix", "shared_prefix": {
        "num_groups": workload.groups, "num_prompts_per_group": workload.prompts_per_group,
        "system_prompt_len": workload.system_tokens, "question_len": workload.question_tokens,
        "output_len": workload.output_tokens, "seed": workload.seed}}
    return inference_perf_config(data, stages, seed=workload.seed, **common)


def multi_turn_config(workload: MultiTurn, stages: tuple[Stage, ...], **common: Any
                      ) -> dict[str, Any]:
    """Sessions named by `X-Session-Id` (inference-perf's `session_id_header_key`)."""
    data = {"type": "shared_prefix", "shared_prefix": {
        "num_groups": workload.groups, "num_prompts_per_group": workload.sessions_per_group,
        "system_prompt_len": workload.system_tokens, "question_len": workload.question_tokens,
        "output_len": workload.output_tokens, "seed": workload.seed,
        "enable_multi_turn_chat": True}}
    return inference_perf_config(data, stages, seed=workload.seed,
                                 session_header=SESSION_HEADER, **common)


def aiperf_argv(executable: Path, load: AiperfLoad, *, base_url: str, model_name: str,
                tokenizer_dir: Path, out_dir: Path) -> list[str]:
    """`aiperf profile` with its shared-prefix pool on streaming completions, `ignore_eos`."""
    return [
        str(executable), "profile",
        "--model", model_name, "--url", base_url, "--endpoint-type", "completions",
        "--streaming", "--tokenizer", str(tokenizer_dir),
        "--num-prefix-prompts", str(load.prefixes),
        "--prefix-prompt-length", str(load.prefix_tokens),
        "--isl", str(load.question_tokens), "--osl", str(load.output_tokens),
        "--extra-inputs", "ignore_eos:true",
        "--request-rate", str(load.rate), "--arrival-pattern", "poisson",
        "--request-count", str(load.requests), "--random-seed", str(load.seed),
        "--artifact-dir", str(out_dir), "--ui-type", "none", "--workers-max", "1",
    ]


def write_config(config: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path
