"""The generated gRPC code in proto/gen must match what `make proto` produces from proto/*.proto."""

from __future__ import annotations

from pathlib import Path

from proto.generate import PROTO_DIR, generate


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    fresh_dir = tmp_path / "gen"
    fresh = {p.name: p.read_bytes() for p in generate(fresh_dir)}
    committed_dir = PROTO_DIR / "gen"
    committed = {p.name: p.read_bytes() for p in committed_dir.iterdir() if p.is_file()}
    assert set(committed) == set(fresh), "proto/gen has missing or extra files: run `make proto`"
    stale = sorted(name for name in fresh if committed[name] != fresh[name])
    assert not stale, f"proto/gen is stale ({', '.join(stale)}): run `make proto`"


def test_generated_package_imports() -> None:
    from proto.gen import health_pb2, kvstore_pb2, kvstore_pb2_grpc

    assert kvstore_pb2.DESCRIPTOR.package == "kvkeep.store.v1"
    assert health_pb2.DESCRIPTOR.package == "grpc.health.v1"
    assert hasattr(kvstore_pb2_grpc, "KVStoreStub")
