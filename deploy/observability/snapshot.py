"""`python -m deploy.observability.snapshot [--out PNG]`: the README's dashboard picture.

Starts a real local cluster (etcd, 2 daemons, 2 vLLM workers with the connector, their agents,
a router: `deploy.local.cluster`) and a real Prometheus scraping all of them every second with
the alert rules loaded, runs `deploy.observability.traffic.exercise` (a worker dies mid-stream),
then draws dashboard.json from that Prometheus (`deploy.observability.render`). Needs
`apt-get install prometheus`; about two minutes here.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from deploy.local.cluster import ClusterSpec, LocalCluster
from deploy.local.tls import STORE_NAME
from deploy.observability.prometheus import PrometheusServer, ScrapeJob
from deploy.observability.promql import ALERTS, DASHBOARD
from deploy.observability.render import render_dashboard
from deploy.observability.traffic import exercise

__all__ = ["observed_cluster", "scrape_jobs", "main"]

DEFAULT_OUT = Path(__file__).resolve().parent / "dashboard.png"


def scrape_jobs(cluster: LocalCluster) -> list[ScrapeJob]:
    """The jobs the dashboard's queries expect (`job="kvkeep-daemon"` ...), as the
    ServiceMonitors in deploy/k8s/monitoring.yaml name them; the workers through their agents'
    relay of vLLM's /metrics, as there; with TLS on, the daemons over HTTPS checked against
    the cluster's CA under the store's name, as there."""
    pki = cluster.pki
    return [
        ScrapeJob("kvkeep-daemon", tuple(f"{d.host}:{d.metrics_port}" for d in cluster.daemons),
                  ca_file=None if pki is None else pki.store.ca,
                  server_name=None if pki is None else STORE_NAME),
        ScrapeJob("kvkeep-router", tuple(f"127.0.0.1:{r.port}" for r in cluster.routers)),
        ScrapeJob("kvkeep-worker", tuple(f"{w.host}:{w.metrics_port}"
                                         for w in cluster.workers.values()))]


@contextlib.contextmanager
def observed_cluster(base_dir: Path, say: Callable[[str], None] | None = None
                     ) -> Iterator[tuple[LocalCluster, PrometheusServer]]:
    """A started local cluster and a Prometheus scraping it; both stopped at the end."""
    speak = say or (lambda _line: None)
    with LocalCluster(ClusterSpec(daemons=2, workers=2, routers=1,
                                  base_dir=base_dir / "cluster")) as cluster:
        speak("cluster up")
        with PrometheusServer(base_dir / "prometheus", scrape_jobs(cluster),
                              rule_files=[ALERTS]) as prometheus:
            speak(f"prometheus on {prometheus.url}")
            yield cluster, prometheus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.observability.snapshot",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="kvkeep-snapshot-") as tmp, \
            observed_cluster(Path(tmp), say) as (cluster, prometheus):
        log = exercise(cluster, say=say)
        drawn = render_dashboard(DASHBOARD, prometheus, log.started - 5, log.ended, args.out)
        say(f"{drawn} series drawn into {args.out} ({log.turns} turns, killed {log.killed}, "
            f"{log.restored_turns} restored turns)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
