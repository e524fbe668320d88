"""Reading the load generators' own JSON into one summary shape.

- inference-perf 0.7: `summary_lifecycle_metrics.json` and `stage_N_lifecycle_metrics.json`
  (times in seconds; `successes` / `failures`), `per_request_lifecycle_metrics.json` for the
  timeline of a kill run (perf_counter times: CLOCK_MONOTONIC on Linux, the clock the kill is
  stamped with here).
- aiperf 0.13: `profile_export_aiperf.json` (times in ms; `request_count` counts successes,
  `error_request_count`, present only when some failed, the errors).

Nothing is computed that the tool did not report, except unit conversion and the cached
fraction (cached / prompt tokens, both as the tool got them from the server's usage).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import KVKeepError

__all__ = ["LoadSummary", "StageSummary", "TimelinePoint", "ToolOutputError",
           "parse_inference_perf", "parse_inference_perf_stage", "parse_aiperf",
           "read_inference_perf", "read_aiperf", "read_timeline"]


class ToolOutputError(KVKeepError):
    """A load generator's output is missing or not what this version of the tool writes."""


@dataclass(frozen=True, slots=True)
class LoadSummary:
    tool: str
    requests: int
    successes: int
    errors: int
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    output_tok_s: float | None
    requests_per_s: float | None
    prompt_tokens: float | None
    cached_prompt_tokens: float | None

    @property
    def cached_fraction(self) -> float | None:
        if not self.prompt_tokens or self.cached_prompt_tokens is None:
            return None
        return self.cached_prompt_tokens / self.prompt_tokens

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["cached_fraction"] = self.cached_fraction
        return out


@dataclass(frozen=True, slots=True)
class StageSummary:
    stage: int
    requested_rate: float | None
    achieved_rate: float | None
    load: LoadSummary

    def as_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "requested_rate": self.requested_rate,
                "achieved_rate": self.achieved_rate, **self.load.as_dict()}


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    start_s: float
    """Monotonic clock (seconds) when the request was sent."""
    ttft_s: float | None
    """None: the request failed or produced no token."""
    session: str | None


def _get(doc: dict[str, Any], *path: str) -> Any:
    node: Any = doc
    for key in path:
        if not isinstance(node, dict) or key not in node:
            raise ToolOutputError(f"expected field {'.'.join(path)!r} in the tool's JSON")
        node = node[key]
    return node


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def parse_inference_perf(doc: dict[str, Any]) -> LoadSummary:
    """A `summary_lifecycle_metrics.json` (or one stage's file: the same shape)."""
    successes = int(_get(doc, "successes", "count"))
    failures = int(_get(doc, "failures", "count"))
    ttft: dict[str, Any] | None = None
    throughput: dict[str, Any] = {}
    prompt: dict[str, Any] = {}
    if successes:
        ttft = _get(doc, "successes", "latency", "time_to_first_token")
        throughput = _get(doc, "successes", "throughput")
        prompt = doc["successes"].get("prompt_tokens") or {}
    return LoadSummary(
        tool="inference-perf", requests=successes + failures, successes=successes,
        errors=failures,
        ttft_mean_s=_opt_float(ttft["mean"]) if ttft else None,
        ttft_p50_s=_opt_float(ttft["median"]) if ttft else None,
        ttft_p90_s=_opt_float(ttft["p90"]) if ttft else None,
        ttft_p99_s=_opt_float(ttft["p99"]) if ttft else None,
        output_tok_s=_opt_float(throughput.get("output_tokens_per_sec")),
        requests_per_s=_opt_float(throughput.get("requests_per_sec")),
        prompt_tokens=_opt_float(prompt.get("total")),
        cached_prompt_tokens=_opt_float(prompt.get("cached")))


def parse_inference_perf_stage(doc: dict[str, Any], stage: int) -> StageSummary:
    load = doc.get("load_summary") or {}
    return StageSummary(stage, _opt_float(load.get("requested_rate")),
                        _opt_float(load.get("achieved_rate")), parse_inference_perf(doc))


def _metric(doc: dict[str, Any], name: str, stat: str = "avg") -> float | None:
    entry = doc.get(name)
    if not isinstance(entry, dict) or entry.get(stat) is None:
        return None
    value = float(entry[stat])
    return value / 1000.0 if entry.get("unit") == "ms" else value


def parse_aiperf(doc: dict[str, Any]) -> LoadSummary:
    """A `profile_export_aiperf.json`."""
    if "request_count" not in doc and "error_request_count" not in doc:
        raise ToolOutputError("expected 'request_count' or 'error_request_count' in aiperf's "
                              "profile export")
    successes = int(_metric(doc, "request_count") or 0)
    errors = int(_metric(doc, "error_request_count") or 0)
    if not errors and isinstance(doc.get("error_summary"), list):
        errors = sum(int(e.get("count", 0)) for e in doc["error_summary"])
    return LoadSummary(
        tool="aiperf", requests=successes + errors, successes=successes, errors=errors,
        ttft_mean_s=_metric(doc, "time_to_first_token"),
        ttft_p50_s=_metric(doc, "time_to_first_token", "p50"),
        ttft_p90_s=_metric(doc, "time_to_first_token", "p90"),
        ttft_p99_s=_metric(doc, "time_to_first_token", "p99"),
        output_tok_s=_metric(doc, "output_token_throughput"),
        requests_per_s=_metric(doc, "request_throughput"),
        prompt_tokens=_metric(doc, "total_usage_prompt_tokens"),
        cached_prompt_tokens=_metric(doc, "total_usage_prompt_cache_read_tokens"))


def _load(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ToolOutputError(f"{path} is missing: the tool wrote no report "
                              "(see its log beside it)") from exc
    except ValueError as exc:
        raise ToolOutputError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ToolOutputError(f"{path}: expected a JSON object")
    return doc


def read_inference_perf(out_dir: Path) -> tuple[LoadSummary, list[StageSummary]]:
    summary = parse_inference_perf(_load(out_dir / "summary_lifecycle_metrics.json"))
    stages: list[StageSummary] = []
    for path in out_dir.glob("stage_*_lifecycle_metrics.json"):
        match = re.fullmatch(r"stage_(\d+)_lifecycle_metrics\.json", path.name)
        if match:
            stages.append(parse_inference_perf_stage(_load(path), int(match.group(1))))
    return summary, sorted(stages, key=lambda s: s.stage)


def read_aiperf(out_dir: Path) -> LoadSummary:
    return parse_aiperf(_load(out_dir / "profile_export_aiperf.json"))


def read_timeline(out_dir: Path) -> list[TimelinePoint]:
    """Per request: when it was sent and its TTFT (the tool's own `computed_metrics`, else its
    first chunk time), from inference-perf's per-request file."""
    path = out_dir / "per_request_lifecycle_metrics.json"
    try:
        entries = json.loads(path.read_text())
    except (FileNotFoundError, ValueError) as exc:
        raise ToolOutputError(f"{path}: {exc}") from exc
    if not isinstance(entries, list):
        raise ToolOutputError(f"{path}: expected a JSON list")
    points: list[TimelinePoint] = []
    for entry in entries:
        start = float(entry["start_time"])
        info = entry.get("info") or {}
        computed = entry.get("computed_metrics") or {}
        ttft = _opt_float(computed.get("time_to_first_token"))
        if ttft is None:  # computed_metrics off: the first streamed chunk, as the tool saw it
            chunks = (info.get("response_metrics") or {}).get("chunk_times") or []
            ttft = float(chunks[0]) - start if chunks else None
        if entry.get("error"):
            ttft = None
        extra = info.get("extra_info") or {}
        session = extra.get("user_session")
        points.append(TimelinePoint(start, ttft, str(session) if session else None))
    return sorted(points, key=lambda p: p.start_s)
