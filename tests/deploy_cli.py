"""Shared by the demo, chaos and cluster tests: run `kvkeep ...` as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from deploy.local.processes import ManagedProcess

__all__ = ["REPO", "run_cli", "spawn_cli"]

REPO = Path(__file__).resolve().parents[1]


def run_cli(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`kvkeep ARGS` in a subprocess. On timeout it gets SIGTERM first, so that it stops the
    cluster it started (its children live in their own process groups), then SIGKILL."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.commands", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def spawn_cli(args: list[str], log: Path) -> ManagedProcess:
    """`kvkeep ARGS` started in the background (its own process group), its output to `log`;
    the caller stops it (`.stop()`: SIGTERM then SIGKILL, `.kill()`: a crash)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return ManagedProcess(log.stem, [sys.executable, "-m", "kvstore.commands", *args], log,
                          env, REPO).start()
