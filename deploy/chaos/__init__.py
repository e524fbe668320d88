"""`kvkeep chaos`: faults under load on a real cluster, and the figures that say whether anybody
noticed. `--scenario FILE` runs a scenario (deploy/chaos/*.yaml: the cluster, the load, a fault
schedule; `scenario_runner.py`); `--kills N` kills workers in rounds, locally (SIGKILL) or with
`--kubectl` against a deployment of deploy/k8s (pods deleted). See README.md here."""

from deploy.chaos.runner import ChaosOptions, run_kubectl_chaos, run_local_chaos

__all__ = ["ChaosOptions", "run_kubectl_chaos", "run_local_chaos"]
