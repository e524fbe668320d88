"""A real Prometheus server on loopback for a local run: scrape config, rules, HTTP queries.

Debian's `prometheus` package (`apt-get install prometheus`, which `make setup` does) brings the
server and `promtool`; apt does not start it here, and this starts its own: its own port, data
dir and config, stopped by pid. Scrapes every second, so a run of a minute has enough samples
for `rate(...[1m])`.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from deploy.local.processes import free_port
from kvstore.errors import ConfigError

__all__ = ["PrometheusServer", "ScrapeJob", "Series", "prometheus_binary"]


@dataclass(frozen=True, slots=True)
class ScrapeJob:
    name: str
    targets: tuple[str, ...]
    """host:port of each target (`/metrics` on each)."""
    ca_file: Path | None = None
    """Scrape over HTTPS, the targets' certificates checked against this CA under
    `server_name` (the TLS daemons' `/metrics`, as deploy/k8s/monitoring.yaml scrapes them)."""
    server_name: str | None = None

    def config(self) -> dict[str, Any]:
        """This job's entry of prometheus.yml's `scrape_configs`."""
        job: dict[str, Any] = {"job_name": self.name,
                               "static_configs": [{"targets": list(self.targets)}]}
        if self.ca_file is not None:
            job["scheme"] = "https"
            job["tls_config"] = {"ca_file": str(self.ca_file),
                                 **({"server_name": self.server_name}
                                    if self.server_name else {})}
        return job


@dataclass(frozen=True, slots=True)
class Series:
    labels: Mapping[str, str]
    points: tuple[tuple[float, float], ...]
    """(unix time, value), NaN and Inf dropped."""


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class PrometheusServer:
    """`start()` writes prometheus.yml into `directory` and runs the server; `stop()`."""

    def __init__(self, directory: Path, jobs: Sequence[ScrapeJob], *,
                 rule_files: Sequence[Path] = (), interval_s: float = 1.0) -> None:
        self._dir = directory
        self._jobs = tuple(jobs)
        self._rules = tuple(rule_files)
        self._interval = interval_s
        self._proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        binary = prometheus_binary()
        if binary is None:
            raise ConfigError("prometheus is not installed (`apt-get install prometheus`)")
        self._dir.mkdir(parents=True, exist_ok=True)
        interval = f"{int(self._interval * 1000)}ms"
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval,
                       "scrape_timeout": interval},
            "rule_files": [str(path) for path in self._rules],
            "scrape_configs": [job.config() for job in self._jobs]}
        config_path = self._dir / "prometheus.yml"
        config_path.write_bytes(msgspec.yaml.encode(config))
        self.port = free_port()
        log = (self._dir / "prometheus.log").open("wb")
        try:
            self._proc = subprocess.Popen(
                [binary, f"--config.file={config_path}",
                 f"--storage.tsdb.path={self._dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ConfigError("prometheus exited: "
                                  + (self._dir / "prometheus.log").read_text()[-2000:])
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError("prometheus did not become ready")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the HTTP API ---------------------------------------------------------------------------

    def api(self, path: str, **params: str) -> Any:
        """`/api/v1/<path>`'s `data`; ValueError with Prometheus' message on an error."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise ValueError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def metric_names(self) -> set[str]:
        return set(self.api("label/__name__/values"))

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        data = self.api("query", query=expr, **({"time": str(at)} if at else {}))
        return list(data["result"]) if data["resultType"] in ("vector", "matrix") else [data]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        data = self.api("query_range", query=expr, start=str(start), end=str(end),
                        step=str(step))
        out = []
        for result in data["result"]:
            points = []
            for t, v in result["values"]:
                value = float(v)
                if math.isfinite(value):
                    points.append((float(t), value))
            out.append(Series(dict(result["metric"]), tuple(points)))
        return out

    def rules(self) -> list[dict[str, Any]]:
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]

    def targets_up(self) -> dict[str, bool]:
        return {t["scrapeUrl"]: t["health"] == "up" for t in self.api("targets")["activeTargets"]}
