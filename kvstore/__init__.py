"""kvstore: a tiered, checksummed, model-fingerprinted store of LLM KV-cache blocks."""
