"""kvkeep's router: an OpenAI-compatible, session-, prefix- and load-aware proxy for vLLM
workers, with its shared state in etcd and failover that restores sessions and resumes streams.

Layout, one concept per module:
- `decision`, `context`, `scheduler`, `policy`: deciding (pure, synchronous), with the
  extension points `filters/`, `scorers/`, `pickers/`;
- `workers`, `registry`, `scraper`, `agent`, `gpu`: who the workers are and how loaded;
- `bindings`, `sessions`, `state/`: session bindings and the etcd / in-process backends;
- `indexer/`: where prefixes are cached (routing history, vLLM KV events over ZMQ);
- `api`, `proxy`, `streaming`, `failover`, `service`, `metrics`: sending, and recovering;
- `commands`: `kvkeep router serve` and `kvkeep worker`.
"""

__all__: list[str] = []
