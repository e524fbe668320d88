"""The in-memory tiers: `tier.py` (MemoryTier, slab-backed blocks), `host.py` (host RAM),
`hbm.py` (device memory) and `slabs.py` (the page arenas both draw from)."""
