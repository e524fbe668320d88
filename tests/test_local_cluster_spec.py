"""The local cluster's spec without starting anything: a router-only cluster (no daemons) runs
its workers without the connector, and every worker's extra vLLM flags come last."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.local.cluster import ClusterSpec, LocalCluster
from deploy.local.engines import EngineSettings, vllm_argv
from kvstore.errors import ConfigError


def _engine(spec: ClusterSpec) -> EngineSettings:
    return LocalCluster(spec)._engine_settings(lambda _line: None)


def test_a_cluster_without_daemons_runs_plain_vllm_workers() -> None:
    model = Path("/models/tiny")
    assert _engine(ClusterSpec(daemons=1, model_dir=model)).connector
    plain = _engine(ClusterSpec(daemons=0, model_dir=model,
                                engine=EngineSettings(model_dir=Path("/elsewhere"))))
    assert not plain.connector and plain.model_dir == model
    argv = vllm_argv(plain, port=8000, events_port=8001, etcd_url="http://127.0.0.1:2379",
                     extra_args=("--chat-template", "t.jinja", "--max-model-len", "512"))
    assert "--kv-transfer-config" not in argv
    # Last, so that vLLM's parser lets them win over the cluster's own flags.
    assert argv[-4:] == ["--chat-template", "t.jinja", "--max-model-len", "512"]
    with pytest.raises(ConfigError, match="negative number of daemons"):
        ClusterSpec(daemons=-1)
    with pytest.raises(ConfigError, match="at least one worker"):
        ClusterSpec(workers=0)


def test_daemon_tokens_of_ones_own_are_for_loopback_clusters(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    spec = ClusterSpec(daemon_token_file=tokens, model_dir=tmp_path,
                       engine=EngineSettings(model_dir=tmp_path,
                                             store_token_file=tmp_path / "mine"))
    cluster = LocalCluster(spec)
    assert cluster._daemon_trust_flags("d1") == ["--token-file", str(tokens)]
    assert _engine(spec).store_token_file == tmp_path / "mine"  # the connector's, kept
    for clash in ({"tls": True}, {"isolated_workers": ("w1",)}):
        with pytest.raises(ConfigError, match="bring their own credentials"):
            ClusterSpec(daemon_token_file=tokens, **clash)  # type: ignore[arg-type]
