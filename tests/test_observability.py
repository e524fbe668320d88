"""The dashboard and the alert rules read only what the running components export.

Every PromQL expression in deploy/observability/dashboard.json and alerts.yaml is parsed and
its metric names extracted (`needed_metrics`), and the files are checked without a cluster
here. The run against real components is the demo's
(tests/test_deploy_demo.py::test_everything_the_dashboard_and_alerts_read_is_exported): its
cluster, a worker SIGKILLed mid-stream, scraped by a real Prometheus that loads the rules;
every one of those names must be among the series Prometheus collected, every expression must
evaluate, every rule be healthy.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest
import yaml

from deploy.observability.promql import (
    ALERTS,
    DASHBOARD,
    alert_queries,
    dashboard_queries,
    metric_names,
    needed_metrics,
)
from deploy.observability.render import legend

REPO = Path(__file__).resolve().parents[1]


def test_every_query_parses_and_reads_metrics() -> None:
    queries = dashboard_queries()
    alerts = alert_queries()
    assert len(queries) >= 30 and len(alerts) >= 10
    for query in queries + alerts:
        assert metric_names(query.expr), f"{query.where} reads no metric: {query.expr}"
    names = set(needed_metrics())
    # Each component is on the dashboard.
    for prefix in ("kvkeep_daemon_", "kvkeep_store_", "kvkeep_connector_", "kvkeep_router_",
                   "vllm:"):
        assert any(n.startswith(prefix) for n in names), prefix
    with pytest.raises(ValueError):
        metric_names("sum(rate(x[1m])")


def test_the_dashboard_is_a_grid_of_timeseries_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        assert panel["type"] in ("row", "timeseries"), panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {(pos["x"] + dx, pos["y"] + dy)
                for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] == "timeseries":
            assert panel["datasource"]["uid"] == "${datasource}"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool: apt-get install prometheus")
def test_promtool_accepts_the_alert_rules() -> None:
    done = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_queries())} rules found" in done.stdout


def test_the_kubernetes_rules_are_the_same_rules() -> None:
    rule = msgspec.yaml.decode((REPO / "deploy/k8s/alerts.yaml").read_bytes())
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"] == msgspec.yaml.decode(ALERTS.read_bytes())


def test_legends_fill_in_labels() -> None:
    assert legend("{{front}} {{ rpc }}", {"front": "tcp", "rpc": "Put"}) == "tcp Put"
    assert legend("", {"b": "2", "a": "1"}) == "a=1,b=2"


def test_service_monitors_reach_the_metrics_ports() -> None:
    docs = [d for path in sorted((REPO / "deploy/k8s").glob("*.yaml"))
            if path.name != "kustomization.yaml"
            for d in yaml.safe_load_all(path.read_text()) if d]
    workloads = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet")]
    services = [d for d in docs if d["kind"] == "Service"]
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceMonitor"}
    assert set(monitors) == {"kvkeep-daemon", "kvkeep-worker", "kvkeep-router"}
    jobs_in_queries = {"kvkeep-daemon"}  # the `up{job=...}` the alerts and panels use
    for name, monitor in monitors.items():
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics"
        assert endpoint["relabelings"] == [{"targetLabel": "job", "replacement": name}]
        jobs_in_queries.discard(name)
        wanted = monitor["spec"]["selector"]["matchLabels"].items()
        (service,) = [s for s in services if wanted <= s["metadata"]["labels"].items()
                      and any(p["name"] == endpoint["port"] for p in s["spec"]["ports"])]
        port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
        (workload,) = [w for w in workloads if service["spec"]["selector"].items()
                       <= w["spec"]["template"]["metadata"]["labels"].items()]
        container_ports = {p["name"]: p["containerPort"] for c in
                           workload["spec"]["template"]["spec"]["containers"]
                           for p in c.get("ports", [])}
        target = port.get("targetPort", port["port"])
        assert target in container_ports or target in container_ports.values(), name
        if name == "kvkeep-daemon":
            (daemon,) = workload["spec"]["template"]["spec"]["containers"]
            args = daemon["args"]
            listen = args[args.index("--metrics-listen") + 1]
            assert listen == f"0.0.0.0:{container_ports['metrics']}"
    assert not jobs_in_queries
