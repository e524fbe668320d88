"""The worker agent's `/metrics` relay (router/node/metrics_relay.py): vLLM's `/metrics` page, and
nothing else, on a port of its own. Against a stand-in vLLM (a real HTTP server on loopback)
here; tests/test_observability.py scrapes real vLLM servers through it (the dashboard's
`kvkeep-worker` job) and finds every connector series there."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import pytest

from deploy.local.daemons import REPO_ROOT
from deploy.local.services import EtcdServer, free_port, stop_process
from kvstore.errors import ConfigError
from router.node.metrics_relay import MetricsRelay, parse_listen
from tests.router_harness import wait_until

PAGE = b'# TYPE kvkeep_connector_restored_tokens_total counter\n' \
       b'kvkeep_connector_restored_tokens_total{engine="0"} 96.0\n'


class _StandIn(BaseHTTPRequestHandler):
    """vLLM's routes that matter here; `/metrics` says which Accept it was asked with."""

    status = 200
    body = PAGE

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b"", "text/plain")
        elif self.path == "/v1/models":
            self._send(200, b'{"data": [{"id": "m"}]}', "application/json")
        elif self.path == "/metrics":
            accept = self.headers.get("Accept", "-").encode()
            self._send(self.status, self.body + b"# accept " + accept + b"\n",
                       "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._send(404, b"", "text/plain")

    def do_POST(self) -> None:  # the API the relay must not carry
        self._send(200, b'{"choices": []}', "application/json")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


@contextlib.contextmanager
def _vllm(status: int = 200, body: bytes = PAGE) -> Iterator[str]:
    handler = type("Handler", (_StandIn,), {"status": status, "body": body})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def _through_relay(upstream: str, method: str, path: str,
                         headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as http:
        relay = MetricsRelay(f"{upstream}/metrics", http, "127.0.0.1", 0, timeout_s=2.0)
        port = await relay.start()
        try:
            async with http.request(method, f"http://127.0.0.1:{port}{path}",
                                    headers=headers) as resp:
                return resp.status, resp.headers.get("Content-Type", ""), await resp.read()
        finally:
            await relay.stop()


def test_relays_the_page_with_its_type_and_the_scrapers_accept() -> None:
    with _vllm() as upstream:
        status, kind, body = asyncio.run(_through_relay(
            upstream, "GET", "/metrics", {"Accept": "application/openmetrics-text"}))
    assert status == 200 and kind.startswith("text/plain; version=0.0.4")
    assert body == PAGE + b"# accept application/openmetrics-text\n"


def test_carries_nothing_but_metrics() -> None:
    with _vllm() as upstream:
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"),
                             ("GET", "/health"), ("POST", "/metrics")):
            status, _, _ = asyncio.run(_through_relay(upstream, method, path))
            assert status in (404, 405), (method, path, status)


def test_a_vllm_without_a_page_is_a_failed_scrape() -> None:
    with _vllm(status=500) as upstream:
        assert asyncio.run(_through_relay(upstream, "GET", "/metrics"))[0] == 502
    with _vllm(body=b"x" * (5 << 20)) as upstream:  # over METRICS_MAX_BYTES
        assert asyncio.run(_through_relay(upstream, "GET", "/metrics"))[0] == 502
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: not stale numbers, an error
    status, _, body = asyncio.run(_through_relay(dead, "GET", "/metrics"))
    assert status == 502 and b"unreadable" in body


def test_listen_flag_is_host_and_port() -> None:
    assert parse_listen("0.0.0.0:8001") == ("0.0.0.0", 8001)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("8001", ":8001", "host:", "host:99999", "host:x"):
        with pytest.raises(ConfigError):
            parse_listen(bad)


def test_kvkeep_worker_relays_while_it_registers(etcd_server: EtcdServer,
                                                 tmp_path: Path) -> None:
    """The real `kvkeep worker` command against a real etcd: the relay answers with the
    server's page; a taken port is a clear error and exit status 2."""
    metrics = free_port()
    with _vllm() as upstream:
        argv = [sys.executable, "-m", "kvstore.commands", "worker", "--etcd", etcd_server.url,
                "--url", upstream, "--id", "w0", "--metrics-listen", f"127.0.0.1:{metrics}"]
        log = tmp_path / "agent.log"
        with log.open("wb") as out:
            agent = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            async def scrape() -> bytes:
                async with aiohttp.ClientSession() as http, http.get(
                        f"http://127.0.0.1:{metrics}/metrics") as resp:
                    return await resp.read() if resp.status == 200 else b""

            def relayed() -> bool:
                try:
                    return asyncio.run(scrape()).startswith(PAGE)
                except aiohttp.ClientError:
                    return False
            try:
                wait_until(relayed, timeout=30, step=0.2)
            except TimeoutError:
                raise AssertionError(log.read_text()) from None
            taken = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True,
                                   timeout=60, check=False)
            assert taken.returncode == 2
            assert f"cannot serve metrics on 127.0.0.1:{metrics}" in taken.stderr
        finally:
            stop_process(agent)
        assert agent.returncode == 0, log.read_text()
