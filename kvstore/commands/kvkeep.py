"""The `kvkeep` command line: one entry point, one subcommand group per component.

Each component registers its own subcommands through a `register(subparsers)` function so that
this file stays a dispatcher; components whose dependencies are not installed are left out.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

__all__ = ["main", "build_parser"]

# (module, what it adds). Imported lazily so that `kvkeep store ...` never imports vllm or the
# router's web stack.
_COMPONENTS: tuple[str, ...] = (
    "kvstore.commands.store",
    "router.commands",
    "deploy.commands",
    "deploy.serve_vllm",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvkeep", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in _COMPONENTS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a component whose optional dependencies are not installed
            continue
        register: Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None] = (
            module.register
        )
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["serve-vllm"]:  # every word after it is vLLM's, `--help` included
        from deploy.serve_vllm import run

        return run(words[1:])
    args = build_parser().parse_args(words)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
