"""`kvkeep serve-vllm`: vLLM's OpenAI server through kvkeep's CLI, exec'd (same pid, signals
and exit status pass through), with every argument handed to vLLM untouched.

The real server's pid is the one kvkeep started, running vLLM's module: after the exec there
is no kvkeep left to alter an exit status or an error, so vLLM's own (an unknown flag's exit 2,
say) need no run of their own, which cost a whole vLLM import (~22 s on two cores)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from deploy.local.engines import vllm_env
from deploy.local.services import free_port
from deploy.serve_vllm import VLLM_SERVER_MODULE, server_argv
from tests.models import TinyModel

KVKEEP = [sys.executable, "-m", "kvstore.commands"]


def test_the_command_line_is_the_server_module_with_every_argument() -> None:
    assert server_argv(["--model", "m", "--help"]) == [
        sys.executable, "-m", VLLM_SERVER_MODULE, "--model", "m", "--help"]
    assert server_argv(["--", "--port", "1"])[3:] == ["--port", "1"]


@pytest.mark.slow
def test_a_real_server_runs_in_the_same_process_and_stops_on_sigterm(
        tiny: TinyModel, tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "vllm.log").open("wb")
    proc = subprocess.Popen(
        [*KVKEEP, "serve-vllm", "--model", str(tiny.path), "--served-model-name", "tiny",
         "--dtype", "bfloat16", "--block-size", "32", "--max-model-len", "256",
         "--enforce-eager", "--kv-cache-memory-bytes", str(32 << 20), "--host", "127.0.0.1",
         "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
        env=vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vLLM did not become healthy"
            time.sleep(0.25)
        # The pid kvkeep started is now vLLM's server: exec'd, not a child.
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert VLLM_SERVER_MODULE.encode() in cmdline
        assert b"kvstore.commands" not in cmdline
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
