"""Every codec's batch device API (`encode_batch`, `decode_batch`, `segment_valid`) on CPU
tensors: the same torch code a GPU runs, here on the host. A batch decodes to what the host
decoder makes of the same bytes, within each codec's error of the input, strided rows too;
segments no writer of ours stores are refused before a device would decode them."""

from __future__ import annotations

import pytest
import torch

from kvstore.codecs import CODECS, Arrangement, Codec
from kvstore.errors import CodecError
from kvstore.frame import CodecId, DType

# (arrangement, block shape): canonical flash blocks [2, N, H, D] and the CPU backends' row
# blocks [H, 2N, D], at two head sizes (grouped codecs need 32-channel groups).
SHAPES = [(Arrangement.CANONICAL, (2, 16, 2, 128)), (Arrangement.CANONICAL, (2, 32, 1, 64)),
          (Arrangement.ROWS, (2, 32, 128)), (Arrangement.AMX, (2, 64, 128))]
DTYPES = [(torch.bfloat16, DType.BFLOAT16), (torch.float16, DType.FLOAT16),
          (torch.float32, DType.FLOAT32)]


def _supported(codec: Codec, arrangement: Arrangement, shape: tuple[int, ...],
               dtype: DType) -> bool:
    try:
        codec.check_layout(shape, dtype, arrangement)
    except CodecError:
        return False
    return True


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


@pytest.mark.parametrize("codec_id", list(CODECS), ids=[c.name for c in CODECS.values()])
def test_every_codec_encodes_at_least_one_layout(codec_id: CodecId) -> None:
    codec = CODECS[codec_id]
    assert any(_supported(codec, arrangement, shape, DType.BFLOAT16)
               for arrangement, shape in SHAPES), codec.name


@pytest.mark.parametrize("torch_dtype,dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("layout", SHAPES, ids=["canonical", "canonical-d64", "rows", "amx"])
@pytest.mark.parametrize("codec_id", list(CODECS), ids=[c.name for c in CODECS.values()])
def test_batch_round_trip_matches_the_host_decoder(codec_id: CodecId,
                                                   layout: tuple[Arrangement, tuple[int, ...]],
                                                   torch_dtype: torch.dtype,
                                                   dtype: DType) -> None:
    codec = CODECS[codec_id]
    arrangement, shape = layout
    if not _supported(codec, arrangement, shape, dtype):
        pytest.skip(f"{codec.name} does not encode {arrangement.name} {shape}")
    gen = torch.Generator().manual_seed(11)
    blocks = (torch.randn((6, *shape), generator=gen) * 3).to(torch_dtype)
    encoded = codec.encode_batch(blocks, arrangement)
    assert encoded.dtype == torch.uint8
    assert tuple(encoded.shape) == (6, codec.encoded_size(shape, dtype))
    for row in encoded:
        assert codec.segment_valid(row.numpy(), shape, dtype)
    decoded = codec.decode_batch(encoded, shape, dtype)
    assert tuple(decoded.shape) == (6, *shape) and decoded.dtype == torch_dtype
    for k in range(6):
        host = torch.as_tensor(codec.decode(encoded[k].numpy(), shape, dtype))
        assert torch.equal(_bits(decoded[k]), _bits(host)), k
    error = (decoded.float() - blocks.float()).abs().max().item()
    if codec_id is CodecId.RAW:
        assert torch.equal(_bits(decoded), _bits(blocks))
    else:
        # 8-bit: half a step of a range of ~|x|max; 4-bit: 16 steps.
        steps = 15 if codec.name == "int4" else 255
        bound = 2 * blocks.float().abs().max().item() / steps
        assert 0 < error <= bound, (error, bound)
    # Rows may be strided (a slot's rows of one layer out of several).
    strided = torch.stack([encoded, encoded], dim=1)[:, 1]
    assert not strided.is_contiguous()
    assert torch.equal(_bits(codec.decode_batch(strided, shape, dtype)), _bits(decoded))


@pytest.mark.parametrize("codec_id", [c for c in CODECS if c is not CodecId.RAW],
                         ids=[c.name for c in CODECS.values() if c.codec_id is not CodecId.RAW])
def test_segments_with_impossible_scales_are_refused(codec_id: CodecId) -> None:
    codec = CODECS[codec_id]
    arrangement, shape = next((a, s) for a, s in SHAPES
                              if _supported(codec, a, s, DType.BFLOAT16))
    good = codec.encode_batch(torch.randn((1, *shape)).to(torch.bfloat16), arrangement)[0]
    assert codec.segment_valid(good.numpy(), shape, DType.BFLOAT16)
    nan_everywhere = torch.full_like(good, 0xFF)  # every scale a NaN bit pattern
    assert not codec.segment_valid(nan_everywhere.numpy(), shape, DType.BFLOAT16)


def test_raw_batches_are_the_blocks_bytes() -> None:
    codec = CODECS[CodecId.RAW]
    blocks = torch.randn((3, 2, 8, 2, 16)).to(torch.bfloat16)
    encoded = codec.encode_batch(blocks, Arrangement.CANONICAL)
    assert torch.equal(encoded, blocks.view(torch.uint8).reshape(3, -1))


def test_lossy_batches_refuse_inf_and_nan() -> None:
    for codec_id in (c for c in CODECS if c is not CodecId.RAW):
        codec = CODECS[codec_id]
        arrangement, shape = next((a, s) for a, s in SHAPES
                                  if _supported(codec, a, s, DType.BFLOAT16))
        blocks = torch.randn((2, *shape)).to(torch.bfloat16)
        blocks.view(-1)[5] = float("nan")
        with pytest.raises(CodecError):
            codec.encode_batch(blocks, arrangement)
