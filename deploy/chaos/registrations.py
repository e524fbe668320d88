"""Every registration that left etcd during a run, and whether a fault explains it.

Workers (`/kvkeep/workers/<id>`, under their agent's lease) and daemons
(`/kvkeep/stores/<id>`, under their own) are registered in etcd; routers and clients act on
those keys' DELETEs. A worker or daemon the scenario killed or cut off from etcd is expected to
leave; one that leaves while it was alive and untouched (say, when etcd comes back from a pause
and expires every lease that ran out meanwhile) is a finding: the routers then treat a healthy
worker as dead. `etcdctl watch --prefix /kvkeep/ -w json` records each event as it arrives
(restarted when etcd itself goes away), and the report lists every DELETE with how long the
key stayed gone.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass

__all__ = ["Departure", "RegistrationWatch"]

_PREFIXES = {"/kvkeep/workers/": "worker", "/kvkeep/stores/": "daemon"}


@dataclass(frozen=True, slots=True)
class Departure:
    kind: str
    """"worker" or "daemon"."""
    name: str
    left_at: float
    back_at: float | None


class RegistrationWatch:
    def __init__(self, etcd_url: str) -> None:
        self._etcd = etcd_url
        self._events: list[tuple[float, str, str, str]] = []  # (t, DELETE|PUT, kind, name)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._proc: subprocess.Popen[str] | None = None
        self._thread = threading.Thread(target=self._run, name="chaos-etcd-watch", daemon=True)

    @property
    def available(self) -> bool:
        return shutil.which("etcdctl") is not None

    def start(self) -> None:
        if self.available:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        self._thread.join(10)

    def departures(self) -> list[Departure]:
        with self._lock:
            events = sorted(self._events)
        out: list[Departure] = []
        gone: dict[tuple[str, str], float] = {}
        for t, op, kind, name in events:
            if op == "DELETE":
                gone.setdefault((kind, name), t)
            elif (kind, name) in gone:
                out.append(Departure(kind, name, gone.pop((kind, name)), t))
        out.extend(Departure(k, n, t, None) for (k, n), t in gone.items())
        return sorted(out, key=lambda d: d.left_at)

    def _run(self) -> None:
        etcdctl = shutil.which("etcdctl") or "etcdctl"
        while not self._stop.is_set():
            self._proc = subprocess.Popen(
                [etcdctl, "--endpoints", self._etcd, "watch", "--prefix", "/kvkeep/",
                 "-w", "json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"})
            assert self._proc.stdout is not None
            for line in self._proc.stdout:
                self._record(time.monotonic(), line)
            self._proc.wait()
            self._stop.wait(0.5)  # etcd is down (killed, restarting): watch again soon

    def _record(self, t: float, line: str) -> None:
        try:
            events = json.loads(line).get("Events") or []
        except (ValueError, AttributeError):
            return
        for event in events:
            try:
                key = base64.b64decode(event["kv"]["key"]).decode()
            except (KeyError, TypeError, ValueError):
                continue
            for prefix, kind in _PREFIXES.items():
                if key.startswith(prefix):
                    op = "DELETE" if event.get("type") == 1 else "PUT"
                    with self._lock:
                        self._events.append((t, op, kind, key[len(prefix):]))
