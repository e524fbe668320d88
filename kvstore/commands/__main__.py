"""`python -m kvstore.commands ARGS` is `kvkeep ARGS` without the console script on PATH."""

import sys

from kvstore.commands.kvkeep import main

sys.exit(main())
