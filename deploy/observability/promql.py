"""The PromQL of the dashboard and the alert rules, and the metric names it reads.

Parsed with `promql-parser` (the Rust parser GreptimeDB uses), so a query that Prometheus would
reject fails here, and the names come from the syntax tree rather than a regex.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import promql_parser

__all__ = ["Query", "DASHBOARD", "ALERTS", "dashboard_queries", "alert_queries", "metric_names",
           "needed_metrics"]

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "dashboard.json"
ALERTS = HERE / "alerts.yaml"


@dataclass(frozen=True, slots=True)
class Query:
    where: str
    """The panel title and target, or the alert's name."""
    expr: str


RATE_INTERVAL = "$__rate_interval"
"""Grafana's rate window variable (4 scrape intervals at least), which the panels use."""


def dashboard_queries(path: Path = DASHBOARD, *, rate_interval: str = "1m") -> list[Query]:
    """Every target of every panel (rows' nested panels too), with Grafana's
    `$__rate_interval` replaced by `rate_interval` as Grafana would before querying."""
    dashboard = json.loads(path.read_text())
    queries: list[Query] = []

    def visit(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets", ()):
                expr = target["expr"].replace(RATE_INTERVAL, rate_interval)
                queries.append(Query(f"{panel['title']} [{target['refId']}]", expr))
            visit(panel.get("panels", []))
    visit(dashboard["panels"])
    return queries


def alert_queries(path: Path = ALERTS) -> list[Query]:
    groups = msgspec.yaml.decode(path.read_bytes())["groups"]
    return [Query(rule.get("alert") or rule["record"], rule["expr"])
            for group in groups for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (ValueError if it does not parse)."""
    names: set[str] = set()

    def visit(node: promql_parser.Expr) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for matcher in node.matchers.matchers:
                if matcher.name == "__name__":
                    names.add(matcher.value)
        return True
    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return names


def needed_metrics() -> dict[str, list[str]]:
    """Every metric name the dashboard and the alert rules read -> the panels and alerts that
    read it (what a scrape of the running components must hold)."""
    needed: dict[str, list[str]] = {}
    for query in dashboard_queries() + alert_queries():
        for name in metric_names(query.expr):
            needed.setdefault(name, []).append(query.where)
    return needed
