"""`kvkeep demo` end to end, as a user runs it: a real local cluster (etcd, 2 kvstore daemons,
2 vLLM workers with the kvkeep connector, agents, a router), a worker SIGKILLed mid-stream.
The demo's own checks decide; this test reads its JSON summary and its exit status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.deploy_cli import run_cli

pytestmark = pytest.mark.slow

@pytest.mark.timeout(400)
def test_demo_passes_every_check(model_dir: Path, tmp_path: Path) -> None:
    summary = tmp_path / "demo.json"
    done = run_cli(
        ["demo", "--json", str(summary),
         "--model-dir", str(model_dir)],
        timeout=320)
    assert summary.exists(), done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(summary.read_text())
    failed = [c for c in result["checks"] if not c["passed"]]
    assert not failed, (failed, done.stdout[-6000:])
    assert done.returncode == 0
    names = {c["name"] for c in result["checks"]}
    assert {"the kill landed mid-stream", "the client did not notice",
            "same text as without the failure", "KV restored from the store (resumed stream)",
            "dead worker detected", "lands on the survivor with a restore hint",
            "KV restored from the store (Bob's turn)", "next turn on the survivor"} <= names
    numbers = result["numbers"]
    assert 0 < numbers["resumed_after_tokens"] < numbers["stream_tokens"]
    assert numbers["stream_restored_tokens"] > 0 and numbers["bob_restored_tokens"] > 0
    assert numbers["worker_gone_after_s"] <= numbers["lease_ttl_s"] + 1.5
