"""The simulator's store costs, derived from what `benchmarks.remote` and `benchmarks.restore`
measured, so the `[store]` figures of a parameter file can be re-derived from fresh runs:

    python -m benchmarks.sim.store_params --remote m.json [--restore r.json]

prints the cost lines of a `[store]` section (capacities and `load_mode` are not measured and
stay as the file has them). The measurements are CPU ones on this project's machines; the
simulated cluster is H100 GPUs at TP=2, so every figure is carried there by a stated rule:

- host tier (per replica = its TP group, each GPU loading its half over its own link):
  a restore decoded on the host then copied up runs at `H200_RESTORE_OVER_PAGEABLE` of a
  pageable host-to-device copy (measured on an H200 for int8 restores, the only GPU restore
  figure: connectors/vllm/loader.py `_scatter_chunk`), times `PAGEABLE_H2D_GBPS` (assumed: not
  measured here), times the GPUs of the group. Raw frames (the connector's default codec)
  skip the dequantize, so this is a lower bound on their rate. Per load call:
  `HOST_LATENCY_S`, the connector's own prior for a host tier (connectors/vllm/README.md).
- remote daemons: the daemon's get rate as a fraction of the same run's loopback TCP
  (`benchmarks.remote`: `remote.get_gbps` at the largest block over `tcp_loopback_gbps`)
  applied to the replica's network share (`NETWORK_GBPS_PER_REPLICA`, assumed), then the host
  chain above, in series (a load reads a window of blocks, then decodes them: default
  `restore_first_layers` 0). Per load call: a lookup round trip and a get round trip, each the
  measured one-key lookup (`remote.lookup_1_p50_us`, TCP data plane, loopback).
- saves: the step pays the per-layer gather of each new block into a compact copy on the GPU
  (connectors/vllm/saver.py `save_layer`; the encoding and the puts run on the saver's thread
  and the step never waits for them without durability): read + write of the GPU's half of
  a block at `HBM_COPY_GBPS` (assumed). `benchmarks.restore`'s `save_overhead_pct` (decode
  throughput lost to saving on a 2-core CPU engine, where the saver's encoding takes the
  engine's own cores) is printed beside it, not used: on a GPU node that work is off the step.

`--restore` adds a check: the remote tier's extra restore time over the host tier's per byte,
as the CPU engine measured it through the connector, against the tier's own get rate.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.sim.params import DEFAULT_PARAMS, load_params

__all__ = ["StoreCosts", "derive", "render", "main"]

# --- carried from elsewhere or assumed (each says which) ---------------------------------------
H200_RESTORE_OVER_PAGEABLE = (0.19, 0.24)  # measured on an H200 (int8, host decode + copy up)
PAGEABLE_H2D_GBPS = 20.0  # assumed: a pageable copy up on a PCIe 5 host; not measured here
TP = 2  # the simulated replica's GPUs (Qwen3-32B at TP=2)
HOST_LATENCY_S = 20e-6  # assumed: the connector's prior for a host tier (restore_cost.py)
NETWORK_GBPS_PER_REPLICA = 12.5  # assumed: a 100 Gb/s share of the node's network per replica
HBM_COPY_GBPS = 2800.0  # assumed: H100 SXM HBM3 3.35 TB/s at ~85 % for a device copy


@dataclass(frozen=True, slots=True)
class StoreCosts:
    host_latency_s: float
    host_gbps: float
    remote_latency_s: float
    remote_gbps: float
    save_s_per_block: float
    notes: tuple[str, ...]


def derive(remote: Mapping[str, Any], restore: Mapping[str, Any] | None, *,
           block_bytes: int) -> StoreCosts:
    """The [store] costs from a `benchmarks.remote` report (and optionally a
    `benchmarks.restore` one, for the check); `block_bytes`: one simulated block, all of the
    replica's GPUs."""
    low, high = H200_RESTORE_OVER_PAGEABLE
    host_gbps = (low + high) / 2 * PAGEABLE_H2D_GBPS * TP
    gets = remote["remote"]["get_gbps"]
    largest = max(gets, key=_mib)
    loopback = float(remote["baseline"]["tcp_loopback_gbps"])
    daemon_share = float(gets[largest]) / loopback
    transport_gbps = daemon_share * NETWORK_GBPS_PER_REPLICA
    remote_gbps = 1.0 / (1.0 / transport_gbps + 1.0 / host_gbps)
    round_trip_s = float(remote["remote"]["lookup_1_p50_us"]["tcp"]) * 1e-6
    remote_latency_s = 2 * round_trip_s
    save_s = 2 * block_bytes / TP / (HBM_COPY_GBPS * 1e9)
    notes = [
        f"host: {(low + high) / 2:.3f} (H200, int8 restore / pageable copy, {low}-{high}) x "
        f"{PAGEABLE_H2D_GBPS:g} GB/s pageable (assumed) x {TP} GPUs = {host_gbps:.2f} GB/s",
        f"remote: daemon get {float(gets[largest]):.2f} GB/s at {largest} / loopback TCP "
        f"{loopback:.2f} GB/s = {daemon_share:.2f} of the link, x {NETWORK_GBPS_PER_REPLICA:g}"
        f" GB/s (assumed) = {transport_gbps:.2f} GB/s, in series with the host chain = "
        f"{remote_gbps:.2f} GB/s; latency 2 x {round_trip_s * 1e6:.0f} us (one-key lookup "
        "round trip, loopback)",
        f"save: 2 x {block_bytes / TP / 2**20:.0f} MiB per GPU / {HBM_COPY_GBPS:g} GB/s "
        f"(assumed) = {save_s * 1e6:.1f} us per block",
    ]
    if restore is not None:
        notes.extend(_restore_check(restore, float(gets[largest])))
    return StoreCosts(HOST_LATENCY_S, round(host_gbps, 2), round(remote_latency_s, 6),
                      round(remote_gbps, 2), round(save_s, 7), tuple(notes))


def _mib(size: str) -> float:
    return float(size.removesuffix("MiB"))


def _restore_check(restore: Mapping[str, Any], get_gbps: float) -> list[str]:
    """The CPU engine's remote-over-host restore increment: a line through the contexts'
    (remote - host) TTFTs against restored bytes (vLLM's compute and the host chain cancel)."""
    model = restore["model"]
    token_bytes = 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * 2
    bs = model["block_size"]
    xs = [(ctx - 1) // bs * bs * token_bytes for ctx in restore["context_tokens"]]
    ttft = restore["restore_ttft_s"]
    ys = [r - h for r, h in zip(ttft["remote"], ttft["host"], strict=True)]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / \
        sum((x - mx) ** 2 for x in xs)
    lines = [f"check (benchmarks.restore, CPU engine): remote adds {my - slope * mx:.4f} s per "
             f"restore + 1 / {1 / slope / 1e9:.2f} GB/s per byte over host, against the "
             f"tier's own get at {get_gbps:.2f} GB/s: the engine's 2 cores are shared with "
             "the daemon and the client there"]
    if "save_overhead_pct" in restore:
        lines.append(f"saves cost the CPU engine {restore['save_overhead_pct']} % of decode "
                     "throughput (encoding on the engine's own cores; not used)")
    return lines


def render(costs: StoreCosts) -> str:
    lines = [f"# {note}" for note in costs.notes]
    lines += [f"host_latency_s = {costs.host_latency_s}", f"host_gbps = {costs.host_gbps}",
              f"remote_latency_s = {costs.remote_latency_s}",
              f"remote_gbps = {costs.remote_gbps}",
              f"save_s_per_block = {costs.save_s_per_block}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--remote", type=Path, required=True, help="benchmarks.remote JSON")
    parser.add_argument("--restore", type=Path, help="benchmarks.restore JSON (a check)")
    parser.add_argument("--params", type=Path, default=DEFAULT_PARAMS,
                        help="the parameter file whose block size and model to use")
    args = parser.parse_args(argv)
    params = load_params(args.params)
    block_bytes = params.model.kv_bytes_per_token * params.engine.block_size
    restore = json.loads(args.restore.read_text()) if args.restore else None
    print(render(derive(json.loads(args.remote.read_text()), restore,
                        block_bytes=block_bytes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
