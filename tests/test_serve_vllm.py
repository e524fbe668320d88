"""`kvkeep serve-vllm`: vLLM's OpenAI server through kvkeep's CLI, exec'd (same pid, signals
and exit status pass through), with every argument handed to vLLM untouched.

Every vLLM server the tests start runs through it (deploy.local.engines.vllm_argv): the local
clusters' workers and `start_vllm`'s. The real servers are checked where they run:
tests/test_router_vllm.py (each worker's pid is vLLM's server module, nothing of kvkeep left)
and tests/test_connector_metrics.py (SIGTERM stops it, vLLM's exit status). After the exec
there is no kvkeep left to alter an exit status or an error, so vLLM's own (an unknown flag's
exit 2, say) need no run of their own, which cost a whole vLLM import (~22 s on two cores);
nor does a server of this module's own (~20 s alone, 54-74 s in the suite)."""

from __future__ import annotations

import sys
from pathlib import Path

from deploy.local.engines import EngineSettings, vllm_argv
from deploy.serve_vllm import VLLM_SERVER_MODULE, server_argv

KVKEEP = [sys.executable, "-m", "kvstore.commands"]


def test_local_servers_start_through_the_command() -> None:
    argv = vllm_argv(EngineSettings(Path("/m"), connector=False), port=1, events_port=None)
    assert argv[:4] == [*KVKEEP, "serve-vllm"]
    assert argv[argv.index("--model") + 1] == "/m"


def test_the_command_line_is_the_server_module_with_every_argument() -> None:
    assert server_argv(["--model", "m", "--help"]) == [
        sys.executable, "-m", VLLM_SERVER_MODULE, "--model", "m", "--help"]
    assert server_argv(["--", "--port", "1"])[3:] == ["--port", "1"]
