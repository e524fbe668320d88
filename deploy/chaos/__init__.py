"""`kvkeep chaos`: kill workers under a bounded load and check that no session is lost and
every greedy answer equals its reference. Locally against a `deploy.local` cluster (SIGKILL);
with `--kubectl` against a deployment of deploy/k8s (pods deleted). See README.md here."""

from deploy.chaos.runner import ChaosOptions, run_kubectl_chaos, run_local_chaos

__all__ = ["ChaosOptions", "run_kubectl_chaos", "run_local_chaos"]
