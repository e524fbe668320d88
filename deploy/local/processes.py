"""Child processes of a local cluster: started with a log file, stopped by pid.

Every process runs in its own session (process group), so one signal reaches a server and the
children it forked (vLLM's engine core, a daemon's re-exec) and nothing else: a local cluster
never signals processes it did not start. Stopping is SIGTERM to the group, a bounded wait,
then SIGKILL: a graceful drain when the process cooperates, a guaranteed end when it does not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deploy.local.ports import free_port

__all__ = ["ManagedProcess", "free_port", "freeze"]


def freeze(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP `pid` and return once the kernel reports it stopped. `kill` returns when the
    signal is queued; a process running on another core goes on until it takes it, and on a
    loaded machine that was long enough for a stopped etcd to answer one more request."""
    os.kill(pid, signal.SIGSTOP)
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            # The state follows the parenthesised command name, which may hold spaces.
            if stat.read_text().rpartition(")")[2].split()[0] in ("T", "t"):
                return
        except (OSError, IndexError):
            return  # gone, or not Linux: nothing more to wait for
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} not stopped {timeout:g}s after SIGSTOP")


@dataclass
class ManagedProcess:
    """One child: its command line, environment and log, and the running process if any."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def started(self) -> subprocess.Popen[bytes]:
        """The process of the last `start` (a handle's `proc`: tests signal its pid)."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.proc

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def start(self) -> ManagedProcess:
        """Spawn the process (appending to its log: a restart keeps the earlier run's lines)."""
        if self.alive:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                list(self.argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(self.env), cwd=self.cwd, start_new_session=True)
        return self

    def kill(self) -> None:
        """SIGKILL the whole group at once: a crash, no draining, no lease revocation."""
        self._signal(signal.SIGKILL)
        self._reap(10.0)

    def signal(self, sig: int) -> None:
        """Send `sig` to the group if it runs (SIGSTOP / SIGCONT: a hung process)."""
        self._signal(sig)

    def terminate(self) -> None:
        """SIGTERM the group without waiting (stop several, then `stop` each to reap)."""
        self._signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to `timeout`, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
        self._reap(10.0)
        # Children of the group that outlived their leader (an engine core whose parent
        # exited first) would keep ports and memory: the group gets a last SIGKILL.
        self._signal_group_anyway(signal.SIGKILL)
        return self.proc.returncode

    def log_tail(self, chars: int = 3000) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - chars))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._signal_group_anyway(sig)

    def _signal_group_anyway(self, sig: int) -> None:
        if self.proc is None:
            return
        # The group id is the child's pid (start_new_session): only our own processes.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def _reap(self, timeout: float) -> None:
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
