"""Staging pipelines between the store and the paged KV cache (issue 9's data path).

- `streams`: copy lanes (a CUDA stream and its events; no-ops on the host);
- `ring`: slots of host (page-locked on a GPU) and device buffers, allocated once;
- `frames`: frames laid out in a slot row and sealed in place;
- `kernels`: the device work of a batch (scatter or encode, per layer per batch);
- `restore`, `save`: the two pipelines the connector's loader and saver hand batches to
  (`"restore_path": "staged"`, `"save_path": "staged"` in its config).

Nothing here imports vLLM: `benchmarks.gpu` runs the pipelines on machines without it.
"""

from connectors.vllm.staging.config import StagingConfig
from connectors.vllm.staging.restore import RestorePipeline
from connectors.vllm.staging.save import SavePipeline

__all__ = ["RestorePipeline", "SavePipeline", "StagingConfig"]
