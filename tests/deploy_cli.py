"""Shared by the demo, chaos and cluster tests: run `kvkeep ...` as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def spawn_cli(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`kvkeep ARGS` started in the background, its output to `log`; the caller stops it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "kvstore.commands", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
