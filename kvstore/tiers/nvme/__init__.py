"""The local-disk tier: `tier.py` (NvmeTier) over `block_index.py`, its on-disk layout
(`layout.py`, `recovery.py`, `reads.py`), crash-safe files (`durable_files.py`,
`manifest_files.py`) and the free-space guard (`disk_space.py`)."""
