"""Settings mappings are read one way (kvstore/settings.py): the vLLM connector's
`kv_connector_extra_config` and the LMCache plugin's `adapter_params` refuse unknown keys at
every depth, all at once, take JSON types strictly, name the bad key, and spell the
remote-client keys the same way (one Struct), so a key means the same in both."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from connectors.lmcache.config import PluginSettings
from connectors.vllm.config import ConnectorConfig
from kvstore.errors import ConfigError
from kvstore.etcd import EtcdSpec
from kvstore.settings import DEFAULT_STORES_PREFIX

HOST: dict[str, Any] = {"store": {"host_bytes": 1 << 20}}


def test_every_unknown_key_is_named_at_once_with_its_path() -> None:
    with pytest.raises(ConfigError) as err:
        ConnectorConfig.from_extra({"store": {"host_bytes": 1, "nvme": {"path": "/d", "size": 1},
                                              "remote": {"etcd": "http://e:2379",
                                                         "tls_cafile": "/c"}},
                                    "checkpoint_token": 64})
    message = str(err.value)
    assert "$: unknown key(s) ['checkpoint_token']" in message
    assert "$.store.nvme: unknown key(s) ['size']" in message
    assert "$.store.remote: unknown key(s) ['tls_cafile']" in message
    assert "'checkpoint_tokens'" in message  # the known keys, to spot the typo


@pytest.mark.parametrize(("extra", "where"), [
    ({**HOST, "checkpoint_tokens": "64"}, "$.checkpoint_tokens"),  # a string is not a number
    ({**HOST, "checkpoint_tokens": 64.5}, "$.checkpoint_tokens"),
    ({**HOST, "checkpoint_tokens": True}, "$.checkpoint_tokens"),  # nor is a boolean
    ({**HOST, "restore_deadline_ms": float("inf")}, "$.restore_deadline_ms"),
    ({**HOST, "restore_deadline_ms": 0}, "$.restore_deadline_ms"),
    ({**HOST, "save_timeout_ms": -1}, "$.save_timeout_ms"),
    ({**HOST, "load_mode": "lazy"}, "$.load_mode"),
    ({"store": {"host_bytes": -1}}, "$.store.host_bytes"),
    ({"store": {"nvme": {"path": "/d", "durable": 1}}}, "$.store.nvme.durable"),
    ({"store": {"nvme": {"path": ""}}}, "$.store.nvme.path"),
    ({"store": {"redis": {"nodes": ["h:1", ""]}}}, "$.store.redis.nodes[1]"),
    ({**HOST, "durability": {"replicas": 0}}, "$.durability.replicas"),
])
def test_a_bad_value_is_refused_naming_its_key(extra: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"at `{where}`")):
        ConnectorConfig.from_extra(extra)


def test_what_needs_two_keys_is_checked_after_parsing() -> None:
    for extra, message in (
            ({"store": {"remote": {"etcd": "http://e:2379", "daemons": {"a": "h:1"}}}},
             "exactly one of 'etcd' and 'daemons'"),
            ({"store": {"redis": {"url": "redis://r:6379", "nodes": ["r:7000"]}}},
             "'url' .* or 'nodes'"),
            ({"store": {"redis": {"nodes": []}}}, "not empty"),
            ({**HOST, "durability": {}}, "needs store.remote"),
            ({**HOST, "restore_deadline_ms": 900, "hinted_restore_deadline_ms": 500},
             "hinted_restore_deadline_ms"),
            ({"store": {}}, "at least one of")):
        with pytest.raises(ConfigError, match=message):
            ConnectorConfig.from_extra(extra)


def test_the_remote_client_keys_mean_the_same_in_the_connector_and_the_plugin(
        tmp_path: Path) -> None:
    ca, cert, key, password = (str(tmp_path / name) for name in ("ca", "crt", "key", "pw"))
    shared = {"etcd": "https://e1:2379,https://e2:2379", "etcd_ca": ca, "etcd_cert": cert,
              "etcd_key": key, "etcd_user": "kvkeep", "etcd_password_file": password,
              "token_file": "/t", "registration_public_key": "/k.pub", "prefix": "/p/"}
    remote = ConnectorConfig.from_extra({"store": {"remote": shared}}).store.remote
    plugin = PluginSettings.from_params(shared)
    assert remote is not None and isinstance(remote.etcd, EtcdSpec)
    assert remote.etcd == plugin.etcd and remote.etcd.secure and remote.etcd.user == "kvkeep"
    assert (remote.prefix, remote.token_file, remote.registration_public_key) == \
        (plugin.prefix, plugin.token_file, plugin.registration_public_key)
    for prefix in (None, ""):  # null or empty: the daemons' default prefix, in both
        given = {"etcd": "http://e:2379", "prefix": prefix}
        spec = ConnectorConfig.from_extra({"store": {"remote": given}}).store.remote
        assert spec is not None and spec.prefix == DEFAULT_STORES_PREFIX
        assert PluginSettings.from_params(given).prefix == DEFAULT_STORES_PREFIX


def test_the_plugin_names_its_unknown_and_bad_keys_the_same_way() -> None:
    with pytest.raises(ConfigError, match=r"\$: unknown key\(s\) \['tennant'\]"):
        PluginSettings.from_params({"etcd": "http://e:2379", "tennant": "x"})
    with pytest.raises(ConfigError, match=r"\$\.tls: unknown key\(s\) \['cafile'\]"):
        PluginSettings.from_params({"etcd": "http://e:2379", "tls": {"ca": "/c", "cafile": "/c"}})
    with pytest.raises(ConfigError, match=r"at `\$\.replicas`"):
        PluginSettings.from_params({"etcd": "http://e:2379", "replicas": "2"})
