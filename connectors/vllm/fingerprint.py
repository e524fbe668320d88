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
from connectors.vllm.layouts import LayoutSpec, cpu_layout, cuda_layout
from connectors.vllm.weights import weights_digest
from kvstore.errors import ConfigError
from kvstore.keys import ModelFingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["derive_layout", "derive_fingerprint", "weights_digest", "config_digest"]

logger = logging.getLogger(__name__)

def derive_layout(vllm_config: VllmConfig) -> LayoutSpec:
    """The layout this engine's workers use, decided from the config alone."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError("kvkeep connector: pipeline parallelism is not supported")
    if model.use_mla:
        raise ConfigError("kvkeep connector: MLA models are not supported yet")
    if cache.cache_dtype != "auto":
        raise ConfigError(f"kvkeep connector: kv_cache_dtype {cache.cache_dtype!r} is not "
                          f"supported (use 'auto')")
    heads = model.get_num_kv_heads(parallel)
    head_size = model.get_head_size()
    block_size = cache.block_size
    if current_platform.is_cpu():
        spec = cpu_layout(_cpu_isa(model.dtype, block_size, head_size), num_kv_heads=heads,
                          head_size=head_size, block_size=block_size)
    elif current_platform.is_cuda_alike():
        spec = cuda_layout(num_kv_heads=heads, head_size=head_size, block_size=block_size)
    else:
        raise ConfigError(f"kvkeep connector: platform {current_platform.device_type!r} has no "
                          f"known KV layout")
    return spec.with_shard(parallel.rank % parallel.tensor_parallel_size,
                           parallel.tensor_parallel_size)


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


def _cpu_isa(dtype: Any, block_size: int, head_size: int) -> str | None:
    """The CPU attention kernel vLLM will pick, or None when this vLLM cannot tell us."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, block_size, head_size, "auto"))
    except Exception:  # a private helper: if it moves, fall back to the verbatim layout
        logger.warning("kvkeep: cannot determine the CPU attention kernel; storing blocks "
                       "verbatim (layout cpu-unknown/raw)")
        return None
