"""kvkeep's router: an OpenAI-compatible, session-, prefix- and load-aware proxy for vLLM
workers, with its shared state in etcd and failover that restores sessions and resumes streams.

Layout, one concept per module:
- `core`: the router core, everything that decides, callable without HTTP and etcd (a
  simulator's seam); `hooks`: its pre-request / post-response plugins (and the director's
  response-streaming ones); `tasks`: how its deferred work runs;
- `decision`, `context`, `scheduler`, `policy`, `policy_file`: deciding (pure, synchronous) and
  what decides, from presets or a config file, with the extension points `filters/`,
  `scorers/`, `pickers/`;
- `workers`, `registry`, `scraper`: who the workers are and how loaded; `node/`: the
  `kvkeep worker` sidecar beside each worker (`agent`, `gpu`, `metrics_relay`);
- `bindings`, `sessions`, `state/`, `failover`: session bindings, the etcd / in-process
  backends, rebinding a dead worker's sessions;
- `indexer/`: where prefixes are cached (routing history, vLLM KV events over ZMQ or fed
  directly);
- `director`: one generation request's life, admission to conversation record (the HTTP
  front's one entry point); `api`, `proxy`: the OpenAI-compatible HTTP front over it;
  `dispatch`, `upstream`: sending to workers (the one place/send/classify/release loop);
  `streaming/`: relaying a stream to a sink, and what resumes it elsewhere when it breaks
  (`resume`); `conversations/`: stateful conversations;
- `service`, `metrics`, `commands`: one replica assembled, its Prometheus metrics,
  `kvkeep router serve` and `kvkeep worker`.
"""

__all__: list[str] = []
