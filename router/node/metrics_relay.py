"""The worker agent's `/metrics` relay: its vLLM server's `/metrics` page, and nothing else, on
a port of its own (`kvkeep worker --metrics-listen HOST:PORT`).

Why: vLLM serves its metrics, and the connector's `kvkeep_connector_*` series that ride on
them, on its API port. A NetworkPolicy that lets Prometheus scrape them there lets it send
prompts and read completions too. The agent sits beside vLLM in the pod, so relaying that one
page on another port lets the policy admit Prometheus to this port only
(deploy/k8s/networkpolicy.yaml). Each scrape is one fresh read of vLLM's page (nothing cached,
so a dead vLLM is a failed scrape, not stale numbers), capped at `METRICS_MAX_BYTES`.
"""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

from kvstore.errors import ConfigError
from router.errors import UpstreamTooLarge
from router.limits import METRICS_MAX_BYTES, read_capped

__all__ = ["MetricsRelay", "parse_listen"]

log = logging.getLogger(__name__)

_FALLBACK_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def parse_listen(value: str) -> tuple[str, int]:
    """`HOST:PORT` (port 0: any free one) as the flag gives it; ConfigError otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--metrics-listen must be HOST:PORT, not {value!r}")
    return host.strip("[]"), int(port)


class MetricsRelay:
    """GET /metrics answers with a fresh read of `upstream` (vLLM's `/metrics` URL); 502 when
    vLLM does not answer with a page. `start()` returns the bound port."""

    def __init__(self, upstream: str, http: aiohttp.ClientSession, host: str, port: int,
                 timeout_s: float = 5.0) -> None:
        self._upstream = upstream
        self._http = http
        self._bind = (host, port)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> int:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        host, port = self._bind
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        self._runner = runner
        self.port = int(runner.addresses[0][1])  # the bound one (port 0: any free port)
        log.info("relaying %s on %s:%d/metrics", self._upstream, host, self.port)
        return self.port

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        # Accept passes through so that vLLM's exposition negotiates the format Prometheus
        # asks for (OpenMetrics or text); the body is passed on as vLLM wrote it.
        headers = {"Accept": request.headers["Accept"]} if "Accept" in request.headers else {}
        try:
            async with self._http.get(self._upstream, headers=headers, allow_redirects=False,
                                      timeout=self._timeout) as resp:
                body = await read_capped(resp, METRICS_MAX_BYTES, self._upstream)
                if resp.status != 200:
                    return web.Response(status=502,
                                        text=f"vLLM's /metrics answered {resp.status}\n")
                kind = resp.headers.get("Content-Type", _FALLBACK_TYPE)
        except (TimeoutError, aiohttp.ClientError, OSError, UpstreamTooLarge) as exc:
            return web.Response(status=502, text=f"vLLM's /metrics unreadable: {exc}\n")
        return web.Response(body=body, headers={"Content-Type": kind})
