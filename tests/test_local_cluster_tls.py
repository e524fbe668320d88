"""The local cluster with TLS on (`ClusterSpec(tls=True)`, `kvkeep demo --tls`): etcd serving
https with client-certificate auth, daemons over mTLS under one checked name with signed
registrations, and every part (daemons, vLLM's connector, agents, router) configured for it.
The demo's own checks (a worker SIGKILLed mid-stream, KV restored from the daemons) pass with
it: the connector found the daemons through TLS etcd, believed them, and read and wrote KV
over mTLS. `make demo` (no TLS) is tests/test_deploy_demo.py's."""

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
    numbers = result["numbers"]
    assert numbers["stream_restored_tokens"] > 0 and numbers["bob_restored_tokens"] > 0


def test_tls_cluster_settings_are_the_checked_ones(tmp_path: Path) -> None:
    """Without starting anything: the flags and connector keys the TLS option gives each part
    parse with the real parsers and name files that exist."""
    from connectors.vllm.config import ConnectorConfig
    from deploy.local.engines import EngineSettings, kv_transfer_config
    from deploy.local.tls import STORE_NAME, LocalPki
    from kvstore.commands.kvkeep import build_parser
    from kvstore.etcd.flags import etcd_spec_from_args

    pki = LocalPki.create(tmp_path / "pki")
    parser = build_parser()
    url = "https://127.0.0.1:2379"
    store = parser.parse_args(["store", "serve", "--listen", "127.0.0.1:0", "--data-dir", "/d",
                               "--node-id", "d1", "--etcd", url, *pki.daemon_flags()])
    assert store.tls_server_name == STORE_NAME and store.registration_key.exists()
    router = parser.parse_args(["router", "serve", "--etcd", url, *pki.etcd_client_flags()])
    for args in (store, router):
        spec = etcd_spec_from_args(args, check_files=True)
        assert spec is not None and spec.secure and spec.cert_file is not None
    extra = kv_transfer_config(EngineSettings(model_dir=Path("/m")), url,
                               remote_extra=pki.connector_remote())["kv_connector_extra_config"]
    remote = ConnectorConfig.from_extra(extra).store.remote
    assert remote is not None and remote.tls_server_name == STORE_NAME
    assert remote.registration_public_key is not None
    assert Path(remote.registration_public_key).read_bytes().startswith(b"-----BEGIN PUBLIC")
    assert pki.registration_key.stat().st_mode & 0o077 == 0
