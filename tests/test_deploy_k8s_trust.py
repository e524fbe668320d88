"""deploy/k8s carries the trust settings (issue 13 items 1, 2 and 5):

- NetworkPolicies, evaluated with Kubernetes' semantics over the manifests' own pods: only
  router pods reach the workers' vLLM port and KV-event stream, etcd only from kvkeep pods
  (its peer port only from members), the daemons only from connectors and peers.
- etcd runs with TLS and client-certificate auth for clients and peers; every `kvkeep`
  command line and the connector config carry the etcd TLS flags, the daemons mTLS and
  registration signing, the connector the daemons' CA, name and public key, all pointing at
  files that are mounted from Secrets `python -m deploy.k8s_secrets` generates.
- Those settings work: a real etcd started with the manifest's TLS flags and the generated
  certificates, a real daemon started with the manifest's flags, the connector's store from
  the manifest's `--kv-transfer-config`, the router's and the agent's etcd clients from their
  command lines, and the manifest's exec probe, with the mounted paths moved into a temp dir
  and the cluster's host names to loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.stores import tier_specs
from deploy.k8s_secrets import CA_SECRET, STORE_SERVER_NAME, build_secrets, identities, main
from deploy.local.daemons import REPO_ROOT, DaemonProcess
from deploy.local.services import free_port, stop_process, wait_for_port
from kvstore.commands.kvkeep import build_parser
from kvstore.etcd import EtcdSpec, etcd_client
from kvstore.etcd.flags import etcd_spec_from_args
from kvstore.keys import Namespace
from kvstore.tiers.factory import build_tiers
from kvstore.tiers.remote.tier import RemoteTier
from router.commands import config_from_args
from router.membership.workers import WorkerId, WorkerInfo
from router.state.etcd import EtcdBackend
from tests.blockframes import block_key, make_frame
from tests.router_harness import wait_until
from tests.test_deploy_manifests import DOCS, POD_ENV, _expand, _one

# -- NetworkPolicy semantics -------------------------------------------------------------------

GATEWAY = Path(__file__).resolve().parents[1] / "deploy" / "gateway"
POLICIES = [d for d in DOCS if d["kind"] == "NetworkPolicy"]
GATEWAY_POLICIES = [d for p in sorted(GATEWAY.glob("*.yaml")) if p.name != "envoy.yaml"
                    for d in yaml.safe_load_all(p.read_text())
                    if d and d["kind"] == "NetworkPolicy"]
Pod = tuple[dict[str, str], dict[str, int]]  # labels, named container ports


@dataclass(frozen=True)
class Source:
    """Where a connection comes from: a pod (its labels) in a namespace (None: kvkeep's own,
    else that namespace's labels), or no pod at all (beyond the cluster)."""

    pod: dict[str, str] | None
    namespace: dict[str, str] | None = None


OUTSIDE = Source(None)


def _pod(kind: str, name: str, docs: list[dict[str, Any]] = DOCS) -> Pod:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    template = doc["spec"]["template"]
    ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"]
             for p in c.get("ports", [])}
    return dict(template["metadata"]["labels"]), ports


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        if op == "In" and value not in expr["values"]:
            return False
        if op == "NotIn" and value in expr["values"]:
            return False
        if op == "Exists" and value is None:
            return False
        if op == "DoesNotExist" and value is not None:
            return False
    return True


def _peer_matches(peer: dict[str, Any], source: Source) -> bool:
    if "ipBlock" in peer:
        return source.pod is None  # (an address range: only used for traffic from outside)
    if source.pod is None:
        return False
    if "namespaceSelector" in peer:
        namespace = source.namespace or {}  # kvkeep's namespace carries no labels here
        if not _selects(peer["namespaceSelector"], namespace):
            return False
    elif source.namespace is not None:
        return False  # a podSelector alone means pods of the policy's own namespace
    return _selects(peer.get("podSelector", {}), source.pod)


def allowed(source: Source, dest: Pod, port: str,
            policies: list[dict[str, Any]] = POLICIES) -> bool:
    """Kubernetes' rule: a pod selected by no Ingress policy takes anything; else a
    connection needs one rule of one selecting policy admitting both its source and port."""
    labels, ports = dest
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], labels)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            rule_ports = rule.get("ports")
            if rule_ports and not any(p["port"] in (port, ports.get(port)) for p in rule_ports):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_matches(peer, source) for peer in peers):
                return True
    return False


def test_network_policies_admit_only_what_the_design_needs() -> None:
    """Before: no NetworkPolicy, so every pod and anything routed into the cluster reached
    vLLM around the router, read the KV-event stream, and talked to etcd and the daemons."""
    router, worker = _pod("Deployment", "kvkeep-router"), _pod("Deployment", "kvkeep-worker")
    store, etcd = _pod("DaemonSet", "kvkeep-store"), _pod("StatefulSet", "kvkeep-etcd")
    sources = {"outside": OUTSIDE, "stray": Source({"app": "debug-shell"}),
               "other-ns": Source({"app": "x"}, {"team": "b"}),
               "router": Source(router[0]), "worker": Source(worker[0]),
               "store": Source(store[0]), "etcd": Source(etcd[0])}
    expected = {
        # the way in
        ("outside", "router", "http"): True,
        # vLLM and its event stream: the routers only
        ("router", "worker", "http"): True, ("router", "worker", "kv-events"): True,
        ("outside", "worker", "http"): False, ("outside", "worker", "kv-events"): False,
        ("stray", "worker", "http"): False, ("stray", "worker", "kv-events"): False,
        ("other-ns", "worker", "http"): False, ("other-ns", "worker", "kv-events"): False,
        ("worker", "worker", "http"): False, ("store", "worker", "kv-events"): False,
        # etcd: kvkeep's own pods; peers on the peer port; the plaintext metrics nobody
        ("router", "etcd", "client"): True, ("worker", "etcd", "client"): True,
        ("store", "etcd", "client"): True, ("etcd", "etcd", "peer"): True,
        ("outside", "etcd", "client"): False, ("stray", "etcd", "client"): False,
        ("other-ns", "etcd", "client"): False,
        ("worker", "etcd", "peer"): False, ("router", "etcd", "metrics"): False,
        # daemons: connectors and peers
        ("worker", "store", "grpc"): True, ("store", "store", "grpc"): True,
        ("router", "store", "grpc"): False, ("outside", "store", "grpc"): False,
        ("stray", "store", "grpc"): False,
    }
    dests = {"router": router, "worker": worker, "store": store, "etcd": etcd}
    for dest_name, dest in dests.items():
        for port in {p for (_, d, p) in expected if d == dest_name}:
            assert port in dest[1], (dest_name, port)  # every named port exists
    actual = {case: allowed(sources[case[0]], dests[case[1]], case[2]) for case in expected}
    assert actual == expected


def test_the_gateway_path_through_the_policies() -> None:
    """deploy/gateway on top: its data plane (a labelled namespace) reaches the workers' vLLM
    port and the picker's ext_proc port; the picker (a router) reaches etcd and the workers'
    events; nobody else gains anything."""
    policies = POLICIES + GATEWAY_POLICIES
    gateway_docs = [d for p in sorted(GATEWAY.glob("*.yaml")) if p.name != "envoy.yaml"
                    for d in yaml.safe_load_all(p.read_text()) if d]
    epp = _pod("Deployment", "kvkeep-epp", gateway_docs)
    worker, etcd = _pod("Deployment", "kvkeep-worker"), _pod("StatefulSet", "kvkeep-etcd")
    sources = {"gateway": Source({"app": "envoy"}, {"kvkeep.io/inference-gateway": "true"}),
               "other-ns": Source({"app": "envoy"}, {"team": "b"}), "epp": Source(epp[0]),
               "outside": OUTSIDE}
    expected = {
        ("gateway", "worker", "http"): True, ("gateway", "epp", "grpc-ext-proc"): True,
        ("gateway", "worker", "kv-events"): False, ("gateway", "etcd", "client"): False,
        ("epp", "etcd", "client"): True, ("epp", "worker", "kv-events"): True,
        ("other-ns", "worker", "http"): False, ("other-ns", "epp", "grpc-ext-proc"): False,
        ("outside", "epp", "grpc-ext-proc"): False, ("outside", "epp", "http"): True,
    }
    dests = {"worker": worker, "etcd": etcd, "epp": epp}
    actual = {case: allowed(sources[case[0]], dests[case[1]], case[2], policies)
              for case in expected}
    assert actual == expected


PROMETHEUS = Source({"app.kubernetes.io/name": "prometheus"}, {"kvkeep.io/monitoring": "true"})
"""A Prometheus Operator's pod in the labelled monitoring namespace (monitoring.yaml)."""


def _monitors() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in DOCS if d["kind"] == "ServiceMonitor"}


def _monitored_port(monitor: dict[str, Any]) -> str:
    """The named container port a ServiceMonitor's endpoint reaches, through its Service."""
    (endpoint,) = monitor["spec"]["endpoints"]
    wanted = monitor["spec"]["selector"]["matchLabels"].items()
    (service,) = [s for s in DOCS if s["kind"] == "Service"
                  and wanted <= s["metadata"]["labels"].items()
                  and any(p["name"] == endpoint["port"] for p in s["spec"]["ports"])]
    port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
    target = port.get("targetPort", port["name"])
    assert isinstance(target, str), "a named targetPort, as the policies name ports"
    return target


def test_prometheus_reaches_the_metrics_ports_and_nothing_else() -> None:
    """Before: the workers were scraped on vLLM's API port, which only routers may reach (so
    Prometheus either got nothing or, with a rule for it, prompts too), and no policy let a
    monitoring namespace reach the daemons' metrics port."""
    pods = {"router": _pod("Deployment", "kvkeep-router"),
            "worker": _pod("Deployment", "kvkeep-worker"),
            "store": _pod("DaemonSet", "kvkeep-store"),
            "etcd": _pod("StatefulSet", "kvkeep-etcd")}
    scraped = {"kvkeep-daemon": "store", "kvkeep-worker": "worker", "kvkeep-router": "router"}
    monitors = _monitors()
    assert set(monitors) == set(scraped)
    reached = {(scraped[name], _monitored_port(m)) for name, m in monitors.items()}
    assert reached == {("store", "metrics"), ("worker", "metrics"), ("router", "http")}
    for pod_name, port in reached:
        assert port in pods[pod_name][1], (pod_name, port)
    # Every named port of every kvkeep pod: Prometheus gets exactly the scraped ones.
    for pod_name, pod in pods.items():
        for port in pod[1]:
            assert allowed(PROMETHEUS, pod, port) == ((pod_name, port) in reached), (
                pod_name, port)
    assert pods["worker"][1]["metrics"] != pods["worker"][1]["http"]  # not vLLM's API port
    # Nobody else gains the metrics ports: another pod of the monitoring namespace, a
    # Prometheus of an unlabelled namespace or of kvkeep's own, the routers, the world.
    others = [Source({"app.kubernetes.io/name": "grafana"}, {"kvkeep.io/monitoring": "true"}),
              Source({"app.kubernetes.io/name": "prometheus"}, {"team": "b"}),
              Source({"app.kubernetes.io/name": "prometheus"}),
              Source(pods["router"][0]), OUTSIDE]
    for source in others:
        for pod_name in ("store", "worker"):
            assert not allowed(source, pods[pod_name], "metrics"), (source, pod_name)


def test_service_monitors_check_the_daemons_tls() -> None:
    """The daemons serve /metrics over HTTPS (they have --tls-cert): Prometheus checks their
    certificate against the cluster CA under the daemons' shared name, from a Secret holding
    the CA certificate alone, and presents none of its own (one of the cluster CA would open
    etcd too)."""
    doc, daemon = _container("DaemonSet", "kvkeep-store", "kvstore")
    assert "--tls-cert" in daemon["args"] and "--metrics-listen" in daemon["args"]
    monitors = _monitors()
    (endpoint,) = monitors["kvkeep-daemon"]["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    tls = endpoint["tlsConfig"]
    assert tls["serverName"] == STORE_SERVER_NAME
    assert not {"cert", "keySecret", "insecureSkipVerify"} & set(tls)
    ca = tls["ca"]["secret"]
    assert ca["name"] == CA_SECRET and set(GENERATED[CA_SECRET]["stringData"]) == {ca["key"]}
    store_tls = _secret_file(daemon["args"][daemon["args"].index("--tls-cert") + 1],
                             _mounts(doc, daemon))[0]
    assert GENERATED[CA_SECRET]["stringData"][ca["key"]] == \
        GENERATED[store_tls]["stringData"]["ca.crt"]
    # The others are plain HTTP on the pod network, as the workers' vLLM and the routers are.
    for name in ("kvkeep-worker", "kvkeep-router"):
        (endpoint,) = monitors[name]["spec"]["endpoints"]
        assert endpoint.get("scheme", "http") == "http" and "tlsConfig" not in endpoint
    # The agent relays on its `metrics` port, bound where vLLM binds (the pod IP).
    _, agent = _container("Deployment", "kvkeep-worker", "kvkeep-agent")
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    relay = agent["args"][agent["args"].index("--metrics-listen") + 1]
    assert relay == f"$(POD_IP):{ports['metrics']}"


def test_worker_ports_bind_the_pod_ip_only() -> None:
    vllm = _one("Deployment", "kvkeep-worker")["spec"]["template"]["spec"]["containers"][0]
    args = vllm["args"]
    assert args[args.index("--host") + 1] == "$(POD_IP)"
    events = json.loads(args[args.index("--kv-events-config") + 1])
    # The pod IP alone, in the IPv4-mapped form vLLM binds (tests/test_deploy_manifests.py).
    assert events["endpoint"] == "tcp://[::ffff:$(POD_IP)]:5557"  # not tcp://*: one interface


# -- TLS settings in the manifests -------------------------------------------------------------

def _mounts(doc: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """mountPath -> the Secret mounted there, for one container."""
    volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"].get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]]["secret"]["secretName"]
            for m in container.get("volumeMounts", [])
            if "secret" in volumes.get(m["name"], {})}


def _container(kind: str, name: str, container: str) -> tuple[dict[str, Any], dict[str, Any]]:
    doc = _one(kind, name)
    (c,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == container]
    return doc, c


GENERATED = {d["metadata"]["name"]: d for d in build_secrets()}
DEFINED = {d["metadata"]["name"]: d for d in DOCS if d["kind"] == "Secret"}


def _secret_file(path: str, mounts: dict[str, str]) -> tuple[str, str]:
    """(Secret, key) a path in a container names; fails if it is not a mounted Secret key."""
    for mount, secret in mounts.items():
        if path.startswith(mount.rstrip("/") + "/"):
            key = path[len(mount.rstrip("/")) + 1:]
            source = GENERATED.get(secret) or DEFINED.get(secret)
            assert source is not None, f"{secret} is neither generated nor in the manifests"
            assert key in source["stringData"], (secret, key)
            return secret, key
    raise AssertionError(f"{path} is not in a mounted Secret ({mounts})")


PATH_FLAGS = ("--etcd-ca", "--etcd-cert", "--etcd-key", "--tls-ca", "--tls-cert", "--tls-key",
              "--registration-key", "--token-file", "--cert-file", "--key-file",
              "--trusted-ca-file", "--peer-cert-file", "--peer-key-file",
              "--peer-trusted-ca-file")


def _paths(args: list[str]) -> list[str]:
    found = [args[i + 1] for i, a in enumerate(args[:-1]) if a in PATH_FLAGS]
    found += [a.split("=", 1)[1] for a in args if a.split("=", 1)[0] in PATH_FLAGS
              and "=" in a]
    return found


def test_etcd_runs_with_tls_and_client_certificate_auth() -> None:
    doc, etcd = _container("StatefulSet", "kvkeep-etcd", "etcd")
    flags = {a.split("=", 1)[0]: a.split("=", 1)[1] if "=" in a else True for a in etcd["args"]}
    assert flags["--client-cert-auth"] is True and flags["--peer-client-cert-auth"] is True
    for url_flag in ("--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls",
                     "--initial-advertise-peer-urls"):
        assert str(flags[url_flag]).startswith("https://"), url_flag
    assert all(u.split("=", 1)[1].startswith("https://")
               for u in str(flags["--initial-cluster"]).split(","))
    assert str(flags["--listen-metrics-urls"]).endswith(":2381")  # the probes' plaintext port
    mounts = _mounts(doc, etcd)
    assert {_secret_file(p, mounts)[0] for p in _paths(etcd["args"])} == {"kvkeep-etcd-tls"}


def test_every_kvkeep_command_carries_the_tls_settings() -> None:
    parser = build_parser()
    expected_identity = {"kvkeep-store": "kvkeep-store-tls", "kvkeep-worker": "kvkeep-agent-tls",
                         "kvkeep-router": "kvkeep-router-tls"}
    for kind, name, container in (("DaemonSet", "kvkeep-store", "kvstore"),
                                  ("Deployment", "kvkeep-worker", "kvkeep-agent"),
                                  ("Deployment", "kvkeep-router", "router")):
        doc, c = _container(kind, name, container)
        args = [_expand(a) for a in c["args"]]
        spec = etcd_spec_from_args(parser.parse_args(args))
        assert spec is not None and spec.secure, name
        assert spec.ca_file and spec.cert_file and spec.key_file, name
        mounts = _mounts(doc, c)
        used = {_secret_file(p, mounts)[0] for p in _paths(args)}
        assert expected_identity[name] in used, (name, used)
    # deploy/gateway's picker is a router replica on the same etcd.
    (epp_doc,) = [d for p in sorted(GATEWAY.glob("*.yaml")) if p.name != "envoy.yaml"
                  for d in yaml.safe_load_all(p.read_text())
                  if d and d["kind"] == "Deployment" and d["metadata"]["name"] == "kvkeep-epp"]
    (epp,) = epp_doc["spec"]["template"]["spec"]["containers"]
    epp_args = [a.replace("$(POD_NAME)", "kvkeep-epp-1") for a in epp["args"]]
    spec = etcd_spec_from_args(parser.parse_args(epp_args))
    assert spec is not None and spec.secure and spec.cert_file is not None
    assert {_secret_file(p, _mounts(epp_doc, epp))[0] for p in _paths(epp_args)} == {
        "kvkeep-router-tls"}
    doc, daemon = _container("DaemonSet", "kvkeep-store", "kvstore")
    args = daemon["args"]
    for flag in ("--tls-cert", "--tls-key", "--tls-ca", "--registration-key"):
        assert flag in args
    assert args[args.index("--tls-server-name") + 1] == STORE_SERVER_NAME
    probe = daemon["readinessProbe"]["exec"]["command"]
    assert probe[probe.index("--tls-server-name") + 1] == STORE_SERVER_NAME
    mounts = _mounts(doc, daemon)
    for path in _paths(probe):
        _secret_file(path, mounts)
    assert _secret_file(args[args.index("--registration-key") + 1], mounts)[0] == \
        "kvkeep-registration-key"


def test_the_connector_config_carries_the_tls_settings() -> None:
    doc, vllm = _container("Deployment", "kvkeep-worker", "vllm")
    args = vllm["args"]
    extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    remote = ConnectorConfig.from_extra(extra).store.remote
    assert remote is not None and isinstance(remote.etcd, EtcdSpec) and remote.etcd.secure
    assert remote.tls_ca and remote.tls_cert and remote.tls_key
    assert remote.tls_server_name == STORE_SERVER_NAME
    assert remote.registration_public_key is not None
    mounts = _mounts(doc, vllm)
    etcd = remote.etcd
    files = [str(p) for p in (etcd.ca_file, etcd.cert_file, etcd.key_file)] + [
        remote.tls_ca, remote.tls_cert, remote.tls_key, remote.registration_public_key,
        remote.token_file or ""]
    used = {_secret_file(f, mounts)[0] for f in files}
    assert used == {"kvkeep-connector-tls", "kvkeep-registration-pubkey",
                    "kvkeep-worker-store-token"}


def test_generated_secrets_name_what_the_manifests_dial(tmp_path: Path) -> None:
    from cryptography import x509

    def names(secret: str) -> set[str]:
        cert = x509.load_pem_x509_certificate(GENERATED[secret]["stringData"]["tls.crt"].encode())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return set(san.get_values_for_type(x509.DNSName)) | {
            str(ip) for ip in san.get_values_for_type(x509.IPAddress)}

    etcd_names = names("kvkeep-etcd-tls")
    assert "kvkeep-etcd" in etcd_names  # what every client's --etcd names
    assert "*.kvkeep-etcd-headless.kvkeep.svc" in etcd_names  # each member's advertised URL
    assert STORE_SERVER_NAME in names("kvkeep-store-tls")
    # Every Secret a pod mounts exists: in the manifests (tokens) or generated.
    for doc in DOCS:
        for volume in doc.get("spec", {}).get("template", {}).get("spec", {}).get(
                "volumes", []):
            if "secret" in volume:
                secret = volume["secret"]["secretName"]
                assert secret in GENERATED or secret in DEFINED, secret
    out = tmp_path / "secrets.yaml"
    assert main(["--out", str(out), "--namespace", "kvkeep"]) == 0
    written = [d for d in yaml.safe_load_all(out.read_text()) if d]
    assert {d["metadata"]["name"] for d in written} == set(GENERATED)
    assert out.stat().st_mode & 0o077 == 0  # private keys: owner only
    assert {i.secret for i in identities()} <= set(GENERATED)


# -- the settings work, with real processes ----------------------------------------------------

def _materialize(tmp: Path) -> dict[str, Path]:
    """Write every Secret (generated, and the manifests' own) as files: name -> directory."""
    dirs = {}
    for name, doc in {**DEFINED, **GENERATED}.items():
        directory = tmp / "secrets" / name
        directory.mkdir(parents=True)
        for key, value in doc["stringData"].items():
            (directory / key).write_text(value)
            (directory / key).chmod(0o600)
        dirs[name] = directory
    return dirs


def _localize(args: list[str], doc: dict[str, Any], container: dict[str, Any],
              dirs: dict[str, Path], replace: dict[str, str]) -> list[str]:
    """A container's arguments with mounted paths moved into `dirs` and hosts replaced."""
    out = []
    for raw in args:
        arg = _expand(raw)
        for mount, secret in _mounts(doc, container).items():
            arg = arg.replace(mount.rstrip("/") + "/", f"{dirs[secret]}/")
        for old, new in replace.items():
            arg = arg.replace(old, new)
        out.append(arg)
    return out


def _start_manifest_etcd(tmp: Path, dirs: dict[str, Path]) -> tuple[subprocess.Popen[bytes],
                                                                     int]:
    doc, etcd = _container("StatefulSet", "kvkeep-etcd", "etcd")
    port, peer, metrics = free_port(), free_port(), free_port()
    mounted = _localize(etcd["args"], doc, etcd, dirs, {})
    keep = [a for a in mounted if a.split("=", 1)[0] in PATH_FLAGS or a in (
        "--client-cert-auth", "--peer-client-cert-auth")]
    etcd_bin = shutil.which("etcd")
    assert etcd_bin is not None, "etcd not installed: run `make setup`"
    argv = [etcd_bin, "--name", "m0", "--data-dir", str(tmp / "etcd"),
            f"--listen-client-urls=https://127.0.0.1:{port}",
            f"--advertise-client-urls=https://127.0.0.1:{port}",
            f"--listen-peer-urls=https://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=https://127.0.0.1:{peer}",
            f"--initial-cluster=m0=https://127.0.0.1:{peer}",
            f"--listen-metrics-urls=http://127.0.0.1:{metrics}",
            "--heartbeat-interval=10", "--election-timeout=100", "--unsafe-no-fsync",
            "--log-level=error", *keep]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port, proc=proc)
    return proc, port


def test_manifest_settings_work_together(tmp_path: Path) -> None:
    dirs = _materialize(tmp_path)
    proc, etcd_port = _start_manifest_etcd(tmp_path, dirs)
    etcd_url = f"https://127.0.0.1:{etcd_port}"
    hosts = {"https://kvkeep-etcd:2379": etcd_url, POD_ENV["$(POD_IP)"]: "127.0.0.1"}
    parser = build_parser()
    daemon: DaemonProcess | None = None
    try:
        # The router's and the agent's etcd clients, from their command lines.
        for kind, name, cname in (("Deployment", "kvkeep-router", "router"),
                                  ("Deployment", "kvkeep-worker", "kvkeep-agent")):
            doc, c = _container(kind, name, cname)
            args = parser.parse_args(_localize(c["args"], doc, c, dirs, hosts))
            spec = config_from_args(args).etcd_url if name == "kvkeep-router" else \
                etcd_spec_from_args(args)
            assert isinstance(spec, EtcdSpec)
            asyncio.run(_router_backend_works(spec, name))
        # Anyone else (a certificate of no CA we know, or none) is refused.
        assert not asyncio.run(_answers(EtcdSpec(
            etcd_url, ca_file=dirs["kvkeep-router-tls"] / "ca.crt"))), "no client certificate"

        # The daemon, with the manifest's flags (listening on loopback here).
        doc, c = _container("DaemonSet", "kvkeep-store", "kvstore")
        port = free_port()
        args = _localize(c["args"], doc, c, dirs, hosts)
        args[args.index("--listen") + 1] = f"127.0.0.1:{port}"
        args[args.index("--advertise") + 1] = f"127.0.0.1:{port}"
        args[args.index("--data-dir") + 1] = str(tmp_path / "store")
        args[args.index("--mem-budget") + 1] = "64MiB"
        args[args.index("--disk-budget") + 1] = "256MiB"
        metrics_port = free_port()
        args[args.index("--metrics-listen") + 1] = f"127.0.0.1:{metrics_port}"
        serve = args[args.index("serve") + 1:]
        daemon = DaemonProcess("node", port, tmp_path / "store", tmp_path / "store.log", serve)
        daemon.spawn()
        probe = _localize(c["readinessProbe"]["exec"]["command"][1:], doc, c, dirs, {})
        probe[probe.index("--address") + 1] = f"127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}

        def probe_ok() -> bool:
            done = subprocess.run([sys.executable, "-m", "kvstore.commands", *probe], env=env,
                                  capture_output=True, timeout=30, check=False)
            return done.returncode == 0
        try:
            wait_until(probe_ok, timeout=60, step=0.5)  # the manifest's exec probe
        except TimeoutError:
            raise AssertionError(daemon.log_text()) from None

        # Its /metrics, scraped as the ServiceMonitor's tlsConfig says (the CA from the Secret
        # it names, the server name it checks, no client certificate); plain HTTP gets nothing.
        (endpoint,) = _monitors()["kvkeep-daemon"]["spec"]["endpoints"]
        tls = endpoint["tlsConfig"]
        ca_file = dirs[tls["ca"]["secret"]["name"]] / tls["ca"]["secret"]["key"]
        page = _scrape(metrics_port, endpoint["path"], ca_file, tls["serverName"])
        assert page.startswith(b"HTTP/1.0 200") and b"kvkeep_daemon_" in page, page[:200]
        with pytest.raises(ssl.SSLCertVerificationError):
            _scrape(metrics_port, "/metrics", ca_file, "kvkeep-etcd")  # the name is checked
        assert not _scrape(metrics_port, "/metrics", None, None).startswith(b"HTTP/1.0 200")

        # The connector's store, from the manifest's --kv-transfer-config.
        doc, vllm = _container("Deployment", "kvkeep-worker", "vllm")
        raw = _localize(vllm["args"], doc, vllm, dirs, hosts)
        extra = json.loads(raw[raw.index("--kv-transfer-config") + 1])
        extra["kv_connector_extra_config"]["store"]["host_bytes"] = 0
        extra["kv_connector_extra_config"]["store"]["remote"]["replicas"] = 1
        config = ConnectorConfig.from_extra(extra["kv_connector_extra_config"])
        (tier,) = build_tiers(tier_specs(config.store))
        assert isinstance(tier, RemoteTier)
        try:
            wait_until(lambda: tier.members() == [POD_ENV["$(NODE_NAME)"]], timeout=30)
            key = block_key(5, Namespace(config.tenant))  # the token's tenant
            assert tier.put(key, make_frame(key))
            read = tier.get(key)
            assert read is not None and read.to_frame() == make_frame(key)
            # The registration is signed, and gRPC+TLS carries the blocks (no TCP plane).
            assert tier.data_plane_addresses() == {POD_ENV["$(NODE_NAME)"]: None}
        finally:
            tier.close()
        registered = asyncio.run(_registration(EtcdSpec(
            etcd_url, ca_file=dirs["kvkeep-store-tls"] / "ca.crt",
            cert_file=dirs["kvkeep-store-tls"] / "tls.crt",
            key_file=dirs["kvkeep-store-tls"] / "tls.key")))
        assert b'"sig"' in registered
    finally:
        if daemon is not None:
            daemon.terminate()
        stop_process(proc)


def _scrape(port: int, path: str, ca_file: Path | None, server_name: str | None) -> bytes:
    """One GET over TLS checked against `ca_file` under `server_name` (None: plain HTTP);
    the raw answer (empty if the server hung up)."""
    request = f"GET {path} HTTP/1.0\r\nHost: {server_name or 'x'}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        conn: socket.socket = raw
        if ca_file is not None:
            conn = ssl.create_default_context(cafile=str(ca_file)).wrap_socket(
                raw, server_hostname=server_name)
        chunks = []
        try:
            conn.sendall(request)
            while chunk := conn.recv(1 << 16):
                chunks.append(chunk)
        except (ConnectionResetError, ssl.SSLError):
            pass  # (plain HTTP to the TLS port: the server drops it)
        return b"".join(chunks)


async def _router_backend_works(spec: EtcdSpec, who: str) -> None:
    backend = EtcdBackend(spec, f"/check-{who}")
    try:
        lease = await backend.register_worker(
            WorkerInfo(WorkerId("w"), "http://127.0.0.1:1", ("m",), None), 2.0)
        assert [w.worker_id for w in await backend.list_workers()] == ["w"]
        await lease.revoke()
    finally:
        await backend.close()


async def _answers(spec: EtcdSpec) -> bool:
    client = etcd_client(spec, timeout=2)
    try:
        await client.get(b"/x")
        return True
    except Exception:
        return False
    finally:
        await client.close()


async def _registration(spec: EtcdSpec) -> bytes:
    client = etcd_client(spec, timeout=5)
    try:
        listing = await client.get_prefix(b"/kvkeep/stores/")
        (kv,) = list(listing)
        return bytes(kv.value)
    finally:
        await client.close()

