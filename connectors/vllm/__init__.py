"""kvkeep's vLLM KV connector.

Enable it with `kv_transfer_config={"kv_connector": "KVKeepConnector",
"kv_connector_module_path": "connectors.vllm", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}`; see
`connectors.vllm.config` for the extra config and `connectors.vllm.params` for the per-request
`kv_transfer_params`.

`KVKeepConnector` is imported on first use (vLLM's factory does `getattr(module, name)`), so the
parts that do not need vLLM itself (layouts, config, params) import on hosts without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvstore.codecs  # noqa: F401  (loads numba/llvmlite, which the patch below needs)
from kvstore.codecs.llvmlite_compat import patch_llvmlite_for_vllm

patch_llvmlite_for_vllm()

if TYPE_CHECKING:
    from connectors.vllm.connector import KVKeepConnector

__all__ = ["KVKeepConnector"]


def __getattr__(name: str) -> object:
    if name == "KVKeepConnector":
        from connectors.vllm.connector import KVKeepConnector

        return KVKeepConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
