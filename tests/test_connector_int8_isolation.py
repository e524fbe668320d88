"""The int8 codec's greedy token match against bf16, and isolation between models and tenants
sharing one store."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.connector_harness import (
    BLOCK_SIZE,
    generate,
    kv_transfer_config,
    open_engine,
    random_prompts,
    scheduler_connector,
    worker_connector,
)
from tests.models import TinyModel, build_tiny_llama

pytestmark = pytest.mark.slow

INT8_PROMPTS = random_prompts(24, [64 + 9 * i for i in range(24)], seed=31)
INT8_TOKENS = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama")


def match_rate(got: list[tuple[int, ...]], want: list[tuple[int, ...]]) -> float:
    """Share of generated positions where the greedy token equals the reference's."""
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    return same / sum(len(w) for w in want)


def test_int8_greedy_token_match(tiny: TinyModel, record_property: pytest.RecordProperty
                                 ) -> None:
    """Two figures against the bf16 reference, restoring int8 blocks:

    - free-running: generate 32 tokens from int8-restored prompts, compare position by
      position. One flipped near-tie changes everything after it, and this random bf16 model
      has many near-ties (about 3 % of its greedy choices win by < 0.02 nats, the resolution
      of its bf16 logits), so this figure is low here; it is reported, not asserted high;
    - teacher-forced: at 8 points of each reference continuation, the next greedy token after
      restoring the int8 prefix. This is the per-step agreement (no cascade): asserted >= 95 %.
    """
    with open_engine(tiny.path) as llm:
        reference = [r.tokens for r in generate(llm, INT8_PROMPTS, INT8_TOKENS)]
    forced = [(list(p) + list(ref[:k]), ref[k])
              for p, ref in zip(INT8_PROMPTS, reference, strict=True)
              for k in range(0, INT8_TOKENS, 4)]
    config = kv_transfer_config({"host_bytes": 64 << 20, "name": "int8"}, codec="int8")
    with open_engine(tiny.path, config) as llm:
        first = generate(llm, INT8_PROMPTS, INT8_TOKENS)  # computed in bf16, saved in int8
        assert [r.tokens for r in first] == reference
        llm.reset_prefix_cache()
        restored = generate(llm, INT8_PROMPTS, INT8_TOKENS)
        assert [r.num_cached_tokens for r in restored] == [
            (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in INT8_PROMPTS]
        llm.reset_prefix_cache()
        steps = generate(llm, [prompt for prompt, _ in forced], 1)
        assert all(r.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
                   for r, (prompt, _) in zip(steps, forced, strict=True))
        counters = worker_connector().counters()
        assert counters["load_corrupt"] == 0 and counters["load_mismatch"] == 0
    free = match_rate([r.tokens for r in restored], reference)
    exact = sum(r.tokens == w for r, w in zip(restored, reference, strict=True))
    per_step = sum(r.tokens[0] == want for r, (_, want) in zip(steps, forced, strict=True)
                   ) / len(forced)
    record_property("int8_free_running_match", free)
    record_property("int8_teacher_forced_match", per_step)
    print(f"int8 vs bf16 over {len(INT8_PROMPTS)} prompts: free-running match {free:.3f} "
          f"({exact} identical), teacher-forced next-token match {per_step:.3f} "
          f"({len(forced)} points)")
    assert per_step >= 0.95
    assert free >= 0.4  # a broken codec (wrong axes, wrong scales) lands far below


def test_two_models_and_two_tenants_never_share_blocks(tiny: TinyModel, tmp_path: Path,
                                                       tmp_path_factory: pytest.TempPathFactory
                                                       ) -> None:
    """Same shapes, same prompts, one store: only the exact (model, tenant) gets hits."""
    other = build_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama-seed1", seed=1)
    prompts = random_prompts(3, [100, 140, 180], seed=32)
    store = {"nvme": {"path": str(tmp_path / "shared"), "bytes": 64 << 20}}
    with open_engine(tiny.path, kv_transfer_config(store)) as llm:
        generate(llm, prompts, 8)
        first_fp = scheduler_connector(llm).fingerprint
    with open_engine(other.path, kv_transfer_config(store)) as llm:
        results = generate(llm, prompts, 8)
        assert scheduler_connector(llm).fingerprint.digest != first_fp.digest
        assert all(r.num_cached_tokens == 0 for r in results)
        assert scheduler_connector(llm).counters()["lookup_hit_blocks"] == 0
        assert worker_connector().counters()["saved_blocks"] > 0  # it saved its own
    with open_engine(tiny.path, kv_transfer_config(store, tenant="someone-else")) as llm:
        results = generate(llm, prompts, 8)
        assert all(r.num_cached_tokens == 0 for r in results)
    with open_engine(tiny.path, kv_transfer_config(store)) as llm:
        results = generate(llm, prompts, 8)  # the original owner still restores everything
        assert [r.num_cached_tokens for r in results] == [
            (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]
