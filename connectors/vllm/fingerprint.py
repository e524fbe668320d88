"""The model fingerprint and KV layout of a running vLLM engine, from its `VllmConfig`.

Both halves of the connector derive the same fingerprint independently (the scheduler to look
blocks up, the worker to read and write them), so everything here is a pure function of the
config and of files on disk.

What makes stored KV valid, and where each part comes from:

- the weights: `weights_revision` from the extra config when given (an operator's promise),
  else for `load_format="dummy"` the fixed dummy initializer, else a digest of every byte of
  every weight file (`connectors.vllm.weights`: the SHA-256 a Hugging Face cache blob is named
  by, or a full hash computed once and cached by size, times and inode; never a sample);
- the architecture (`hf_config` minus paths and tool versions): rope scaling, norms, head
  layout change KV without changing a weight file;
- the block-hash algorithm, dtype, KV heads per rank, head size, block size, layout, codec.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.layouts import (
    FP8_KV_DTYPES,
    LayoutSpec,
    cpu_layout,
    cuda_layout,
    fp8_layout,
    mla_layout,
)
from connectors.vllm.weights import checkpoint_kv_scales, weights_digest
from kvstore.errors import ConfigError
from kvstore.keys import ModelFingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["derive_layout", "derive_fingerprint", "weights_digest", "config_digest",
           "fp8_scales", "kv_scales_digest", "check_engine_kv_scales"]

logger = logging.getLogger(__name__)

def derive_layout(vllm_config: VllmConfig, *, rank: int | None = None) -> LayoutSpec:
    """The layout this engine's workers use, decided from the config alone; `rank`: that of
    another tensor-parallel rank than this process's (the scheduler's is rank 0)."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError("kvkeep connector: pipeline parallelism is not supported")
    kv_dtype = str(cache.cache_dtype)
    if kv_dtype != "auto" and kv_dtype not in FP8_KV_DTYPES:
        raise ConfigError(f"kvkeep connector: kv_cache_dtype {kv_dtype!r} is not supported "
                          f"(use 'auto' or one of {sorted(FP8_KV_DTYPES)})")
    if kv_dtype != "auto" and model.use_mla:
        raise ConfigError(f"kvkeep connector: an fp8 KV cache ({kv_dtype}) with MLA is not "
                          f"supported (its latent fp8 layouts are backend-specific)")
    if kv_dtype != "auto" and getattr(cache, "calculate_kv_scales", False):
        raise ConfigError("kvkeep connector: calculate_kv_scales derives each engine's fp8 KV "
                          "scales from its first batch, so KV saved by one engine would be "
                          "read under another's scales; use the checkpoint's scales")
    heads = model.get_num_kv_heads(parallel)
    head_size = model.get_head_size()
    block_size = cache.block_size
    if model.use_mla:
        spec = _mla_layout(model, _mla_platform(current_platform.is_cpu()), block_size)
        if spec.head_size != head_size:
            raise ConfigError(f"kvkeep connector: MLA latent width {spec.head_size} "
                              f"(kv_lora_rank + qk_rope_head_dim) is not vLLM's head size "
                              f"{head_size}")
        if not (current_platform.is_cpu() or current_platform.is_cuda_alike()):
            raise ConfigError(f"kvkeep connector: platform {current_platform.device_type!r} "
                              f"has no known MLA KV layout")
    elif current_platform.is_cpu() and kv_dtype != "auto":
        isa = _cpu_isa(model.dtype, block_size, head_size, kv_dtype)
        spec = fp8_layout(f"cpu-{isa or 'unknown'}", kv_dtype, num_kv_heads=heads,
                          head_size=head_size, block_size=block_size)
    elif current_platform.is_cpu():
        spec = cpu_layout(_cpu_isa(model.dtype, block_size, head_size), num_kv_heads=heads,
                          head_size=head_size, block_size=block_size)
    elif current_platform.is_cuda_alike() and kv_dtype != "auto":
        spec = fp8_layout("cuda", kv_dtype, num_kv_heads=heads, head_size=head_size,
                          block_size=block_size)
    elif current_platform.is_cuda_alike():
        spec = cuda_layout(num_kv_heads=heads, head_size=head_size, block_size=block_size)
    else:
        raise ConfigError(f"kvkeep connector: platform {current_platform.device_type!r} has no "
                          f"known KV layout")
    own = parallel.rank % parallel.tensor_parallel_size
    return spec.with_shard(own if rank is None else rank, parallel.tensor_parallel_size)


def derive_fingerprint(vllm_config: VllmConfig, config: ConnectorConfig,
                       layout: LayoutSpec) -> ModelFingerprint:
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    load = vllm_config.load_config
    if config.weights_revision is not None:
        weights = f"rev:{config.weights_revision}"
    elif str(load.load_format) == "dummy":
        # vLLM's dummy loader fills every tensor from one fixed seed: deterministic.
        weights = "dummy:v1"
    else:
        weights = weights_digest(_model_dir(model.model, model.revision))
    served = model.served_model_name
    model_id = config.model_id or (served[0] if isinstance(served, list) else served) \
        or model.model
    digest = (f"weights={weights};config={config_digest(model.hf_config.to_dict())};"
              f"hash={cache.prefix_caching_hash_algo}")
    if layout.is_fp8:
        # The fp8 format is in the layout id; the scales are what turns its bytes into
        # values: blocks saved under other scales must never be found.
        digest += f";kv={layout.kv_dtype};kv_scales={kv_scales_digest(fp8_scales(vllm_config))}"
    return ModelFingerprint(
        model_id=str(model_id),
        weights_digest=digest,
        dtype=str(model.dtype).removeprefix("torch."),
        num_layers=model.get_total_num_hidden_layers(),
        num_kv_heads=layout.num_kv_heads,
        head_size=layout.head_size,
        block_size=layout.block_size,
        layout_id=layout.layout_id,
        codec=config.codec,
    )


def fp8_scales(vllm_config: VllmConfig) -> dict[str, list[float]]:
    """The per-layer fp8 KV scales the engine loads from its checkpoint (empty: all 1.0)."""
    model = vllm_config.model_config
    if str(vllm_config.load_config.load_format) == "dummy":
        return {}
    try:
        directory: Path | None = _model_dir(model.model, model.revision)
    except ConfigError:
        directory = None
    return checkpoint_kv_scales(directory)


def kv_scales_digest(scales: dict[str, list[float]]) -> str:
    if not scales:
        return "default-1.0"
    body = json.dumps(scales, sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(body.encode())


def check_engine_kv_scales(expected: dict[str, list[float]],
                           actual: dict[str, tuple[float, float]]) -> None:
    """ConfigError unless every attention layer's (k_scale, v_scale) in the running engine is
    what the fingerprint was derived from: 1.0 without checkpoint scales, else values the
    checkpoint carries. (The scheduler half cannot see the engine's layers, so it keys by the
    checkpoint; the worker half checks the engine agrees before anything is saved.)"""
    allowed = {1.0} if not expected else {v for values in expected.values() for v in values}
    wrong = {name: pair for name, pair in actual.items()
             if not all(any(abs(x - a) <= 1e-7 * max(1.0, abs(a)) for a in allowed)
                        for x in pair)}
    if wrong:
        name, (k, v) = next(iter(sorted(wrong.items())))
        raise ConfigError(f"kvkeep connector: the engine's fp8 KV scales are not the "
                          f"checkpoint's (layer {name}: k_scale {k}, v_scale {v}; expected "
                          f"{sorted(allowed)[:4]}): blocks would be keyed under the wrong "
                          f"scales")


def config_digest(hf_config: dict[str, Any]) -> str:
    """Digest of an architecture config, without what differs between copies of one model."""
    drop = {"transformers_version", "architectures_revision"}
    clean = {k: v for k, v in hf_config.items() if not k.startswith("_") and k not in drop}
    body = json.dumps(clean, sort_keys=True, default=str, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(body.encode())


def _model_dir(model: str, revision: str | None) -> Path:
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as exc:  # any failure to locate files: the operator must pin a revision
        raise ConfigError(f"cannot find the weight files of {model!r} to fingerprint them; "
                          f"set weights_revision in kv_connector_extra_config") from exc


def _mla_layout(model: Any, platform: str, block_size: int) -> LayoutSpec:
    """The latent cache's layout; the widths come from the architecture config (the same on
    both halves), checked against the paged tensor when the worker binds it."""
    hf = model.hf_text_config
    rank = getattr(hf, "kv_lora_rank", None)
    rope = getattr(hf, "qk_rope_head_dim", None)
    if not isinstance(rank, int) or not isinstance(rope, int):
        raise ConfigError("kvkeep connector: an MLA model whose config names no kv_lora_rank "
                          "and qk_rope_head_dim: its latent layout is unknown")
    return mla_layout(platform, kv_lora_rank=rank, rope_dim=rope, block_size=block_size)


def _mla_platform(is_cpu: bool) -> str:
    """The platform part of an MLA layout id. On CPUs with AMX vLLM picks its AMX MLA
    backend, whose kernels may pack the latent cache otherwise: its own id, so its blocks
    never meet the reference backend's."""
    if not is_cpu:
        return "cuda"
    import torch

    return "cpu-amx" if torch.cpu._is_amx_tile_supported() else "cpu"


def _cpu_isa(dtype: Any, block_size: int, head_size: int,
             kv_dtype: str = "auto") -> str | None:
    """The CPU attention kernel vLLM will pick, or None when this vLLM cannot tell us."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, block_size, head_size, kv_dtype))
    except Exception:  # a private helper: if it moves, fall back to the verbatim layout
        logger.warning("kvkeep: cannot determine the CPU attention kernel; storing blocks "
                       "verbatim (layout cpu-unknown/raw)")
        return None
