"""The load generators: where their venvs are, and running one as a child we can always stop.

inference-perf 0.7 needs Python >= 3.12 and aiperf 0.13 pins its own dependency tree, so each
lives in its own venv beside the project's (`make bench-cluster` creates them:
`.venv-inference-perf`, `.venv-aiperf`). A tool runs in its own process group through
`deploy.local.processes.ManagedProcess`, so a timeout, an error or Ctrl-C ends it and every
process it forked, and nothing else.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deploy.local.cluster import REPO_ROOT
from deploy.local.processes import ManagedProcess
from kvstore.errors import ConfigError, DeadlineExceeded, KVKeepError

__all__ = ["LoadTools", "run_tool", "inference_perf_env", "aiperf_env"]

_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
_QUIET = {"HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
          "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True, slots=True)
class LoadTools:
    inference_perf: Path
    aiperf: Path

    @classmethod
    def find(cls, inference_perf: Path | None = None, aiperf: Path | None = None) -> LoadTools:
        """The given executables, else `KVKEEP_INFERENCE_PERF` / `KVKEEP_AIPERF`, else the
        venvs `make bench-cluster` makes in the repository."""
        ip = inference_perf or _env_path("KVKEEP_INFERENCE_PERF") or \
            REPO_ROOT / ".venv-inference-perf" / "bin" / "inference-perf"
        ap = aiperf or _env_path("KVKEEP_AIPERF") or REPO_ROOT / ".venv-aiperf" / "bin" / "aiperf"
        missing = [str(p) for p in (ip, ap) if not os.access(p, os.X_OK)]
        if missing:
            raise ConfigError(f"load generator not found: {', '.join(missing)}; "
                              "`make bench-cluster` creates their venvs (inference-perf 0.7 on "
                              "Python 3.12, aiperf 0.13)")
        return cls(ip, ap)


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def inference_perf_env() -> dict[str, str]:
    """Offline: the tokenizer is a local directory and nothing may be downloaded."""
    return {**os.environ, **_QUIET, **_OFFLINE}


def aiperf_env() -> dict[str, str]:
    """Without the HF offline switches: in offline mode aiperf 0.13 resolves a tokenizer
    through the hub cache even when given a local path, and fails. A local path needs no
    network either way (aiperf treats an absolute path as local and does not resolve it)."""
    env = {**os.environ, **_QUIET}
    for name in _OFFLINE:
        env.pop(name, None)
    return env


def run_tool(name: str, argv: Sequence[str], *, log_path: Path, env: dict[str, str],
             timeout_s: float, cwd: Path | None = None) -> float:
    """Run a load generator to completion; returns its wall time in seconds.

    Raises DeadlineExceeded past `timeout_s` and KVKeepError on a non-zero exit, both with the
    end of its log; the process group is stopped in every case, Ctrl-C included.
    """
    process = ManagedProcess(name, list(argv), log_path, env, cwd)
    started = time.monotonic()
    process.start()
    try:
        while process.alive:
            if time.monotonic() - started > timeout_s:
                raise DeadlineExceeded(f"{name}: still running after {timeout_s:.0f}s; log "
                                       f"{log_path}:\n{process.log_tail(2000)}")
            time.sleep(0.2)
    finally:
        process.stop(10)
    if process.returncode != 0:
        raise KVKeepError(f"{name} exited with {process.returncode}; log {log_path}:\n"
                          f"{process.log_tail(2000)}")
    return time.monotonic() - started
