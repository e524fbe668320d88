"""The generated gRPC code in kvstore/_proto must match what `make proto` produces from
proto/*.proto."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

# proto/ is a folder of .proto files and a script, not a package (the name is proto-plus's):
# the generator is loaded by path, as `make proto` runs it.
_SCRIPT = Path(__file__).resolve().parents[1] / "proto" / "generate.py"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvkeep_proto_generate", _SCRIPT)
    assert spec is not None and spec.loader is not None, _SCRIPT
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    gen = _generator()
    fresh = {p.name: p.read_bytes() for p in gen.generate(tmp_path / "gen")}
    committed = {p.name: p.read_bytes() for p in gen.GEN_DIR.iterdir() if p.is_file()}
    assert set(committed) == set(fresh), "kvstore/_proto has missing or extra files: make proto"
    stale = sorted(name for name in fresh if committed[name] != fresh[name])
    assert not stale, f"kvstore/_proto is stale ({', '.join(stale)}): run `make proto`"


def test_generated_package_imports() -> None:
    from kvstore._proto import health_pb2, kvstore_pb2, kvstore_pb2_grpc

    assert kvstore_pb2.DESCRIPTOR.package == "kvkeep.store.v1"
    assert health_pb2.DESCRIPTOR.package == "grpc.health.v1"
    assert hasattr(kvstore_pb2_grpc, "KVStoreStub")
