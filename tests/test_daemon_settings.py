"""The daemon's settings (`kvkeep store serve`): a `--config` file (YAML or JSON) and the flags
over it, read as one msgspec Struct (`DaemonSettings`, kvstore/daemon/config.py) by the parser
every settings mapping of the product goes through (kvstore/settings.py), then built into the
`DaemonConfig` the daemon runs from. Every flag is a key and every key a flag (checked here by
walking both), a flag wins over the file, an unknown key or a wrong type is refused naming the
key, and the registry keys (etcd, its TLS and credentials, prefix, registration public key)
mean the same as the connector's and the LMCache plugin's. One daemon is started from a file
and talked to."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from connectors.lmcache.config import PluginSettings
from connectors.vllm.config import ConnectorConfig
from deploy.local.daemons import REPO_ROOT, DaemonProcess
from deploy.local.services import free_port
from kvstore.commands.store import build_serve_parser, settings_from_args
from kvstore.daemon.config import DaemonConfig, DaemonSettings
from kvstore.errors import ConfigError
from kvstore.etcd import EtcdSpec
from kvstore.net.scope import scope_of
from kvstore.settings import RegistrySettings
from tests.blockframes import block_key, make_frame

T = 10.0
REQUIRED = {"listen": "127.0.0.1:0", "data_dir": "/d", "node_id": "n"}
# The flags whose key is the clients' spelling (kvstore.settings.RegistrySettings), not the
# flag's own: the only ones allowed to differ.
RENAMED_FLAGS = {"--etcd-prefix": "prefix", "--registration-pubkey": "registration_public_key"}


def _settings(tmp_path: Path, file: dict[str, Any] | None, *flags: str,
              name: str = "daemon.yaml") -> DaemonSettings:
    argv = list(flags)
    if file is not None:
        path = tmp_path / name
        path.write_text(json.dumps(file))  # JSON is YAML too
        argv = ["--config", str(path), *argv]
    return settings_from_args(build_serve_parser().parse_args(argv))


# -- every flag is a key, every key a flag ------------------------------------------------------

def test_every_flag_is_a_key_and_every_key_a_flag() -> None:
    actions = [a for a in build_serve_parser()._actions if a.dest not in ("help", "config")]
    keys = set(DaemonSettings.__struct_fields__)
    assert {a.dest for a in actions} == keys
    for action in actions:
        # One flag per key (a boolean's --no- form is its negation, not another key).
        flag, *negation = action.option_strings
        assert negation in ([], [f"--no-{flag[2:]}"]), action.option_strings
        assert RENAMED_FLAGS.get(flag, flag[2:].replace("-", "_")) == action.dest, flag
        # A default would be "given" every time and hide the file's key.
        assert action.default is None, flag
    # The registry keys are the connector's (one Struct), not a copy of them.
    assert set(RegistrySettings.__struct_fields__) <= keys
    assert issubclass(DaemonSettings, RegistrySettings)


EVERY_KEY: dict[str, Any] = {
    "listen": "0.0.0.0:7400", "data_dir": "/var/lib/kvkeep", "node_id": "node-7",
    "mem_budget": "16GiB", "disk_budget": "500GiB", "mem_prefault": True,
    "disk_fsync": "off", "advertise": "10.0.0.7:7400", "lease_ttl": 9,
    "token_file": "/etc/kvkeep/tokens", "tls_cert": "/pki/tls.crt", "tls_key": "/pki/tls.key",
    "tls_ca": "/pki/ca.crt", "tls_server_name": "kvkeep-store",
    "registration_key": "/pki/reg.pem", "registration_public_key": "/pki/reg-old.pub",
    "etcd": "https://etcd-0:2379,https://etcd-1:2379", "prefix": "/other/stores/",
    "etcd_ca": "/pki/etcd-ca.crt", "etcd_cert": "/pki/etcd.crt", "etcd_key": "/pki/etcd.key",
    "etcd_user": "kvkeep", "etcd_password_file": "/pki/etcd-pw",
    "replicas": 3, "rereplicate_after": 45.0, "drain_timeout": 25, "workers": 8,
    "tenant_put_share": 0.25, "tenant_put_streams": 8, "tenant_stored_share": 0.5,
    "inflight_put_bytes": "256MiB", "put_idle_timeout": 12.5, "idle_timeout": 60,
    "preauth_timeout": 3, "data_listen": "off", "metrics_listen": "0.0.0.0:7402",
    "backpressure_timeout": 20, "write_queue_depth": 512, "max_pending_writes": 32,
    "max_pending_bytes": "96MiB", "writer_quiet": 0.02, "writer_defer_max": 2.5,
    "tenant_read_streams": 16, "tenant_read_bytes": "32MiB", "get_min_rate": "2MiB",
    "tenant_max_blocks": 100000, "tenant_manifest_share": 0.5,
    "max_unauth_connections": 16, "max_connections_per_ip": 64, "grpc_max_streams": 128,
}


def test_every_key_reaches_the_daemon_config(tmp_path: Path) -> None:
    assert set(EVERY_KEY) == set(DaemonSettings.__struct_fields__)  # a new key is listed here
    config = _settings(tmp_path, EVERY_KEY).config()
    default = DaemonConfig(listen="127.0.0.1:0", data_dir=Path("/d"), mem_budget=1,
                           disk_budget=1, node_id="n")
    registry = set(RegistrySettings.__struct_fields__) - {"registration_public_key"}
    for key in set(EVERY_KEY) - registry:
        name = "registration_public_keys" if key == "registration_public_key" else key
        assert getattr(config, name) != getattr(default, name), key  # the key was used
    assert config.etcd == EtcdSpec(
        "https://etcd-0:2379,https://etcd-1:2379", ca_file=Path("/pki/etcd-ca.crt"),
        cert_file=Path("/pki/etcd.crt"), key_file=Path("/pki/etcd.key"), user="kvkeep",
        password_file=Path("/pki/etcd-pw"))
    assert config.etcd_prefix == "/other/stores/"
    assert (config.mem_budget, config.disk_budget) == (16 << 30, 500 << 30)
    assert config.get_min_rate == float(2 << 20) and config.disk_fsync is False
    assert config.token_file == Path("/etc/kvkeep/tokens")
    assert config.registration_public_keys == Path("/pki/reg-old.pub")


def test_keys_left_out_keep_the_daemon_config_defaults(tmp_path: Path) -> None:
    config = _settings(tmp_path, None, "--listen", "127.0.0.1:0", "--data-dir", "/d",
                       "--node-id", "n").config()
    defaults = DaemonConfig(listen="127.0.0.1:0", data_dir=Path("/d"), mem_budget=1 << 30,
                            disk_budget=10 << 30, node_id="n")
    assert config == defaults  # and the command's own budgets: 1GiB of RAM, 10GiB of disk


# -- parsing ------------------------------------------------------------------------------------

def test_an_unknown_key_is_refused_and_named_with_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _settings(tmp_path, {**REQUIRED, "replica": 2, "mem_budgets": "1GiB"})
    message = str(err.value)
    assert str(tmp_path / "daemon.yaml") in message
    assert "$: unknown key(s) ['mem_budgets', 'replica']" in message
    assert "'replicas'" in message and "'mem_budget'" in message


@pytest.mark.parametrize(("given", "key"), [
    ({"replicas": "2"}, "replicas"),  # a string is not a number
    ({"lease_ttl": 5.5}, "lease_ttl"),
    ({"mem_prefault": "yes"}, "mem_prefault"),  # nor a boolean
    ({"mem_prefault": 1}, "mem_prefault"),
    ({"listen": 7400}, "listen"),  # YAML's `listen: 7400` is a number, not an address
    ({"node_id": ""}, "node_id"),
    ({"disk_fsync": "always"}, "disk_fsync"),
    ({"mem_budget": "12X"}, "mem_budget"),
    ({"mem_budget": 0}, "mem_budget"),
    ({"mem_budget": True}, "mem_budget"),
    ({"disk_budget": 1.5}, "disk_budget"),
    ({"etcd_ca": ""}, "etcd_ca"),
])
def test_a_wrong_type_is_refused_naming_its_key(tmp_path: Path, given: dict[str, Any],
                                                key: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"at `$.{key}`")):
        _settings(tmp_path, {**REQUIRED, **given})


def test_a_bare_yaml_off_is_a_boolean_and_refused_with_a_hint(tmp_path: Path) -> None:
    (tmp_path / "daemon.yaml").write_text(
        "listen: 127.0.0.1:0\ndata_dir: /d\nnode_id: n\ndata_listen: off\n")
    with pytest.raises(ConfigError, match=r"at `\$.data_listen` \(YAML reads a bare off"):
        settings_from_args(build_serve_parser().parse_args(
            ["--config", str(tmp_path / "daemon.yaml")]))
    (tmp_path / "daemon.yaml").write_text(
        "listen: 127.0.0.1:0\ndata_dir: /d\nnode_id: n\ndata_listen: 'off'\n")
    assert settings_from_args(build_serve_parser().parse_args(
        ["--config", str(tmp_path / "daemon.yaml")])).config().data_bind() is None


def test_a_missing_required_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"the command line: .*required field `listen`"):
        _settings(tmp_path, None, "--data-dir", "/d", "--node-id", "n")


@pytest.mark.parametrize(("text", "size"), [
    ("512MiB", 512 << 20), ("4G", 4 << 30), ("1.5GiB", 3 << 29), ("1048576", 1 << 20),
    (1048576, 1 << 20), ("64 KiB", 64 << 10)])
def test_sizes_are_text_with_a_unit_or_a_byte_count(tmp_path: Path, text: str | int,
                                                    size: int) -> None:
    settings = _settings(tmp_path, {**REQUIRED, "mem_budget": text, "tenant_read_bytes": text})
    assert settings.mem_budget == size and settings.config().mem_budget == size
    assert settings.config().tenant_read_bytes == size


def test_a_flag_wins_over_the_file_and_the_file_over_the_defaults(tmp_path: Path) -> None:
    file = {**REQUIRED, "replicas": 3, "mem_budget": "64MiB", "mem_prefault": True,
            "prefix": "/file/", "disk_fsync": "off"}
    config = _settings(tmp_path, file).config()
    assert (config.replicas, config.mem_budget, config.etcd_prefix) == (3, 64 << 20, "/file/")
    # A boolean flag left out does not say False over the file's true; --no-mem-prefault does.
    assert config.mem_prefault is True and config.disk_fsync is False
    assert _settings(tmp_path, file, "--no-mem-prefault").config().mem_prefault is False
    config = _settings(tmp_path, file, "--replicas", "1", "--mem-budget", "128MiB",
                       "--etcd-prefix", "/flag/", "--disk-fsync", "block",
                       "--node-id", "from-flag").config()
    assert (config.replicas, config.mem_budget, config.etcd_prefix) == (1, 128 << 20, "/flag/")
    assert config.node_id == "from-flag" and config.disk_fsync is True
    assert config.lease_ttl == 5  # in neither: DaemonConfig's default


def test_a_flag_is_checked_as_its_key_is(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"the command line: bad size '12X'.*`\$.mem_budget`"):
        _settings(tmp_path, None, *[f"--{k.replace('_', '-')}={v}" for k, v in REQUIRED.items()],
                  "--mem-budget", "12X")


def test_a_key_out_of_range_is_refused_by_its_name(tmp_path: Path) -> None:
    """From a file or a flag alike, before any daemon is built."""
    for given, where in (({"replicas": 0}, r"`\$.replicas`"),
                         ({"lease_ttl": -1}, r"`\$.lease_ttl`"),
                         ({"tenant_put_share": 1.5}, r"`\$.tenant_put_share`"),
                         ({"tenant_manifest_share": 0.0}, r"`\$.tenant_manifest_share`"),
                         ({"drain_timeout": -1.0}, r"`\$.drain_timeout`"),
                         ({"idle_timeout": 0.0}, r"`\$.idle_timeout`"),
                         ({"writer_quiet": -0.1}, r"`\$.writer_quiet`")):
        with pytest.raises(ConfigError, match=where):
            _settings(tmp_path, {**REQUIRED, **given})
    with pytest.raises(ConfigError, match=r"the command line: .*`\$.workers`"):
        _settings(tmp_path, None, *[f"--{k.replace('_', '-')}={v}" for k, v in REQUIRED.items()],
                  "--workers", "0")
    # A daemon built in code (no settings) is still checked by DaemonConfig.
    with pytest.raises(ConfigError, match="must be >= 1"):
        DaemonConfig(listen="127.0.0.1:1", data_dir=tmp_path, mem_budget=1, disk_budget=1,
                     node_id="n", replicas=0)
    with pytest.raises(ConfigError, match="--writer-defer-max"):
        DaemonConfig(listen="127.0.0.1:1", data_dir=tmp_path, mem_budget=1, disk_budget=1,
                     node_id="n", writer_defer_max=-1.0)


def test_json_files_and_bad_files(tmp_path: Path) -> None:
    settings = _settings(tmp_path, {**REQUIRED, "workers": 2}, name="daemon.json")
    assert settings.workers == 2
    for name, text, message in (
            ("list.yaml", "- listen\n", "must be a mapping"),
            ("broken.yaml", "listen: [\n", "broken.yaml"),
            ("broken.json", "{", "broken.json")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=message):
            settings_from_args(build_serve_parser().parse_args(
                ["--config", str(tmp_path / name)]))
    with pytest.raises(ConfigError, match="cannot read"):
        settings_from_args(build_serve_parser().parse_args(
            ["--config", str(tmp_path / "missing.yaml")]))


def test_the_cross_field_checks_run_after_parsing(tmp_path: Path) -> None:
    for given, message in (
            ({"tls_cert": "/c"}, "--tls-cert and --tls-key go together"),
            ({"tls_server_name": "s"}, "--tls-server-name .* needs --tls-ca"),
            ({"listen": "0.0.0.0:7400"}, "loopback only"),
            ({"etcd_ca": "/ca"}, "etcd_ca given without etcd"),
            ({"etcd": "http://e:2379", "etcd_ca": "/ca"}, "plain http")):
        settings = _settings(tmp_path, {**REQUIRED, **given})
        with pytest.raises(ConfigError, match=message):
            settings.config()


def test_the_registry_keys_mean_the_same_in_the_daemon_and_its_clients(
        tmp_path: Path) -> None:
    shared = {"etcd": "https://e1:2379,https://e2:2379", "etcd_ca": "/pki/ca",
              "etcd_cert": "/pki/crt", "etcd_key": "/pki/key", "etcd_user": "kvkeep",
              "etcd_password_file": "/pki/pw", "prefix": "/p/",
              "registration_public_key": "/k.pub"}
    daemon = _settings(tmp_path, {**REQUIRED, **shared}).config()
    plugin = PluginSettings.from_params(shared)
    remote = ConnectorConfig.from_extra({"store": {"remote": shared}}).store.remote
    assert remote is not None
    assert daemon.etcd == plugin.etcd == remote.etcd
    assert daemon.etcd_prefix == plugin.prefix == remote.prefix == "/p/"
    assert str(daemon.registration_public_keys) == plugin.registration_public_key \
        == remote.registration_public_key
    # Checked the same way too: an etcd_* key without etcd is refused by all three.
    for parse in (lambda: _settings(tmp_path, {**REQUIRED, "etcd_user": "u"}).config(),
                  lambda: PluginSettings.from_params({"daemons": ["h:1"], "etcd_user": "u"})):
        with pytest.raises(ConfigError, match="etcd_user given without etcd"):
            parse()


# -- a real daemon from a file ------------------------------------------------------------------

def test_a_daemon_started_from_a_config_file_serves(tmp_path: Path) -> None:
    token = "token-config-file-0123456789"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{token} tenant-a\n")
    port = free_port()
    data_dir = tmp_path / "data"
    config = tmp_path / "daemon.yaml"
    config.write_text(
        f"listen: 127.0.0.1:{port}\n"
        f"data_dir: {data_dir}\n"
        "node_id: from-file\n"
        "mem_budget: 64MiB\n"
        "disk_budget: 128MiB\n"
        f"token_file: {tokens}\n"
        "drain_timeout: 5\n"
        "metrics_listen: 'off'\n")
    # `python -m kvstore.daemon` is what `kvkeep store serve` re-executes itself as.
    daemon = DaemonProcess("from-flag", port, data_dir, tmp_path / "daemon.log",
                           ["--config", str(config), "--node-id", "from-flag"])
    daemon.spawn()
    try:
        daemon.wait_healthy()
        client = daemon.client(token)
        stat = client.stat(timeout=T)
        assert stat.node_id == "from-flag"  # the flag over the file
        assert stat.bytes_budget == (64 + 128) << 20  # the file's sizes
        key = block_key(1)
        frame = make_frame(key)
        assert client.put(scope_of(key), [(key.block_hash, frame)], timeout=T) == [True]
        read = client.get(scope_of(key), key.block_hash, timeout=T)
        assert read is not None and read.to_frame() == frame
        with pytest.raises(ConfigError, match="UNAUTHENTICATED"):  # the file's token table
            daemon.client().lookup(scope_of(key), [key.block_hash], timeout=T)
    finally:
        daemon.close_clients()
        assert daemon.terminate() == 0, daemon.log_text()[-3000:]


def test_kvkeep_store_serve_refuses_a_bad_file_with_status_2(tmp_path: Path) -> None:
    config = tmp_path / "daemon.yaml"
    config.write_text(f"listen: 127.0.0.1:0\ndata_dir: {tmp_path}\nnode_id: n\nreplica: 2\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KVKEEP_NO_MALLOC_TUNING": "1"}
    done = subprocess.run([sys.executable, "-m", "kvstore.commands", "store", "serve",
                           "--config", str(config)], capture_output=True, text=True,
                          timeout=60, env=env, check=False, cwd=REPO_ROOT)
    assert done.returncode == 2, done.stderr
    assert "unknown key(s) ['replica']" in done.stderr



def test_the_documented_example_parses(tmp_path: Path) -> None:
    doc = (REPO_ROOT / "docs" / "store.md").read_text()
    example = doc.split("kvkeep store serve --config", 1)[1].split("```yaml\n", 1)[1]
    path = tmp_path / "daemon.yaml"
    path.write_text(example.split("```", 1)[0])
    config = settings_from_args(build_serve_parser().parse_args(
        ["--config", str(path), "--node-id", "node-7"])).config()
    assert config.node_id == "node-7" and config.mem_budget == 16 << 30
    assert isinstance(config.etcd, EtcdSpec) and config.etcd.secure
