"""Where K, V, tokens and channels sit in a stored block, and the plans that put scales there.

The AMX arrangement is checked against vLLM's own AMX `reshape_and_cache`; every plan is checked
element by element against what its grouping means (which token, head and channel each scale
covers); the connector's layouts name the right arrangement and refuse codecs they cannot feed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.layouts import check_codec, cpu_layout, cuda_layout
from kvstore.codecs import DEFAULT_INT8, Arrangement, get_codec
from kvstore.codecs.arrangement import (
    Grouping,
    Plane,
    from_canonical,
    plan_planes,
    rows_plane,
    to_canonical,
)
from kvstore.errors import CodecError, ConfigError
from kvstore.frame import DType

GROUPINGS = [Grouping("channels"), Grouping("tokens"), Grouping("channels", 32),
             Grouping("channels", 64)]
# (tokens, heads, head size): several of each, the AMX kernel's constraints included.
GEOMETRIES = [(32, 1, 32), (32, 2, 64), (64, 3, 128), (16, 4, 64), (32, 8, 128)]


def _coordinates(arrangement: Arrangement, n: int, h: int, d: int) -> dict[str, np.ndarray]:
    """For each element of a block in `arrangement` (flat, storage order): its K/V plane,
    token, head and channel."""
    kv, t, head, ch = np.indices((2, n, h, d))
    return {name: np.asarray(from_canonical(a, arrangement)).reshape(-1)
            for name, a in (("kv", kv), ("token", t), ("head", head), ("channel", ch))}


def _elements(plane: Plane) -> tuple[np.ndarray, np.ndarray]:
    """(flat element index, scale index within the plane) of every element a plane visits."""
    p, a, b, c, e = np.indices((plane.P, plane.A, plane.B, plane.C, plane.E)).reshape(5, -1)
    index = plane.base + p * plane.sp + a * plane.sa + b * plane.sb + c * plane.sc + e
    # e = (j * run + o) * inner + i; the group is (j, i)
    j, i = e // (plane.run * plane.inner), e % plane.inner
    g = j * plane.inner + i
    return np.asarray(index), np.asarray(((p * plane.A + a) * plane.C + c) * plane.fold_groups
                                         + g)


def _semantic(grouping: Grouping, coords: dict[str, np.ndarray], d: int) -> np.ndarray:
    """Per element, the group its grouping means, as a comparable key."""
    if grouping.over == "tokens":
        return np.asarray(coords["head"] * d + coords["channel"])
    size = grouping.size or d
    return np.asarray((coords["head"] * 10**6 + coords["token"]) * 10**3
                      + coords["channel"] // size)


@pytest.mark.parametrize("arrangement", [Arrangement.CANONICAL, Arrangement.AMX])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
def test_plans_cover_each_element_once_and_group_by_meaning(
        arrangement: Arrangement, geometry: tuple[int, int, int]) -> None:
    n, h, d = geometry
    shape = (2, n, h, d) if arrangement is Arrangement.CANONICAL else (h, 2 * n, d)
    coords = _coordinates(arrangement, n, h, d)
    for k_group in GROUPINGS:
        for v_group in GROUPINGS:
            if any(g.size and d % g.size for g in (k_group, v_group)):
                with pytest.raises(CodecError, match="do not divide"):
                    plan_planes(arrangement, shape, DType.BFLOAT16, k_group, v_group)
                continue
            planes = plan_planes(arrangement, shape, DType.BFLOAT16, k_group, v_group)
            seen = np.zeros(2 * n * h * d, np.int64)
            for kv, (plane, grouping) in enumerate(zip(planes, (k_group, v_group),
                                                       strict=True)):
                index, group = _elements(plane)
                np.add.at(seen, index, 1)
                assert (coords["kv"][index] == kv).all()  # K's plane holds K only, V's V
                meaning = _semantic(grouping, coords, d)[index]
                # Each scale covers exactly one meaningful group, and each group one scale.
                pairs = np.unique(np.stack((group, meaning)), axis=1)
                assert len(np.unique(pairs[0])) == pairs.shape[1] == plane.groups
                assert len(np.unique(pairs[1])) == plane.groups
            assert (seen == 1).all(), "every element in exactly one plane, once"


def test_rows_plane_is_one_scale_per_row() -> None:
    plane = rows_plane((3, 5, 8))
    index, group = _elements(plane)
    assert sorted(index) == list(range(120))
    assert (group == index // 8).all()


def test_to_and_from_canonical_round_trip() -> None:
    x = np.arange(2 * 32 * 2 * 64).reshape(2, 32, 2, 64)
    amx = from_canonical(x, Arrangement.AMX)
    assert amx.shape == (2, 64, 64)
    assert np.array_equal(to_canonical(amx, Arrangement.AMX), x)
    assert to_canonical(x, Arrangement.CANONICAL) is x
    with pytest.raises(CodecError):
        to_canonical(x, Arrangement.ROWS)


def _vllm_amx_write(key: torch.Tensor, value: torch.Tensor, blocks: int, n: int
                    ) -> torch.Tensor:
    from vllm import _custom_ops as ops

    tokens, h, d = key.shape
    cache = torch.zeros(blocks, h, n, 2 * d, dtype=key.dtype)
    key_cache, value_cache = cache.view(blocks, h, 2 * n, d).chunk(2, dim=2)
    try:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
                                       torch.arange(tokens), "amx")
    except RuntimeError as exc:  # a CPU (or build) without the AMX kernel
        pytest.skip(f"vLLM's AMX kernel is not available here: {exc}")
    return cache


@pytest.mark.parametrize("geometry", [(32, 2, 64), (64, 4, 128), (32, 1, 32)],
                         ids=lambda g: "x".join(map(str, g)))
def test_amx_arrangement_matches_vllm_kernel(geometry: tuple[int, int, int]) -> None:
    """Blocks written by vLLM's AMX kernel (as the connector stores them, verbatim
    [H, 2N, D]) hold K and V exactly where the AMX arrangement says."""
    n, h, d = geometry
    blocks = 3
    g = torch.Generator().manual_seed(1)
    key = torch.randn(blocks * n, h, d, generator=g).bfloat16()
    value = torch.randn(blocks * n, h, d, generator=g).bfloat16()
    cache = _vllm_amx_write(key, value, blocks, n)
    bits = cache.view(torch.int16).numpy().view(np.uint16)
    for b in range(blocks):
        stored = bits[b].reshape(h, 2 * n, d)  # the connector's verbatim block
        canonical = to_canonical(stored, Arrangement.AMX)
        want_k = key[b * n:(b + 1) * n].view(torch.int16).numpy().view(np.uint16)
        want_v = value[b * n:(b + 1) * n].view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(canonical[0], want_k)
        assert np.array_equal(canonical[1], want_v)


def test_layouts_name_their_arrangement() -> None:
    geometry: dict[str, Any] = {"num_kv_heads": 2, "head_size": 64, "block_size": 32}
    assert cpu_layout("vec", **geometry).arrangement is Arrangement.CANONICAL
    assert cpu_layout("vec16", **geometry).arrangement is Arrangement.CANONICAL
    assert cpu_layout("amx", **geometry).arrangement is Arrangement.AMX
    assert cpu_layout("amx", **geometry).with_shard(1, 2).arrangement is Arrangement.AMX
    assert cpu_layout("neon", **geometry).arrangement is Arrangement.ROWS
    assert cpu_layout(None, **geometry).arrangement is Arrangement.ROWS
    assert cuda_layout(**geometry).arrangement is Arrangement.CANONICAL


@pytest.mark.parametrize("codec", ["int8-asym", "int8-kivi", "int8-g32", "int4"])
def test_connector_refuses_grouped_codecs_where_it_cannot_see_the_axes(codec: str) -> None:
    geometry: dict[str, Any] = {"num_kv_heads": 2, "head_size": 64, "block_size": 32}
    for layout in (cpu_layout("neon", **geometry), cpu_layout(None, **geometry)):
        with pytest.raises(ConfigError, match="needs to know where K, V"):
            check_codec(codec, layout, torch.bfloat16)
        check_codec("int8-sym", layout, torch.bfloat16)  # rows are all it needs
        check_codec("raw", layout, torch.bfloat16)
    # The AMX packing holds only 16-bit values; its blocks are never fp32.
    with pytest.raises(ConfigError, match="16-bit"):
        check_codec(codec, cpu_layout("amx", **geometry), torch.float32)
    for layout in (cpu_layout("amx", **geometry), cpu_layout("vec", **geometry),
                   cuda_layout(**geometry)):
        check_codec(codec, layout, torch.bfloat16)
    # Group sizes must divide the head size.
    small = {"num_kv_heads": 2, "head_size": 16, "block_size": 16}
    if get_codec(codec).name in ("int8-g32", "int4"):
        with pytest.raises(ConfigError, match="do not divide"):
            check_codec(codec, cpu_layout("vec16", **small), torch.bfloat16)


def test_config_accepts_every_codec_and_resolves_int8() -> None:
    store = {"host_bytes": 1 << 20}
    for name in ("raw", "int8-sym", "int8-asym", "int8-kivi", "int8-g32", "int4"):
        assert ConnectorConfig.from_extra({"store": store, "codec": name}).codec == name
    assert ConnectorConfig.from_extra({"store": store, "codec": "int8"}).codec == DEFAULT_INT8
    with pytest.raises(ConfigError, match="codec"):
        ConnectorConfig.from_extra({"store": store, "codec": "int3"})
