"""deploy/k8s: every manifest parses, carries the fields that matter, and every command line in
it is one our real parsers accept (the `kvkeep` CLI, the daemon's and router's configs, the
connector's `kv_connector_extra_config`, the daemon's token file). Plus the chaos CLI, and the
`--kubectl` killer against a stand-in kubectl script (no Kubernetes cluster exists here)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from connectors.vllm.config import ConnectorConfig
from deploy.local.ports import free_port
from kvstore.commands.kvkeep import build_parser
from kvstore.commands.store import settings_from_args
from kvstore.daemon.auth import TokenTable
from kvstore.daemon.config import DaemonConfig
from kvstore.etcd import etcd_spec
from router.commands import config_from_args

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
# What the downward API fills in at run time: realistic values to build configs with.
POD_ENV = {"$(POD_IP)": "10.8.3.17", "$(POD_NAME)": "kvkeep-worker-7d9f8-x2kq4",
           "$(NODE_NAME)": "gke-kvkeep-gpu-pool-3f2a9c1d-x7kq"}


def _docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                doc["__file__"] = path.name
                docs.append(doc)
    return docs


DOCS = _docs()


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _containers() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for doc in DOCS:
        spec = (doc.get("spec") or {}).get("template", {}).get("spec")
        if spec:
            for c in spec["containers"]:
                yield doc, c


def _expand(arg: str) -> str:
    for var, value in POD_ENV.items():
        arg = arg.replace(var, value)
    return arg


def _kvkeep_commands() -> list[tuple[str, list[str]]]:
    return [(f"{doc['metadata']['name']}/{c['name']}", [_expand(a) for a in c["args"]])
            for doc, c in _containers() if c.get("command") == ["kvkeep"]]


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_every_manifest_is_well_formed() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, "every manifest is in kustomization.yaml, and only those"
    assert kustomization["namespace"] == "kvkeep"
    for doc in DOCS:
        where = f"{doc['__file__']}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"].get("name"), where
        assert doc["metadata"].get("labels", {}).get("app.kubernetes.io/name") == "kvkeep", where


def test_workload_selectors_probes_and_volumes_line_up() -> None:
    workloads = [d for d in DOCS if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]
    assert {d["metadata"]["name"] for d in workloads} == {
        "kvkeep-etcd", "kvkeep-store", "kvkeep-worker", "kvkeep-router"}
    for doc in workloads:
        spec = doc["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), doc["metadata"]
        volumes = {v["name"] for v in spec["template"]["spec"].get("volumes", [])}
        volumes |= {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
        for c in spec["template"]["spec"]["containers"]:
            ports = {p["name"] for p in c.get("ports", [])} | {
                p["containerPort"] for p in c.get("ports", [])}
            for probe_kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = c.get(probe_kind)
                if probe and "exec" in probe:
                    assert probe["exec"]["command"][0] == "kvkeep", (c["name"], probe)
                elif probe:
                    action = probe.get("httpGet") or probe.get("grpc") or probe.get("tcpSocket")
                    assert action is not None and action["port"] in ports, (c["name"], probe)
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, (c["name"], mount)
            for ref in c.get("env", []):  # every $(VAR) used in args is defined
                assert ref.get("value") is not None or ref.get("valueFrom"), ref
            defined = {e["name"] for e in c.get("env", [])}
            for arg in c.get("args", []):
                for var in ("POD_IP", "POD_NAME", "NODE_NAME", "MODEL", "SERVED_MODEL_NAME"):
                    if f"$({var})" in arg:
                        assert var in defined, (c["name"], var)
    for svc in (d for d in DOCS if d["kind"] == "Service"):
        selector = svc["spec"]["selector"].items()
        assert any(selector <= d["spec"]["template"]["metadata"]["labels"].items()
                   for d in workloads), svc["metadata"]["name"]


def test_shapes_the_design_asks_for() -> None:
    etcd = _one("StatefulSet", "kvkeep-etcd")
    assert etcd["spec"]["replicas"] == 3
    assert etcd["spec"]["serviceName"] == "kvkeep-etcd-headless"
    initial = next(a for a in etcd["spec"]["template"]["spec"]["containers"][0]["args"]
                   if a.startswith("--initial-cluster="))
    members = dict(m.split("=", 1) for m in initial.removeprefix("--initial-cluster=").split(","))
    assert members == {f"kvkeep-etcd-{i}": f"https://kvkeep-etcd-{i}.kvkeep-etcd-headless."
                       "kvkeep.svc:2380" for i in range(3)}
    assert _one("Service", "kvkeep-etcd")["spec"]["ports"][0]["port"] == 2379

    store = _one("DaemonSet", "kvkeep-store")["spec"]["template"]["spec"]
    (daemon,) = store["containers"]
    probe = build_parser().parse_args(daemon["readinessProbe"]["exec"]["command"][1:])
    assert probe.store_command == "probe" and probe.address.endswith(":7070")
    volumes = {v["name"]: v for v in store["volumes"]}
    assert volumes["nvme"]["hostPath"]["path"]
    assert volumes["tokens"]["secret"]["secretName"] == "kvkeep-store-tokens"
    _one("Secret", "kvkeep-store-tokens")

    worker = _one("Deployment", "kvkeep-worker")["spec"]["template"]["spec"]
    names = [c["name"] for c in worker["containers"]]
    assert names == ["vllm", "kvkeep-agent"]
    vllm = worker["containers"][0]
    assert any(a == "--kv-transfer-config" for a in vllm["args"])
    assert {"name": "PYTHONHASHSEED", "value": "0"} in vllm["env"]

    router = _one("Deployment", "kvkeep-router")
    assert router["spec"]["replicas"] == 2
    assert _one("Service", "kvkeep-router")["spec"]["ports"][0]["port"] == 8000


def test_every_kvkeep_command_line_parses_and_configures(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"  # the router's key file, as its Secret mounts it
    keys.write_text(_one("Secret", "kvkeep-router-api-keys")["stringData"]["api-keys"])
    commands = [(n, [str(keys) if a == "/etc/kvkeep/router/api-keys" else a for a in args])
                for n, args in _kvkeep_commands()]
    assert {name for name, _ in commands} == {
        "kvkeep-store/kvstore", "kvkeep-worker/kvkeep-agent", "kvkeep-router/router",
        "kvkeep-etcd-roles/roles"}
    parser = build_parser()
    for name, args in commands:
        parsed = parser.parse_args(args)
        assert callable(parsed.handler), name
        assert _flag(args, "--etcd") == "https://kvkeep-etcd:2379", name
        if parsed.command == "router":
            config = config_from_args(parsed)
            assert config.etcd_url and config.port == 8000 and config.host == "0.0.0.0"
            assert config.api_keys is not None and len(config.api_keys) == 2
            # the workers' registered URL and KV-event endpoint are allowed
            assert config.workers_allow.url_refusal("http://10.8.3.17:8000") is None
            assert config.workers_allow.events_refusal("tcp://10.8.3.17:5557") is None
        elif parsed.command == "worker":
            assert parsed.url.startswith("http://10.8.3.17:") and parsed.kv_events
        elif parsed.command == "etcd":  # the roles Job (tests/test_etcd_roles.py runs it)
            assert parsed.etcd_command == "roles" and parsed.certificates_only
        else:
            assert parsed.command == "store" and parsed.store_command == "serve"


def test_daemon_config_builds_from_the_manifest(tmp_path: Path) -> None:
    ((_, args),) = [(n, a) for n, a in _kvkeep_commands() if n.startswith("kvkeep-store")]
    parsed = build_parser().parse_args(args)
    secret = _one("Secret", "kvkeep-store-tokens")["stringData"]["tokens"]
    token_file = tmp_path / "tokens"
    token_file.write_text(secret)
    assert len(TokenTable.load(token_file)) == 2  # the daemon's own token-file parser
    mount = next(m for m in _one("DaemonSet", "kvkeep-store")["spec"]["template"]["spec"][
        "containers"][0]["volumeMounts"] if m["name"] == "tokens")
    assert Path(parsed.token_file).parent == Path(mount["mountPath"])
    # What `kvkeep store serve` builds (kvstore/commands/store.py), every flag of the manifest
    # through the same settings (the token file here, not in the pod): a listener beyond
    # loopback is refused without a token file, so this also proves the manifest's is allowed.
    settings = msgspec.structs.replace(settings_from_args(parsed), token_file=str(token_file))
    config = settings.config()
    assert (config.mem_budget, config.disk_budget) == (16 << 30, 500 << 30)
    assert config.replicas == 2 and config.drain_timeout == 20
    assert config.advertised_address(7070) == "10.8.3.17:7070"
    assert config.advertised_data_address(7071) == "10.8.3.17:7071"
    with pytest.raises(Exception, match="token-file"):
        DaemonConfig(listen=parsed.listen, data_dir=parsed.data_dir, mem_budget=1, disk_budget=1,
                     node_id=parsed.node_id)


def test_kv_transfer_config_parses_with_the_connector_parser() -> None:
    found = 0
    for _doc, c in _containers():
        args = c.get("args", [])
        if "--kv-transfer-config" not in args:
            continue
        found += 1
        config = json.loads(_flag(args, "--kv-transfer-config"))
        assert config["kv_connector"] == "KVKeepConnector"
        assert config["kv_connector_module_path"] == "connectors.vllm"
        assert config["kv_role"] == "kv_both"
        assert config["kv_load_failure_policy"] == "recompute"
        parsed = ConnectorConfig.from_extra(config["kv_connector_extra_config"])
        assert parsed.store.remote is not None
        assert etcd_spec(parsed.store.remote.etcd).url == "https://kvkeep-etcd:2379"
        assert parsed.store.remote.replicas == 2
        events = json.loads(_flag(args, "--kv-events-config"))
        assert events["enable_kv_cache_events"] and events["endpoint"].endswith(":5557")
        router_args = next(a for n, a in _kvkeep_commands() if n.startswith("kvkeep-router"))
        assert _flag(args, "--block-size") == _flag(router_args, "--block-size")
    assert found == 1


def test_local_cluster_connector_config_parses() -> None:
    from deploy.local.engines import EngineSettings, kv_transfer_config

    config = kv_transfer_config(EngineSettings(model_dir=Path("/m")), "http://127.0.0.1:2379")
    parsed = ConnectorConfig.from_extra(config["kv_connector_extra_config"])
    assert parsed.store.host_bytes > 0 and parsed.store.remote is not None


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds() -> None:
    done = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    built = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert len(built) == len(DOCS)
    assert all(d["metadata"].get("namespace") == "kvkeep" for d in built
               if d["kind"] != "Namespace")


def test_chaos_and_demo_command_lines_parse() -> None:
    parser = build_parser()
    args = parser.parse_args(["chaos", "--kubectl", "--router-url", "http://127.0.0.1:8000",
                              "--kills", "3"])
    assert args.kubectl and args.kills == 3 and callable(args.handler)
    assert "component=worker" in args.selector
    assert parser.parse_args(["demo", "--json", "x.json"]).json == Path("x.json")
    # Locally, --kills is a scenario: bad flags are refused before any process starts.
    for bad in (["--kills", "-1"], ["--max-tokens", "4"], ["--kubectl"],
                ["--kubectl", "--scenario", "ci", "--router-url", "http://127.0.0.1:1"]):
        args = parser.parse_args(["chaos", *bad])
        assert args.handler(args) == 2, bad


_FAKE_KUBECTL = """#!/bin/sh
printf "%s\n" "$*" >> "$KUBECTL_LOG"
case "$*" in
  *"get pods"*) cat "$KUBECTL_PODS" ;;
  *"delete pod"*) echo "pod deleted" ;;
  *) exit 3 ;;
esac
"""


def _pod(name: str, ready: bool, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def test_kubectl_killer_against_a_stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """Only our side: the pods we pick and the commands we run. Not a Kubernetes test."""
    from deploy.chaos.killers import KubectlKiller

    kubectl = tmp_path / "kubectl"
    kubectl.write_text(_FAKE_KUBECTL)
    kubectl.chmod(kubectl.stat().st_mode | stat.S_IEXEC)
    pods = tmp_path / "pods.json"
    pods.write_text(json.dumps({"items": [_pod("w-a", True), _pod("w-b", True),
                                          _pod("w-c", False), _pod("w-d", True, True)]}))
    log = tmp_path / "calls"
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("KUBECTL_PODS", str(pods))
    monkeypatch.setenv("KUBECTL_LOG", str(log))
    killer = KubectlKiller("kvkeep", "app=w", "http://127.0.0.1:9")
    assert killer.targets() == ["w-a", "w-b"]
    killer.kill("w-a")
    calls = log.read_text().splitlines()
    assert calls[0] == "-n kvkeep get pods -l app=w -o json"
    assert calls[-1] == "-n kvkeep delete pod w-a --grace-period=0 --force --wait=false"


def test_vllm_binds_the_kv_events_endpoint_of_the_cluster_and_the_manifest() -> None:
    """vLLM's publisher binds only wildcard or ipc endpoints and *connects* to any other; the
    agents and routers connect too, so an endpoint vLLM would connect to carries no event.
    Both the local cluster's worker and the k8s worker must hand it one it binds (both once
    named their own IP, and no event reached a router)."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    from deploy.local.engines import EngineSettings, vllm_argv

    argv = vllm_argv(EngineSettings(model_dir=Path("/m")), port=1, events_port=5557,
                     etcd_url="http://127.0.0.1:2379")
    manifest = next(c["args"] for _doc, c in _containers()
                    if "--kv-events-config" in c.get("args", []))
    for args in (argv, manifest):
        endpoint = json.loads(_flag(args, "--kv-events-config"))["endpoint"]
        assert ZmqEventPublisher._is_bind_endpoint(endpoint), endpoint
    # Bound by vLLM's own code, the local cluster's endpoint is loopback alone (token ids go
    # over it), and a subscriber on 127.0.0.1 gets what it publishes.
    import zmq

    endpoint = json.loads(_flag(argv, "--kv-events-config"))["endpoint"].replace(
        ":5557", f":{free_port()}")
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        ZmqEventPublisher._bind(pub, endpoint)
        bound = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        assert bound.startswith("tcp://127.0.0.1:"), bound
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(bound)
        deadline = time.monotonic() + 10
        while not sub.poll(50):
            assert time.monotonic() < deadline, "no event reached the subscriber"
            pub.send(b"kv")
        assert sub.recv() == b"kv"
    finally:
        pub.close(0)
        sub.close(0)
        ctx.term()
    assert vllm_argv(EngineSettings(model_dir=Path("/m"), connector=False), port=1,
                     events_port=None).count("--kv-events-config") == 0
