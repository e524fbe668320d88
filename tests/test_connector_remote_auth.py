"""The connector against a kvstore daemon that requires a bearer token (`store.remote.token_file`):
the right token restores from the daemon, a wrong one is refused and the engine recomputes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.local.daemons import DaemonProcess, running_daemon
from tests.connector_harness import (
    Result,
    generate,
    kv_transfer_config,
    open_engine,
    random_prompts,
    scheduler_connector,
)
from tests.models import TinyModel

pytestmark = pytest.mark.slow

PROMPTS = random_prompts(2, [100, 140], seed=31)
MAX_TOKENS = 8


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    tokens = tmp_path / "daemon-tokens"
    tokens.write_text("s3cret-token-0123456789 default\n")
    with running_daemon(tmp_path, "auth1", token_file=tokens) as proc:
        yield proc


def _store(daemon: DaemonProcess, token_file: Path, name: str) -> dict[str, object]:
    return {"name": name, "remote": {"daemons": {daemon.node_id: daemon.address},
                                     "token_file": str(token_file), "timeout_ms": 1000}}


def test_token_file_authenticates_the_connector(tiny: TinyModel, daemon: DaemonProcess,
                                                tmp_path: Path) -> None:
    good, bad = tmp_path / "good-token", tmp_path / "bad-token"
    good.write_text("# the daemon's token for tenant 'default'\ns3cret-token-0123456789\n")
    bad.write_text("not-the-token-0123456789\n")
    with open_engine(tiny.path) as llm:
        reference: list[Result] = generate(llm, PROMPTS, MAX_TOKENS)

    with open_engine(tiny.path, kv_transfer_config(_store(daemon, good, "writer"))) as llm:
        assert [r.tokens for r in generate(llm, PROMPTS, MAX_TOKENS)] == [
            r.tokens for r in reference]

    with open_engine(tiny.path, kv_transfer_config(_store(daemon, good, "reader"))) as llm:
        restored = generate(llm, PROMPTS, MAX_TOKENS)
        assert [r.tokens for r in restored] == [r.tokens for r in reference]
        assert all(r.num_cached_tokens >= 64 for r in restored)  # came from the daemon

    with open_engine(tiny.path, kv_transfer_config(_store(daemon, bad, "intruder"))) as llm:
        refused = generate(llm, PROMPTS, MAX_TOKENS)
        assert [r.tokens for r in refused] == [r.tokens for r in reference]
        assert all(r.num_cached_tokens == 0 for r in refused)
        assert scheduler_connector(llm).counters()["lookup_hit_blocks"] == 0
