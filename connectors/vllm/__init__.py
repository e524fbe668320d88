"""kvkeep's vLLM KV connector.

Enable it with `kv_transfer_config={"kv_connector": "KVKeepConnector",
"kv_connector_module_path": "connectors.vllm", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}`; see
`connectors.vllm.config` for the extra config and `connectors.vllm.params` for the per-request
`kv_transfer_params`.
"""

from __future__ import annotations

import kvstore.codecs  # noqa: F401  (loads numba/llvmlite, which the patch below needs)
from kvstore.codecs.llvmlite_compat import patch_llvmlite_for_vllm

patch_llvmlite_for_vllm()

from connectors.vllm.connector import KVKeepConnector  # noqa: E402

__all__ = ["KVKeepConnector"]
