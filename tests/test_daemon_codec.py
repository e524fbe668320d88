"""The zero-copy codec of the bulk messages agrees with the generated protobuf classes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import InvalidFrame
from kvstore.net.grpc_messages import (
    decode_get_chunk,
    decode_put_chunk,
    encode_get_chunk,
    encode_put_chunk,
)

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
scopes = st.builds(pb.Scope, fingerprint=st.binary(max_size=16), tenant=st.text(max_size=8),
                   salt=st.text(max_size=8))


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=4096), scope=st.none() | scopes, block_hash=st.binary(max_size=64),
       frame_size=u64)
def test_put_chunk_both_ways(data: bytes, scope: pb.Scope | None, block_hash: bytes,
                             frame_size: int) -> None:
    raw = encode_put_chunk(data, scope=scope, block_hash=block_hash, frame_size=frame_size)
    generated = pb.PutChunk.FromString(raw)
    assert generated.data == data and generated.block_hash == block_hash
    assert generated.frame_size == frame_size
    assert generated.HasField("scope") == (scope is not None)
    reference = pb.PutChunk(block_hash=block_hash, frame_size=frame_size, data=data)
    if scope is not None:
        reference.scope.CopyFrom(scope)
    view = decode_put_chunk(reference.SerializeToString())
    assert bytes(view.data) == data and view.block_hash == block_hash
    assert view.frame_size == frame_size and view.scope == (scope if scope else None)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=4096), index=u32, found=st.booleans(),
       header=st.binary(max_size=256), layers=st.none() | st.tuples(u32, u32),
       payload_size=u64)
def test_get_chunk_both_ways(data: bytes, index: int, found: bool, header: bytes,
                             layers: tuple[int, int] | None, payload_size: int) -> None:
    raw = encode_get_chunk(data, index=index, found=found, header=header, layers=layers,
                           payload_size=payload_size)
    generated = pb.GetChunk.FromString(raw)
    assert (generated.data, generated.index, generated.found) == (data, index, found)
    assert (generated.header, generated.payload_size) == (header, payload_size)
    assert generated.HasField("layers") == (layers is not None)
    view = decode_get_chunk(generated.SerializeToString())
    assert (bytes(view.data), view.index, view.found) == (data, index, found)
    assert (view.header, view.payload_size) == (header, payload_size)
    if layers is None:
        assert view.layers is None
    else:
        assert view.layers is not None and (view.layers.start, view.layers.stop) == layers


@settings(max_examples=500, deadline=None)
@given(raw=st.binary(max_size=512))
def test_decoding_junk_fails_cleanly_or_agrees(raw: bytes) -> None:
    """Junk either fails with InvalidFrame or decodes to what the generated parser reads."""
    try:
        view = decode_get_chunk(raw)
    except InvalidFrame:
        return
    try:
        generated = pb.GetChunk.FromString(raw)
    except Exception:
        return  # stricter than us on some junk (e.g. bad UTF-8 is not our concern here)
    assert bytes(view.data) == generated.data and view.index == generated.index


def test_truncated_messages_are_refused() -> None:
    raw = encode_put_chunk(b"x" * 100, block_hash=b"h", frame_size=100)
    for cut in (1, 6, 7, len(raw) - 1):  # inside a field, not on a boundary
        with pytest.raises(InvalidFrame):
            decode_put_chunk(raw[:cut])
