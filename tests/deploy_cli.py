"""Shared by the demo and chaos tests: run `kvkeep ...` as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["REPO", "run_cli"]

REPO = Path(__file__).resolve().parents[1]


def run_cli(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`kvkeep ARGS` in a subprocess. On timeout it gets SIGTERM first, so that it stops the
    cluster it started (its children live in their own process groups), then SIGKILL."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", *args], cwd=REPO, env=env,
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
