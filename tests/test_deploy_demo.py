"""`kvkeep demo` end to end, as a user runs it: a real local cluster (etcd, 2 kvstore daemons,
2 vLLM workers with the kvkeep connector, agents, a router), a worker SIGKILLed mid-stream.
The demo's own checks decide; this test reads its JSON summary and its exit status.

One run, with TLS on (`kvkeep demo --tls`, `ClusterSpec(tls=True)`): etcd serving https with
client-certificate auth, daemons over mTLS under one checked name with signed registrations,
and every part configured for it. The demo's checks are the same with and without TLS, so
the run with it proves both: the connector found the daemons through TLS etcd, believed them,
and read and wrote KV over mTLS. The same cluster builder without TLS (what `make demo` starts)
runs a worker SIGKILLed mid-stream with KV restored in tests/test_observability.py and the
chaos runs (tests/test_deploy_chaos_*.py): a second full cluster here would prove nothing more
for ~60 s. The TLS settings without a cluster are tests/test_local_cluster_tls.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.deploy_cli import run_cli

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_demo_passes_every_check_with_tls(model_dir: Path, tmp_path: Path) -> None:
    summary = tmp_path / "demo.json"
    done = run_cli(["demo", "--tls", "--json", str(summary), "--model-dir", str(model_dir)],
                   timeout=360)
    assert "TLS on" in done.stdout, done.stdout[-4000:] + done.stderr[-4000:]
    assert summary.exists(), done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(summary.read_text())
    failed = [c for c in result["checks"] if not c["passed"]]
    assert not failed, (failed, done.stdout[-6000:])
    assert done.returncode == 0
    names = {c["name"] for c in result["checks"]}
    assert {"the kill landed mid-stream", "the client did not notice",
            "same text as without the failure", "KV restored from the store (resumed stream)",
            "dead worker detected", "lands on the survivor with a restore hint",
            "KV restored from the store (Bob's turn)", "next turn on the survivor",
            "Bob's KV prefetched into the survivor's RAM at the failover"} <= names
    numbers = result["numbers"]
    assert 0 < numbers["resumed_after_tokens"] < numbers["stream_tokens"]
    assert numbers["stream_restored_tokens"] > 0 and numbers["bob_restored_tokens"] > 0
    assert numbers["bob_prefetched_blocks"] > 0
    assert numbers["worker_gone_after_s"] <= numbers["lease_ttl_s"] + 1.5
