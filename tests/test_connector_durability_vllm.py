"""Checkpoint durability (RPO) with real vLLM workers: a worker SIGKILLed 0 ms after a response
ends, and the next turn on another worker.

Two kvstore daemons (R=2). Each worker under test (a real `vllm serve`, multiprocess) reaches
them over a slow link (`deploy.chaos.slow_link`: its bytes arrive seconds late), so a block's copy
to the daemons lags its computation by at least that: the window in which a dying node takes
its KV along. The client reads the whole response, the worker's process group is SIGKILLed at
once and its link cut (bytes it had not got out are lost with it); a fresh engine elsewhere
(in-process, straight to the daemons) then runs the next turn, whose prompt starts with the
previous prompt and answer, and reports how many tokens it restored.

- `durability` on: the response is only sent once its KV is on both daemons, so both daemons
  hold every full block of the prompt when the client has it (checked directly), and the next
  turn elsewhere restores every one of them even with one of the two daemons killed as well;
  the worker's `/metrics` shows each remote copy's lag (at least the link's delay).
- `durability` off (write-behind): the same response completes long before its blocks reach
  the daemons, and the next turn restores nothing: the setting is what keeps the KV.

One module of engines (two servers, one in-process engine) serves every test, in file order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.chaos.slow_link import SlowLink, slow_links
from deploy.local.daemons import DaemonProcess, running_daemons
from deploy.local.engines import vllm_env
from deploy.local.vllm_server import VllmServer, start_vllm
from kvstore.metrics import COPY_LAG_BUCKETS
from tests.connector_harness import (
    BLOCK_SIZE,
    block_hashes,
    generate,
    kv_transfer_config,
    open_engine,
    random_prompts,
    worker_connector,
)
from tests.metrics_scrape import Scrape, wait_for_sample
from tests.models import TinyModel
from tests.test_store_replicated import copies_on

pytestmark = pytest.mark.slow

DELAY_S = 1.5
"""Every call from the durable worker to a daemon takes this much longer: each copy's lag is at
least this (the durable response waits for a lookup and a put: about 3 s)."""
BEHIND_DELAY_S = 6.0
"""The same for the write-behind worker. Its copy needs two calls (which daemons lack the block,
then the put) after the prefill step, 12 s: the response (a few decode steps, its own lookups
cut short by `BEHIND_LOOKUP_MS`) ends long before that, on however loaded a machine."""
BEHIND_LOOKUP_MS = 300
MODEL_ID = "tiny-durability"
PROMPT_TOKENS = 100  # 3 full blocks and 4 tokens: no block completes during the 4 decode steps
MAX_TOKENS = 4


@dataclass
class Worker:
    server: VllmServer
    links: dict[str, SlowLink]

    def die(self) -> None:
        """A node lost: its processes SIGKILLed, its link cut."""
        self.server.kill()
        for link in self.links.values():
            link.sever()


@dataclass
class Cluster:
    daemons: list[DaemonProcess]
    durable: Worker
    write_behind: Worker
    elsewhere: Any  # the in-process vLLM engine of the next turn


def _connector(daemons: dict[str, str], *, name: str, **extra: Any) -> dict[str, Any]:
    return kv_transfer_config(
        {"host_bytes": 64 << 20, "name": name,
         "remote": {"daemons": daemons, "replicas": 2, "timeout_ms": 20000}},
        model_id=MODEL_ID, **{"restore_deadline_ms": 20000, **extra})


def _worker(model: Path, logs: Path, daemons: list[DaemonProcess], *, durable: bool,
            links: dict[str, SlowLink]) -> VllmServer:
    extra: dict[str, Any] = ({"durability": {"replicas": 2, "timeout_ms": 20000}} if durable
                             else {"restore_deadline_ms": BEHIND_LOOKUP_MS})
    config = _connector({n: link.address for n, link in links.items()},
                        name="durable" if durable else "write-behind", **extra)
    return start_vllm(model, logs, kv_events=False,
                      extra_args=["--kv-transfer-config", json.dumps(config)])


@pytest.fixture(scope="module")
def cluster(tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("durability")
    # No bulk data plane: every byte to a daemon goes over gRPC, through the slow link.
    with running_daemons(base, 2, extra=["--data-listen", "off"]) as daemons:
        direct = {d.node_id: d.address for d in daemons}
        with slow_links(direct, DELAY_S) as durable_links, \
                slow_links(direct, BEHIND_DELAY_S) as behind_links:
            servers = {
                "durable": _worker(tiny.path, base, daemons, durable=True, links=durable_links),
                "behind": _worker(tiny.path, base, daemons, durable=False, links=behind_links)}
            # The servers hash blocks with PYTHONHASHSEED=0 (deploy.local.engines.vllm_env); the
            # engine elsewhere must chain its block hashes from the same seed to find theirs.
            try:
                with pytest.MonkeyPatch.context() as env:
                    env.setenv("PYTHONHASHSEED", vllm_env()["PYTHONHASHSEED"])
                    with open_engine(tiny.path, _connector(direct, name="elsewhere"),
                                     dtype="float32") as elsewhere:
                        for server in servers.values():
                            server.wait_healthy()
                        yield Cluster(daemons, Worker(servers["durable"], durable_links),
                                      Worker(servers["behind"], behind_links), elsewhere)
            finally:
                for server in servers.values():
                    server.kill()


def _respond_then_die(worker: Worker, prompt: list[int]) -> list[int]:
    """One completion read to its end, then the worker's node dies at once; its answer."""
    reply = httpx.post(f"{worker.server.url}/v1/completions", timeout=120, json={
        "model": worker.server.name, "prompt": prompt, "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    worker.die()  # 0 ms after the client has the whole response
    reply.raise_for_status()
    answer = reply.json()["choices"][0]["token_ids"]
    assert len(answer) == MAX_TOKENS
    return [int(t) for t in answer]


def _next_turn_elsewhere(cluster: Cluster, history: list[int]) -> int:
    """The next turn (history plus a new user message) on the other engine: tokens restored.
    Two tokens: a request that ends in its prefill step is answered before its load reports."""
    (result,) = generate(cluster.elsewhere, [history + random_prompts(1, 40, seed=7)[0]], 2)
    return int((result.kv_transfer_params or {}).get("restored_tokens", 0))


def _prompt_copies(cluster: Cluster, prompt: list[int]) -> list[int]:
    from kvstore.keys import BlockKey, Namespace

    fingerprint = worker_connector().fingerprint  # the engine elsewhere: the same model
    keys = [BlockKey.of(fingerprint, Namespace("default"), h) for h in block_hashes(prompt)]
    return copies_on(cluster.daemons, keys)


def _connector_sample(m: Scrape, name: str, **labels: str) -> float:
    return m.value(f"kvkeep_connector_{name}", **labels)


# The tests share one module of engines and run in this order: the durable worker serves once
# and shows its copy lag, the write-behind worker dies, then the durable one with a daemon.

def test_durable_copy_lag_on_vllms_metrics(cluster: Cluster) -> None:
    """The recovery point on vLLM's /metrics: every remote copy's lag (computation to the R-th
    daemon's acknowledgement) is at least the link's delay, and the response waited for it."""
    prompt = random_prompts(1, PROMPT_TOKENS, seed=55)[0]
    full_blocks = PROMPT_TOKENS // BLOCK_SIZE
    reply = httpx.post(f"{cluster.durable.server.url}/v1/completions", timeout=120, json={
        "model": cluster.durable.server.name, "prompt": prompt, "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True})
    reply.raise_for_status()
    assert _prompt_copies(cluster, prompt) == [2] * full_blocks  # when the response ended
    url = f"{cluster.durable.server.url}/metrics"
    m = wait_for_sample(url, lambda s: _connector_sample(
        s, "store_copy_lag_seconds_count", tier="remote") >= full_blocks, timeout=60)
    fast = max(b for b in COPY_LAG_BUCKETS if b < DELAY_S)
    assert _connector_sample(m, "store_copy_lag_seconds_bucket", tier="remote",
                             le=str(fast)) == 0
    assert _connector_sample(m, "store_copy_lag_seconds_sum", tier="remote") \
        >= full_blocks * DELAY_S
    assert _connector_sample(m, "events_total", event="durable_blocks") >= full_blocks
    assert _connector_sample(m, "events_total", event="durable_missed") == 0


def test_write_behind_loses_a_response_killed_right_after_it_ends(cluster: Cluster) -> None:
    prompt = random_prompts(1, PROMPT_TOKENS, seed=202)[0]
    answer = _respond_then_die(cluster.write_behind, prompt)
    # The response was complete while its blocks were still on the way: lost with the node.
    assert _prompt_copies(cluster, prompt) == [0] * (PROMPT_TOKENS // BLOCK_SIZE)
    assert _next_turn_elsewhere(cluster, prompt + answer) == 0


def test_durable_response_survives_its_node_and_a_daemon(cluster: Cluster) -> None:
    """SIGKILL 0 ms after the response ends, and one of the R=2 daemons dies too: the next
    turn elsewhere still restores every full block of the response's prompt."""
    prompt = random_prompts(1, PROMPT_TOKENS, seed=101)[0]
    full_blocks = PROMPT_TOKENS // BLOCK_SIZE
    answer = _respond_then_die(cluster.durable, prompt)
    # Both daemons held every full block of the prompt when the response was sent.
    assert _prompt_copies(cluster, prompt) == [2] * full_blocks
    lost = cluster.daemons[0]
    lost.kill()
    try:
        assert _next_turn_elsewhere(cluster, prompt + answer) == full_blocks * BLOCK_SIZE
    finally:
        lost.spawn()
        lost.wait_healthy()
