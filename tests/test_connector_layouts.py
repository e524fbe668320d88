"""Layouts of paged KV: whole-block copies between backend tensors and canonical blocks.

The CPU checks use vLLM's own `cpu_attn_reshape_and_cache` kernel as the ground truth of where a
token's K and V live, so a change of the kernel's arrangement fails here, not in production.
"""

from __future__ import annotations

import pytest
import torch

from connectors.vllm.layouts import LayoutSpec, cpu_layout, cuda_layout
from kvstore.errors import ConfigError

H, N, D, BLOCKS = 2, 32, 32, 8


def _devices() -> list[pytest.ParameterSet]:
    return [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def _random_kv(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(tokens, H, D, generator=gen).to(dtype)
    value = torch.randn(tokens, H, D, generator=gen).to(dtype)
    return key, value


def _kernel_write(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  slots: torch.Tensor, isa: str) -> None:
    ops = pytest.importorskip("vllm._custom_ops")
    num_blocks, heads, block, _ = cache.shape
    view = cache.view(num_blocks, heads, 2 * block, -1)
    key_cache, value_cache = view.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")


@pytest.mark.parametrize("isa", ["vec", "vec16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_gather_matches_vllm_kernel(isa: str, dtype: torch.dtype) -> None:
    """Blocks written by vLLM's kernel come out canonical: [K|V, token, head, dim]."""
    cache = torch.zeros(BLOCKS, H, N, 2 * D, dtype=dtype)
    block_ids = [5, 2, 7]
    key, value = _random_kv(N * len(block_ids), dtype, seed=1)
    slots = torch.cat([torch.arange(b * N, (b + 1) * N) for b in block_ids])
    _kernel_write(cache, key, value, slots, isa)

    layout = cpu_layout(isa, num_kv_heads=H, head_size=D, block_size=N).bind(cache)
    blocks = layout.gather(cache, torch.tensor(block_ids))

    assert blocks.shape == (3, 2, N, H, D) and blocks.is_contiguous()
    assert torch.equal(blocks[:, 0].reshape(-1, H, D), key)
    assert torch.equal(blocks[:, 1].reshape(-1, H, D), value)


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_cpu_scatter_is_byte_identical_to_vllm_kernel(isa: str) -> None:
    """Scattering canonical blocks leaves the paged tensor exactly as the kernel would."""
    block_ids = torch.tensor([1, 6])
    key, value = _random_kv(2 * N, torch.bfloat16, seed=2)
    by_kernel = torch.zeros(BLOCKS, H, N, 2 * D, dtype=torch.bfloat16)
    _kernel_write(by_kernel, key, value,
                  torch.cat([torch.arange(b * N, (b + 1) * N) for b in block_ids.tolist()]), isa)

    ours = torch.zeros_like(by_kernel)
    canonical = torch.stack((key.view(2, N, H, D), value.view(2, N, H, D)), dim=1)
    cpu_layout(isa, num_kv_heads=H, head_size=D, block_size=N).bind(ours).scatter(
        ours, block_ids, canonical)
    assert torch.equal(ours, by_kernel)


def _layouts() -> list[tuple[LayoutSpec, tuple[int, ...]]]:
    return [
        (cpu_layout("vec", num_kv_heads=H, head_size=D, block_size=N), (BLOCKS, H, N, 2 * D)),
        (cpu_layout("amx", num_kv_heads=H, head_size=D, block_size=N), (BLOCKS, H, N, 2 * D)),
        (cuda_layout(num_kv_heads=H, head_size=D, block_size=N), (2, BLOCKS, N, H, D)),
        (cuda_layout(num_kv_heads=H, head_size=D, block_size=N), (BLOCKS, 2, N, H, D)),
    ]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize(("spec", "shape"), _layouts(),
                         ids=["cpu-kt", "cpu-raw", "flash", "flashinfer"])
def test_round_trip_on_synthetic_paged_tensors(spec: LayoutSpec, shape: tuple[int, ...],
                                               device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    paged = torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)
    layout = spec.bind(paged)
    ids = torch.tensor([3, 0, 6], device=device)
    blocks = layout.gather(paged, ids)
    assert tuple(blocks.shape) == (3, *spec.block_shape)

    # Scatter into a blank tensor: the same blocks come back, every other block stays zero.
    blank = torch.zeros_like(paged)
    layout.scatter(blank, ids, blocks)
    assert torch.equal(layout.gather(blank, ids), blocks)
    others = torch.tensor([b for b in range(BLOCKS) if b not in (3, 0, 6)], device=device)
    assert not layout.gather(blank, others).any()

    # Scattering into different block ids moves the content, not a reinterpretation of it.
    moved = torch.zeros_like(paged)
    layout.scatter(moved, torch.tensor([7, 1, 2], device=device), blocks)
    assert torch.equal(layout.gather(moved, torch.tensor([7, 1, 2], device=device)), blocks)


def test_flash_layout_semantics() -> None:
    """`[2, blocks, N, H, D]` canonicalizes to [block][K|V][token][head][dim]."""
    paged = torch.arange(2 * BLOCKS * N * H * D, dtype=torch.float32).view(2, BLOCKS, N, H, D)
    layout = cuda_layout(num_kv_heads=H, head_size=D, block_size=N).bind(paged)
    blocks = layout.gather(paged, torch.tensor([4]))
    assert torch.equal(blocks[0, 0], paged[0, 4]) and torch.equal(blocks[0, 1], paged[1, 4])


def test_layout_ids_separate_arrangements() -> None:
    ids = {cpu_layout(isa, num_kv_heads=H, head_size=D, block_size=N).layout_id
           for isa in ("vec", "vec16", "amx", "neon", None)}
    assert ids == {"cpu/tnhd", "cpu-amx/raw", "cpu-neon/raw", "cpu-unknown/raw"}
    shard = cuda_layout(num_kv_heads=H, head_size=D, block_size=N).with_shard(1, 4)
    assert shard.layout_id == "cuda/tnhd/tp1of4"


@pytest.mark.parametrize(("shape", "dtype"), [
    ((BLOCKS, H, N, D), torch.bfloat16),           # wrong last dim
    ((BLOCKS, H + 1, N, 2 * D), torch.bfloat16),   # wrong head count
    ((BLOCKS, H, N, 2 * D), torch.uint8),          # fp8 caches are stored as uint8
])
def test_bind_rejects_mismatched_tensors(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    with pytest.raises(ConfigError):
        cpu_layout("vec", num_kv_heads=H, head_size=D, block_size=N).bind(
            torch.zeros(shape, dtype=dtype))


def test_bind_rejects_unknown_cuda_shape() -> None:
    with pytest.raises(ConfigError):
        cuda_layout(num_kv_heads=H, head_size=D, block_size=N).bind(
            torch.zeros(BLOCKS, N, H, 2 * D))
