"""kvkeep as an LMCache 0.5 storage backend (an L2 adapter plugin).

    {"type": "plugin", "module_path": "connectors.lmcache.adapter",
     "class_name": "KVKeepL2Adapter", "adapter_params": {...}}

- `connectors.lmcache.adapter`: the LMCache-facing adapter (imports LMCache).
- `connectors.lmcache.store`: the kvkeep side (key mapping, framing, batching, error to miss),
  which does not import LMCache and is tested in kvkeep's own suite against real daemons.
- `connectors.lmcache.install`: prepares an LMCache environment for the plugin (kvkeep's gRPC
  stubs generated for that environment's protobuf). See connectors/lmcache/README.md.
"""
