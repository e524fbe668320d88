"""vLLM's paged KV tensors as the worker half sees them: one per layer, in layer order, each
bound to the layout that gathers and scatters whole blocks of it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from connectors.vllm.layouts import BoundLayout, LayoutSpec
from kvstore.errors import ConfigError
from kvstore.frame import DType

__all__ = ["PagedCaches", "recorded_event"]


class PagedCaches:
    """The registered KV caches (empty until `register`); shared by the loader and the saver."""

    def __init__(self, layout: LayoutSpec, num_layers: int) -> None:
        self.layout = layout
        self.num_layers = num_layers
        self.tensors: list[torch.Tensor] = []
        self.bound: list[BoundLayout] = []
        self.host_blocks: list[np.ndarray[Any, Any] | None] = []
        """Per layer, where the layout allows it: the cache's blocks as frames hold them, for
        decoding straight into (see `BoundLayout.host_blocks`)."""
        self._index: dict[str, int] = {}
        self._dtype: DType | None = None

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        self.bind([kv_caches[name] for name in names])
        self._index = {name: i for i, name in enumerate(names)}

    def bind(self, tensors: Sequence[torch.Tensor]) -> None:
        """Take the paged tensors of every layer, in layer order (what `register` does once it
        has sorted vLLM's layer names; benchmarks without vLLM call it directly)."""
        if len(tensors) != self.num_layers:
            raise ConfigError(f"kvkeep: {len(tensors)} KV cache layers registered, the model "
                              f"has {self.num_layers}")
        # fp8 caches are bound as 16-bit words over their bytes (see layouts.FP8_WORD).
        layers = [self.layout.as_words(t) for t in tensors]
        dtypes = {t.dtype for t in layers}
        if len(dtypes) != 1:
            raise ConfigError(f"kvkeep: KV cache layers differ in dtype: {dtypes}")
        self.bound = [self.layout.bind(t) for t in layers]
        self.host_blocks = [bound.host_blocks(t) for bound, t in zip(self.bound, layers,
                                                                     strict=True)]
        self.tensors = layers
        self._dtype = DType.from_name(str(layers[0].dtype))

    def index_of(self, layer_name: str) -> int | None:
        """The layer index of a vLLM layer name; None for layers that are not ours."""
        return self._index.get(layer_name)

    @property
    def dtype(self) -> DType:
        if self._dtype is None:
            raise RuntimeError("kvkeep: no KV caches registered yet")
        return self._dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.layout.block_shape


def recorded_event() -> torch.cuda.Event:
    """A CUDA event recorded on the calling thread's current stream."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves __init__ untyped
    event.record()
    return event
