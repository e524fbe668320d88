"""How long one engine step takes: the published models, parameterised by the parameter file.

- NVIDIA Dynamo's mocker (components/backends/mocker): prefill ms = a2 N^2 + a1 N + a0 with
  N the uncached tokens computed in the step, decode ms = d2 u^2 + d1 u + d0 (at least
  `decode_floor_ms`) with u the fraction of KV blocks in use. Its coefficients describe a
  smaller model on one GPU; `prefill_scale` and `decode_scale` (the mocker's `speedup_ratio`,
  one per phase) carry them to the simulated model, and are what calibration fits. A step that
  both prefills and decodes is one forward pass over both: it costs the sum.
- llm-d-inference-sim: prefill = overhead + N x per-token, decode = ITL, and every term is
  multiplied by 1 + (F - 1)(running - 1)/(max_num_seqs - 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.sim.params import EngineParams, TimingParams

__all__ = ["StepWork", "step_seconds"]


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one step computes: `prefill_tokens` uncached prompt tokens (over all sequences in
    the step), `decodes` sequences producing a token, `running` sequences in the batch,
    `kv_used` fraction of KV blocks held by running sequences."""

    prefill_tokens: int
    decodes: int
    running: int
    kv_used: float


def step_seconds(work: StepWork, t: TimingParams, engine: EngineParams) -> float:
    if work.prefill_tokens <= 0 and work.decodes <= 0:
        return 0.0
    if t.model == "dynamo-mocker":
        ms = 0.0
        if work.prefill_tokens > 0:
            n = float(work.prefill_tokens)
            ms += t.prefill_scale * (t.a2 * n * n + t.a1 * n + t.a0)
        if work.decodes > 0:
            u = min(1.0, max(0.0, work.kv_used))
            ms += t.decode_scale * max(t.decode_floor_ms, t.d2 * u * u + t.d1 * u + t.d0)
        return ms / 1000.0
    # llm-d-inference-sim
    ms = 0.0
    if work.prefill_tokens > 0:
        ms += t.overhead_ms + work.prefill_tokens * t.per_token_ms
    if work.decodes > 0:
        ms += t.itl_ms
    seqs = max(1, engine.max_num_seqs - 1)
    factor = 1.0 + (t.load_factor - 1.0) * max(0, work.running - 1) / seqs
    return ms * factor / 1000.0
