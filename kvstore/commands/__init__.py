"""The `kvkeep` command line, the whole product's: `kvkeep.py` is the entry point (the console
script, or `python -m kvstore.commands`), and each component registers its own subcommands
(`store.py` here; `router/commands.py`, `deploy/commands.py`, `deploy/serve_vllm.py`).

Nothing is imported here, so that `kvkeep store ...` never imports vLLM or the router's stack.
"""
