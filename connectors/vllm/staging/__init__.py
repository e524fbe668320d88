"""The connector's two data paths: one save pipeline and one restore pipeline, each a fixed
sequence of stages with the strategies the config chooses plugged in.

- `save`: the save pipeline: a framer (`HostFramer`, or `RingFramer` for `save_path:
  "staged"`) into a sink (`WriteBehind`, or `Replicated` with `durability`);
- `restore`: the restore pipeline: fetch (borrowed or read, refused headers failed) then a
  writer: `decode.DecodeWriter` ("auto", "device_decode"), `ring_restore.RingWriter`
  ("staged"), `in_place.InPlaceWriter` ("staged" into verbatim host caches);
- `jobs`: what the restore pipeline works on (the loader's jobs as protocols);
- `streams`: copy lanes (a CUDA stream and its events; no-ops on the host);
- `ring`: slots of host (page-locked on a GPU) and device buffers, allocated once;
- `frames`: frames laid out in a slot row and sealed in place;
- `kernels`: the device work of a batch (scatter or encode, per layer per batch).

Nothing here imports vLLM: `benchmarks.gpu` runs the pipelines on machines without it.
"""

from connectors.vllm.staging.config import StagingConfig
from connectors.vllm.staging.restore import RestorePipeline, writer_for
from connectors.vllm.staging.save import SavePipeline

__all__ = ["RestorePipeline", "SavePipeline", "StagingConfig", "writer_for"]
