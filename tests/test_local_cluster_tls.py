"""The local cluster's TLS settings (`ClusterSpec(tls=True)`, `kvkeep demo --tls`) checked
without starting anything. The TLS cluster itself runs the demo in tests/test_deploy_demo.py
(the one full demo run: its checks pass with TLS on)."""

from __future__ import annotations

from pathlib import Path


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
