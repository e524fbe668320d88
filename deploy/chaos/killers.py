"""Who kills workers in a chaos run, and how a killed worker comes back.

A killer names its targets, kills one, and waits for it (or its replacement) to serve again
(a local cluster's workers are killed by the scenario runner's `kill_worker` fault instead):

- `KubectlKiller`: a deployment of deploy/k8s. `kubectl delete pod --grace-period=0 --force`
  on a worker pod (vLLM and its `kvkeep worker` sidecar die together), then a wait until the
  Deployment has as many Ready worker pods as before and the router sees them. This mode needs
  a reachable cluster and cannot run on the machines this project is built on.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any, Protocol

from deploy.local.probes import http_json, wait_until
from kvstore.errors import ConfigError, DeadlineExceeded, KVKeepError

__all__ = ["Killer", "KubectlKiller", "usable_workers"]


class Killer(Protocol):
    def targets(self) -> list[str]:
        """Workers that may be killed now (alive and serving)."""
        ...

    def kill(self, target: str) -> None: ...

    def recover(self, target: str) -> None:
        """Return once `target`, or what replaces it, serves again."""
        ...


def usable_workers(router_url: str) -> set[str]:
    listed = http_json(f"{router_url}/kvkeep/workers")
    if not isinstance(listed, list):
        return set()
    return {str(w["id"]) for w in listed if isinstance(w, dict) and w.get("usable")}


class KubectlKiller:
    """Worker pods selected by label in one namespace; `kubectl` from PATH, current context."""

    def __init__(self, namespace: str, selector: str, router_url: str,
                 ready_timeout_s: float = 900.0) -> None:
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            raise ConfigError("kvkeep chaos --kubectl: kubectl is not on PATH")
        self._kubectl = kubectl
        self._namespace = namespace
        self._selector = selector
        self._router_url = router_url
        self._ready_timeout_s = ready_timeout_s
        self._expected = len(self.targets())
        if self._expected < 2:
            raise ConfigError(f"kvkeep chaos --kubectl: {self._expected} ready worker pods "
                              f"match {selector!r} in {namespace!r}; at least 2 are needed")

    def targets(self) -> list[str]:
        pods = self._get_pods()
        return sorted(p["metadata"]["name"] for p in pods if _ready(p)
                      and p["metadata"].get("deletionTimestamp") is None)

    def kill(self, target: str) -> None:
        self._run(["delete", "pod", target, "--grace-period=0", "--force", "--wait=false"])

    def recover(self, target: str) -> None:
        # The Deployment creates a new pod under another name: wait for the count, then for
        # the router (the new pod's sidecar registers it once vLLM answers).
        wait_until(lambda: len(self.targets()) >= self._expected,
                   timeout=self._ready_timeout_s, what="replacement worker pod Ready", step=2.0)
        wait_until(lambda: len(usable_workers(self._router_url)) >= self._expected,
                   timeout=120.0, what="router to see every worker", step=1.0)

    def _get_pods(self) -> list[dict[str, Any]]:
        out = self._run(["get", "pods", "-l", self._selector, "-o", "json"])
        try:
            items = json.loads(out)["items"]
        except (ValueError, KeyError) as exc:
            raise KVKeepError(f"kubectl get pods: unexpected output: {out[:200]!r}") from exc
        return [p for p in items if isinstance(p, dict)]

    def _run(self, args: list[str]) -> str:
        argv = [self._kubectl, "-n", self._namespace, *args]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        except subprocess.TimeoutExpired as exc:
            raise DeadlineExceeded(f"{' '.join(argv)}: no answer in 60s") from exc
        if done.returncode != 0:
            raise KVKeepError(f"{' '.join(argv)}: exit {done.returncode}: "
                              f"{done.stderr.strip()[:300]}")
        return done.stdout


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or ())

