"""The worker-node sidecar (`kvkeep worker`), a process of its own beside each vLLM worker:
`agent.py` (registration and health in etcd), `gpu.py` (NVML readings) and `metrics_relay.py`
(vLLM's /metrics relayed to Prometheus)."""
