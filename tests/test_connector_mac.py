"""Forged KV (issue 13 item 4) against real vLLM engines: someone who holds the tenant's daemon
token, but not its MAC key, replaces the tenant's blocks on the daemon with frames that verify
(checksums, key binding, the engine's codec, layout and shape). An engine without the key
restores them and answers wrongly; an engine with `mac_key_file` refuses every one of them,
recomputes, answers as the reference, and its saves replace the forgeries with signed frames.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from deploy.local.daemons import DaemonProcess, running_daemon
from kvstore.block import encode_block
from kvstore.keys import BlockKey, Namespace
from kvstore.mac import MacKey, verify_mac
from kvstore.net.daemon_client import DaemonClient
from kvstore.net.scope import Scope
from tests.connector_harness import (
    BLOCK_SIZE,
    block_hashes,
    engine_block_shape,
    generate,
    kv_transfer_config,
    open_engine,
    random_prompts,
    scheduler_connector,
    worker_connector,
)
from tests.models import TinyModel

pytestmark = pytest.mark.slow

TOKEN = "tenant-default-token-0123456789"
PROMPTS = random_prompts(2, [100, 140], seed=43)
MAX_TOKENS = 8


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    tokens = tmp_path / "daemon-tokens"
    tokens.write_text(f"{TOKEN} default\n")
    with running_daemon(tmp_path, "mac1", token_file=tokens) as proc:
        yield proc


def _config(daemon: DaemonProcess, tmp: Path, name: str, mac_key: Path | None
            ) -> dict[str, Any]:
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    store = {"name": name, "remote": {"daemons": {daemon.node_id: daemon.address},
                                      "token_file": str(token), "timeout_ms": 2000}}
    extra = {} if mac_key is None else {"mac_key_file": str(mac_key)}
    return kv_transfer_config(store, **extra)


def test_kv_forged_with_the_tenants_token_is_refused_by_an_engine_with_the_mac_key(
        tiny: TinyModel, daemon: DaemonProcess, tmp_path: Path) -> None:
    key_file = tmp_path / "tenant.mac"
    key_file.write_text(bytes(range(100, 132)).hex())
    mac_key = MacKey.from_file(key_file)
    with open_engine(tiny.path) as llm:
        reference = [r.tokens for r in generate(llm, PROMPTS, MAX_TOKENS)]

    with open_engine(tiny.path, _config(daemon, tmp_path, "writer", key_file)) as llm:
        assert [r.tokens for r in generate(llm, PROMPTS, MAX_TOKENS)] == reference
        fingerprint = scheduler_connector(llm).fingerprint
        assert worker_connector().counters()["saved_blocks"] > 0

    # The attacker: the tenant's daemon token, no MAC key. Each block of the prompts is
    # replaced by a frame of its own (random KV, the engine's layout), half of them signed
    # with a key of the attacker's own.
    namespace = Namespace("default")
    scope = Scope(fingerprint.digest, namespace)
    shape = engine_block_shape(fingerprint)
    gen = torch.Generator().manual_seed(11)
    attacker = DaemonClient(daemon.node_id, daemon.address, token=TOKEN)
    own_key = MacKey(bytes(32))
    forged = 0
    try:
        for prompt in PROMPTS:
            for i, block_hash in enumerate(block_hashes(prompt)):
                key = BlockKey.of(fingerprint, namespace, block_hash)
                stored = attacker.get(scope, block_hash, timeout=10)
                assert stored is not None  # the writer's block ...
                verify_mac(stored.header, mac_key)  # ... signed with the tenant's key
                layers = [(torch.randn(shape, generator=gen) * 4).to(torch.bfloat16)
                          for _ in range(fingerprint.num_layers)]
                frame = encode_block(layers, codec="raw", key=key, token_count=BLOCK_SIZE,
                                     layout_id=fingerprint.layout_id, compression="none",
                                     signer=own_key if i % 2 else None)
                attacker.delete(scope, [block_hash], timeout=10)
                assert attacker.put(scope, [(block_hash, frame)], timeout=10) == [True]
                forged += 1
    finally:
        attacker.close()

    # Without the key an engine takes the forgeries for KV: it answers wrongly.
    with open_engine(tiny.path, _config(daemon, tmp_path, "keyless", None)) as llm:
        fooled = generate(llm, PROMPTS, MAX_TOKENS)
        assert all(r.num_cached_tokens > 0 for r in fooled)
        assert [r.tokens for r in fooled] != reference

    # With the key every forgery is refused (a miss: recomputed) and the answers are right.
    with open_engine(tiny.path, _config(daemon, tmp_path, "reader", key_file)) as llm:
        results = generate(llm, PROMPTS, MAX_TOKENS)
        assert [r.tokens for r in results] == reference
        counters = worker_connector().counters()
        assert counters["load_forged"] >= len(PROMPTS)  # the first block of each, at least
        assert counters["loaded_blocks"] == 0

    # The refused forgeries were deleted and replaced by the reader's own, signed, saves.
    checker = DaemonClient(daemon.node_id, daemon.address, token=TOKEN)
    try:
        first = BlockKey.of(fingerprint, namespace, block_hashes(PROMPTS[0])[0])
        read = checker.get(scope, first.block_hash, timeout=10)
        assert read is not None
        verify_mac(read.header, mac_key)
    finally:
        checker.close()
    assert forged >= 5
