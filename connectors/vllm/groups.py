"""vLLM's KV cache groups as the connector keeps them: one store layout per group.

With its hybrid KV cache manager (HMA) on, vLLM gives each kind of attention its own block
table: a model mixing full and sliding-window layers (Gemma-3, gpt-oss, Mistral's interleaved
variants) has a full-attention group and one or more sliding-window groups of the same number
of layers, each with its own block ids for the same token positions. A sliding-window group
frees the blocks that fall out of its window and puts vLLM's null block (id 0) in their place.

So the connector keeps one store layout per group:

- each group's blocks are stored under a fingerprint of their own (the model's, with the
  group's layer count and a layout id naming the group: its attention kind, window and layer
  indices), so a group's blocks never meet another group's, nor those of the same model run
  without HMA (one group of every layer);
- a block index of a request is saved in every group that still holds it (a null entry is a
  block the window left: nothing to save), and restored into every group whose entry is not
  null: vLLM allocates null entries for the positions of a restored prefix that lie outside a
  sliding window, so a sliding-window group loads only the blocks inside the window of the
  prefix it restores;
- a prefix is restorable when every group holds every one of its blocks (stricter than a
  sliding-window group needs, which is the window's blocks only: the saver stores each block of
  every group as it completes, so the two agree unless the store evicted an early block of one
  group; the lookup then restores a shorter prefix, never a wrong one).

Groups the store cannot keep are refused at start-up with the reason: SSM/Mamba state (one
state per request, overwritten in place: no block of it stands for a prefix), chunked-local,
encoder and cross attention, and groups whose block size is not the engine's.

One group (HMA off, or a model with one kind of attention) keeps the fingerprint
and layout the connector always had.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from connectors.vllm.layouts import LayoutSpec
from kvstore.errors import ConfigError
from kvstore.keys import ModelFingerprint

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["KVGroup", "NULL_BLOCK_ID", "kv_groups", "single_group", "group_layout",
           "group_fingerprint", "window_safe_interval"]

NULL_BLOCK_ID = 0
"""vLLM's null block (the block pool's first, never handed out): a group's entry for a position
it does not keep."""

AttentionKind = Literal["full", "sliding"]


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group: its index in vLLM's list, its layers, and its attention."""

    index: int
    layer_names: tuple[str, ...]
    kind: AttentionKind
    window: int | None = None
    """Tokens a sliding-window layer attends to (None: full attention)."""

    def first_kept_block(self, end_tokens: int, block_size: int) -> int:
        """The first block index this group holds (not null) once `end_tokens` are computed:
        vLLM's `SlidingWindowManager.get_num_skipped_tokens`, in blocks."""
        if self.window is None:
            return 0
        return max(0, end_tokens - self.window + 1) // block_size


def single_group(layer_names: tuple[str, ...] = ()) -> tuple[KVGroup, ...]:
    """The one full-attention group of a connector without HMA."""
    return (KVGroup(0, layer_names, "full"),)


def kv_groups(kv_cache_config: KVCacheConfig | None, block_size: int) -> tuple[KVGroup, ...]:
    """The engine's KV cache groups, or ConfigError naming a group the store cannot keep."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    if kv_cache_config is None:
        return single_group()
    groups: list[KVGroup] = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind_name = type(spec).__name__
        if not getattr(group, "enable_kv_transfer", True):
            raise ConfigError(f"kvkeep connector: KV cache group {index} ({kind_name}) is "
                              f"rebuilt by vLLM after a load, a hand-off this connector does "
                              f"not do")
        if spec.block_size != block_size:
            raise ConfigError(f"kvkeep connector: KV cache group {index} ({kind_name}) has "
                              f"blocks of {spec.block_size} tokens, the engine's are "
                              f"{block_size}: groups of other block sizes are not supported")
        names = tuple(group.layer_names)
        # Exact types: the subclasses (chunked local, sink, circular, RSWA, sliding MLA...)
        # keep or skip blocks by rules of their own that this connector does not model.
        if type(spec) is SlidingWindowSpec:
            if getattr(spec, "extra_retained_tokens", 0):
                raise ConfigError(f"kvkeep connector: KV cache group {index} keeps extra "
                                  f"trailing tokens (multi-token speculative decoding), not "
                                  f"supported")
            groups.append(KVGroup(index, names, "sliding", int(spec.sliding_window)))
        elif "Mamba" in kind_name:
            raise ConfigError(f"kvkeep connector: KV cache group {index} holds SSM/Mamba "
                              f"state ({kind_name}): one state per request, overwritten in "
                              f"place, so no stored block stands for a prefix; hybrid SSM "
                              f"models are not supported")
        elif (type(spec) is FullAttentionSpec or kind_name == "MLAAttentionSpec"
              or len(kv_cache_config.kv_cache_groups) == 1):
            # One group is what the connector always ran with HMA off: every layer's blocks
            # kept for every position (vLLM turns sliding layers into full ones then).
            groups.append(KVGroup(index, names, "full"))
        else:
            raise ConfigError(f"kvkeep connector: KV cache group {index} is {kind_name}, "
                              f"which this connector does not support (full attention, MLA "
                              f"and sliding-window attention are)")
    if not groups:
        raise ConfigError("kvkeep connector: the engine has no KV cache group")
    return tuple(groups)


def group_layout(layout: LayoutSpec, group: KVGroup, groups: tuple[KVGroup, ...]
                 ) -> LayoutSpec:
    """The store layout of `group`'s blocks: the engine's, under an id naming the group when
    there are several (frame headers and fingerprints record it)."""
    if len(groups) == 1:
        return layout
    from vllm.model_executor.models.utils import extract_layer_index

    layers = sorted(extract_layer_index(name) for name in group.layer_names)
    what = f"{group.kind}:{group.window or 0}:{','.join(map(str, layers))}"
    tag = hashlib.blake2b(what.encode(), digest_size=5).hexdigest()
    return dataclasses.replace(layout, layout_id=f"{layout.layout_id}+g{tag}")


def group_fingerprint(fingerprint: ModelFingerprint, layout: LayoutSpec,
                      group: KVGroup) -> ModelFingerprint:
    """The fingerprint `group`'s blocks are keyed by (the model's when its layout is the
    engine's: one group)."""
    if layout.layout_id == fingerprint.layout_id:
        return fingerprint
    return dataclasses.replace(fingerprint, num_layers=len(group.layer_names),
                               layout_id=layout.layout_id)


def window_safe_interval(interval: int, groups: tuple[KVGroup, ...], block_size: int) -> int:
    """A checkpoint interval (tokens) short enough that every completed block is saved before
    a sliding window lets vLLM free it: a block waits up to `interval` + one block for its
    checkpoint, and leaves a window of W tokens W - 1 tokens after it completes."""
    windows = [g.window for g in groups if g.window is not None]
    if not windows:
        return interval
    safe = max(block_size, ((min(windows) - 1) // block_size - 1) * block_size)
    return min(interval, safe)
