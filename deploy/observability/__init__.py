"""Operating kvkeep: a Grafana dashboard and Prometheus alert rules (dashboard.json,
alerts.yaml), the PromQL in them (`promql`), a real Prometheus for a local run (`prometheus`),
and a picture of the dashboard drawn from such a run (`render`, `snapshot`)."""
