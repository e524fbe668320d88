"""`kvkeep chaos`: faults under load on a real cluster, and the figures that say whether anybody
noticed. `--scenario FILE` runs a scenario (deploy/chaos/*.yaml: the cluster, the load, a fault
schedule; `scenario_runner.py`), and so does `--kills N` on a local cluster (a scenario built
from the flags: `scenario.kills_scenario`); `--kubectl` runs rounds of turns against a
deployment of deploy/k8s, deleting worker pods (`runner.py`). See README.md here."""

from deploy.chaos.runner import ChaosOptions, run_kubectl_chaos

__all__ = ["ChaosOptions", "run_kubectl_chaos"]
