"""`python -m kvstore.daemon --listen ... --data-dir ...`: the same as `kvkeep store serve`."""

from __future__ import annotations

import sys

from kvstore.commands.store import serve_main

if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
