"""The `bad_records` fault: what a hostile or careless etcd writer could put in etcd, for a while.

Written, through `etcdctl` (the way an operator, or anyone holding an etcd credential, would):

- under `workers/`, `sessions/` and `stores/`: a value nested 3,000 levels deep (Python's JSON
  parser raises RecursionError on it, which is not a ValueError) and a record whose fields have
  the wrong types;
- a worker record claiming a real worker's id in another key, without a lease, and another
  under a lease (the key does not name the id it claims);
- a daemon record without a lease, naming a capture socket.

The forged records point at capture servers on loopback that count what reaches them: a
worker's HTTP requests, a daemon's connections. None may arrive. While the records are there,
the other faults (a worker SIGKILLed, say) still have to be seen by every router, which is
what shows that no watcher stopped. At the end every key is deleted and the lease revoked.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from deploy.local.cluster import LocalCluster
from deploy.local.probes import http_json

__all__ = ["Forgery", "KEY_MARK"]

_DEEP = "[" * 3000 + "]" * 3000
# The keys this fault writes start with this, so that their deletion is never mistaken for a
# worker or daemon leaving.
KEY_MARK = "chaos-forged-"


class _CaptureHTTP:
    """Counts every HTTP request (any method, any path) and answers 200 with a bogus reply."""

    def __init__(self) -> None:
        owner = self
        self.requests = 0
        self.paths: list[str] = []
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                with owner._lock:
                    owner.requests += 1
                    owner.paths.append(f"{self.command} {self.path}")
                body = json.dumps({"captured": True}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = _any

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _CaptureSocket:
    """Counts connections (what a daemon client would open to a daemon it believed)."""

    def __init__(self) -> None:
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._listener.close()


class Forgery:
    """The records written and the capture servers behind them; `counts()` what reached them."""

    def __init__(self, cluster: LocalCluster, claimed_id: str) -> None:
        self._cluster = cluster
        self._claimed = claimed_id
        self.worker = _CaptureHTTP()
        self.daemon = _CaptureSocket()
        self.keys: list[str] = []
        self._lease: str | None = None

    def write(self) -> None:
        models = self._models_of(self._claimed)
        forged_worker = json.dumps({"id": self._claimed, "url": self.worker.url,
                                    "models": models})
        mistyped_worker = json.dumps({"id": f"{KEY_MARK}typed", "url": 5, "models": "x",
                                      "kv_events": {"x": 1}, "draining": "yes"})
        mistyped_binding = json.dumps({"worker": ["w1"], "epoch": "one", "owner": {}})
        mistyped_store = json.dumps({"node_id": 7, "address": ["127.0.0.1", 1]})
        forged_store = json.dumps({"node_id": "d1", "address": self.daemon.address})
        self._lease = self._grant_lease(60)
        for key, value, leased in (
                (f"/kvkeep/workers/{KEY_MARK}deep", _DEEP, False),
                (f"/kvkeep/workers/{KEY_MARK}typed", mistyped_worker, False),
                (f"/kvkeep/workers/{KEY_MARK}{self._claimed}", forged_worker, False),
                (f"/kvkeep/workers/{KEY_MARK}leased", forged_worker, True),
                (f"/kvkeep/sessions/{KEY_MARK}deep", _DEEP, False),
                (f"/kvkeep/sessions/{KEY_MARK}typed", mistyped_binding, False),
                (f"/kvkeep/stores/{KEY_MARK}deep", _DEEP, False),
                (f"/kvkeep/stores/{KEY_MARK}typed", mistyped_store, False),
                (f"/kvkeep/stores/{KEY_MARK}d1", forged_store, False)):
            self._etcdctl("put", *([f"--lease={self._lease}"] if leased else []), key, value)
            self.keys.append(key)

    def remove(self) -> None:
        for key in self.keys:
            with contextlib.suppress(RuntimeError):
                self._etcdctl("del", key)
        if self._lease is not None:
            with contextlib.suppress(RuntimeError):
                self._etcdctl("lease", "revoke", self._lease)

    def close(self) -> None:
        self.worker.close()
        self.daemon.close()

    def counts(self) -> dict[str, int]:
        return {"forged_worker_requests": self.worker.requests,
                "forged_daemon_connections": self.daemon.connections}

    def claimed_url_everywhere(self) -> bool:
        """Every live router still has the claimed worker at its real address."""
        for router in self._cluster.routers:
            if not router.process.alive:
                continue
            listed = http_json(f"{router.url}/kvkeep/workers", timeout=2.0)
            if not isinstance(listed, list):
                continue
            for w in listed:
                if isinstance(w, dict) and w.get("url") == self.worker.url:
                    return False
        return True

    def _models_of(self, worker_id: str) -> list[str]:
        listed = http_json(f"{self._cluster.router_url}/kvkeep/workers", timeout=2.0)
        for w in listed if isinstance(listed, list) else ():
            if isinstance(w, dict) and w.get("id") == worker_id:
                return [str(m) for m in w.get("models") or ()]
        return ["tiny"]

    def _grant_lease(self, ttl_s: int) -> str:
        out = self._etcdctl("lease", "grant", str(ttl_s))
        found = re.search(r"lease ([0-9a-f]+) granted", out)
        if found is None:
            raise RuntimeError(f"etcdctl lease grant said {out!r}")
        return found.group(1)

    def _etcdctl(self, *args: str) -> str:
        flags = ["--endpoints", self._cluster.etcd_url]
        pki = self._cluster.pki
        if pki is not None:
            p = pki.client
            flags += ["--cacert", str(p.ca), "--cert", str(p.cert), "--key", str(p.key)]
        done = subprocess.run([shutil.which("etcdctl") or "etcdctl", *flags, *args],
                              check=False, capture_output=True, text=True, timeout=10,
                              env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"})
        if done.returncode != 0:
            raise RuntimeError(f"etcdctl {args[0]}: {done.stderr.strip()[:200]}")
        return done.stdout
