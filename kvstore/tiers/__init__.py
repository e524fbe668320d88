"""The tiers a `TieredStore` stacks: the `Tier` protocol and capabilities (`base`,
`capabilities`), one typed spec per tier kind (`factory`), and a folder per medium: `memory/`
(host RAM, HBM), `nvme/` (local disk), `remote/` (kvkeep daemons); `redis` is one module."""
