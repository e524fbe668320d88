"""`python -m benchmarks.cluster [--quick] [--json OUT.json]`: see the package docstring."""

from __future__ import annotations

import sys

from benchmarks.cluster.cli import main

if __name__ == "__main__":
    sys.exit(main())
