"""The connector announces what it checkpointed through vLLM's own KV event stream, and the
router's index reads it: a real engine publishing over ZMQ, decoded by the router's subscriber.

With remote daemons the store's blocks count for every worker (`KVKEEP_SHARED`); with a store
on the worker's node only, for that worker, as storage (`KVKEEP_LOCAL`).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from deploy.local.daemons import start_daemon
from deploy.local.engines import events_endpoint
from deploy.local.services import free_port
from router.indexer.events import SHARED, KVBlockIndex
from router.indexer.subscriber import KVEventSubscriber
from router.membership.workers import WorkerId
from tests.connector_harness import (
    BLOCK_SIZE,
    generate,
    kv_transfer_config,
    open_engine,
    random_prompts,
    scheduler_connector,
)
from tests.models import TinyModel

pytestmark = pytest.mark.slow

PROMPTS = random_prompts(3, [70, 130, 200], seed=7)
(SALTED,) = random_prompts(1, [100], seed=8)
SALT = "tenant-x-salt"


def _collect(sock: zmq.Socket[bytes], subscriber: KVEventSubscriber, worker: WorkerId,
             quiet_s: float = 3.0) -> int:
    """Feed every message until the stream has been quiet for `quiet_s`; returns how many."""
    count = 0
    while sock.poll(int(quiet_s * 1000)):
        subscriber.handle(worker, sock.recv_multipart())
        count += 1
    return count


@pytest.mark.parametrize("where", ["shared", "local"])
def test_checkpointed_prefixes_reach_the_router_index(tiny: TinyModel, tmp_path: Path,
                                                      where: str) -> None:
    if where == "shared":
        daemon = start_daemon(tmp_path, "ev1")
        store: dict[str, object] = {"name": "events-shared",
                                    "remote": {"daemons": {daemon.node_id: daemon.address}}}
    else:
        store = {"name": "events-local", "host_bytes": 64 << 20}
    # The endpoint vLLM binds on loopback alone (deploy/local/engines.events_endpoint says
    # why); the SUB side connects over loopback, as the router does.
    port = free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": events_endpoint("127.0.0.1", port), "topic": "kv"}
    index = KVBlockIndex(block_size=BLOCK_SIZE)
    subscriber = KVEventSubscriber(index)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        with open_engine(tiny.path, kv_transfer_config(store),
                         kv_events_config=events) as llm:
            sock.connect(f"tcp://127.0.0.1:{port}")
            # A SUB socket misses what is published before its subscription arrives: warm up
            # with other prompts until something comes through.
            deadline = time.monotonic() + 60
            seed = 100
            while not sock.poll(2000):
                assert time.monotonic() < deadline, "no KV event ever arrived"
                generate(llm, random_prompts(1, [40], seed=seed), 1)
                seed += 1
            _collect(sock, subscriber, WorkerId("w1"))
            generate(llm, PROMPTS, 8)
            # A tenant's salted prompt (as the router sends it with API keys).
            from vllm import SamplingParams
            llm.generate([{"prompt_token_ids": SALTED, "cache_salt": SALT}],
                         SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            # vLLM's own events for its device cache are there too: clear them, so that what
            # is left in the index is the store's alone.
            llm.reset_prefix_cache()
            generate(llm, [[5, 6]], 1)  # a step, so that the scheduler publishes the reset
            assert _collect(sock, subscriber, WorkerId("w1")) > 0
            published = scheduler_connector(llm).counters()["published_blocks"]
        assert subscriber.gaps == 0 and index.blocks_skipped == 0
        assert published >= sum(len(p) // BLOCK_SIZE for p in PROMPTS)
        for prompt in PROMPTS:
            full = len(prompt) // BLOCK_SIZE  # prefill saved every full block of the prompt
            got = index.match(index.keys_for(prompt))
            if where == "shared":  # any worker can restore these from the daemons
                assert got == {SHARED: pytest.approx(0.5 * full)}
            else:  # only this worker's node holds them, as storage
                assert got == {"w1": pytest.approx(0.5 * full)}
        # The salted prompt's store blocks match it under its tenant's salt only.
        salted_full = len(SALTED) // BLOCK_SIZE
        owner = SHARED if where == "shared" else "w1"
        assert index.match(index.keys_for(SALTED, SALT)) == {
            owner: pytest.approx(0.5 * salted_full)}
        assert index.match(index.keys_for(SALTED)) == {}
        assert index.match(index.keys_for(SALTED, "another-salt")) == {}
        # A prompt nobody stored matches nothing.
        (other,) = random_prompts(1, [96], seed=99)
        assert index.match(index.keys_for(other)) == {}
    finally:
        sock.close(0)
        ctx.term()
        if where == "shared":
            daemon.terminate()
