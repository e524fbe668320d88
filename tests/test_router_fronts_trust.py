"""Every front enforces the same tenant rules (issue 16 item 4, trust-review H5 and M11): the
ext_proc endpoint picker forwards only the HTTP front's paths, authenticates on the request
headers whatever the body mode, refuses body modes it cannot rewrite, strips the tenant's key
and the client's destination headers, rewrites `cache_salt` and `kv_transfer_params`, and
listens beyond loopback only with keys; salts are keyed by a secret. The ext_proc side is
driven through `Process` over a real gRPC channel as tests/test_router_extproc.py does; the
router is a real replica over fake vLLM workers."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

ep = pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2",
                         reason="the gateway extra (xds-protos) is not installed")

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2  # noqa: E402

from deploy.local.services import free_port  # noqa: E402
from kvstore.commands.kvkeep import build_parser  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402
from router.commands import config_from_args  # noqa: E402
from router.config import RouterConfig, StaticWorker  # noqa: E402
from router.extproc.server import ExtProcServer  # noqa: E402
from router.membership.workers import WorkerId  # noqa: E402
from router.tenants import ApiKeys  # noqa: E402
from tests.router_harness import FakeWorker, LoopThread, RouterHandle, wait_until  # noqa: E402
from tests.test_router_extproc import Envoy, headers, set_headers  # noqa: E402

Mode = processing_mode_pb2.ProcessingMode
KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789ab",
        "ops": "operator-key-0123456789"}
TENANTS = ApiKeys({KEYS["alice"]: "alice", KEYS["bob"]: "bob", KEYS["ops"]: "*"})
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _auth(who: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[who]}"}


@dataclass
class Env:
    lt: LoopThread
    workers: dict[str, FakeWorker]
    router: RouterHandle
    channel: grpc.Channel

    def sent(self) -> int:
        return sum(len(w.requests) for w in self.workers.values())


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    lt = LoopThread()
    workers = {w: FakeWorker() for w in ("w1", "w2")}
    for worker in workers.values():
        lt.run(worker.start())
    port = free_port()
    config = RouterConfig(port=free_port(), api_keys=TENANTS, static_workers=tuple(
        StaticWorker(WorkerId(w), fw.url) for w, fw in workers.items()),
        static_ttl_s=30.0, extproc_listen=f"127.0.0.1:{port}", scrape_interval_s=0.1)
    router = RouterHandle(lt, config).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    assert router.service is not None
    core = router.service.core
    wait_until(lambda: len([s for s in core.workers() if core.usable(s)]) == 2, timeout=15)
    yield Env(lt, workers, router, channel)
    channel.close()
    router.stop()
    for worker in workers.values():
        lt.run(worker.stop())
    lt.close()


class BareEnvoy(Envoy):
    """An Envoy that sends no protocol_config (the body mode is unknown to the picker)."""

    def __init__(self, env: Any) -> None:
        super().__init__(env)
        self._first = False


def _envoy(env: Env, mode: str) -> Envoy:
    """An Envoy stream in body mode `mode` (its name), or one without protocol_config."""
    if mode == "unknown":
        return BareEnvoy(env)
    return Envoy(env, body_mode=Mode.BodySendMode.Value(mode))


def _first_answer(envoy: Envoy, path: str, *, method: str = "POST", eos: bool = False,
                  **extra: str) -> Any:
    envoy.send(request_headers=headers(path, method=method, eos=eos, **extra))
    return envoy.recv()


@pytest.mark.parametrize(("method", "path", "status"), [
    ("POST", "/inference/v1/generate", 404),   # takes cache_salt and raw kv_transfer_params
    ("POST", "/v1/responses", 404),            # takes cache_salt
    ("GET", "/metrics", 404),                  # the worker's prefix-cache counters
    ("POST", "/scale_elastic_ep", 404),        # an admin call
    ("GET", "/health", 404),
    ("GET", "/v1/chat/completions", 405),
    ("POST", "/v1/models", 405),
])
def test_ext_proc_forwards_only_the_http_fronts_paths(env: Env, method: str, path: str,
                                                      status: int) -> None:
    """H5.1: a path outside the HTTP front's set is an immediate 404 (405 for another method
    on one of them), on the request headers, for any body mode: never a pick, never a worker."""
    before = env.sent()
    for mode in (Mode.BUFFERED, Mode.FULL_DUPLEX_STREAMED, Mode.NONE):
        envoy = Envoy(env, body_mode=mode)
        answer = _first_answer(envoy, path, method=method, **_auth("alice"))
        assert answer.immediate_response.status.code == status, (path, mode)
        envoy.cancel()
    assert env.sent() == before


@pytest.mark.parametrize("mode", ["NONE", "unknown", "STREAMED", "BUFFERED",
                                  "FULL_DUPLEX_STREAMED"])
def test_ext_proc_authenticates_on_the_headers_whatever_the_body_mode(env: Env,
                                                                      mode: str) -> None:
    """H5.3: without a good key the first answer is a 401, in every body mode (the probe:
    request_body_mode NONE with headers that do not end the stream got an empty
    HeadersResponse, no 401, and the client's own destination header was honoured)."""
    for auth in ({}, {"authorization": "Bearer wrong-key-0123456789"}):
        envoy = _envoy(env, mode)
        answer = _first_answer(envoy, "/v1/chat/completions",
                               **{"x-gateway-destination-endpoint": "127.0.0.1:1"}, **auth)
        assert answer.immediate_response.status.code == 401, (mode, auth)
        envoy.cancel()


@pytest.mark.parametrize("mode", ["NONE", "unknown", "GRPC"])
def test_body_modes_that_hide_the_body_cannot_pick(env: Env, mode: str) -> None:
    """H5.3: a request with a body in a mode where the picker never sees (or cannot rewrite)
    it is refused, not passed on with the client's salt and kv_transfer_params."""
    envoy = _envoy(env, mode)
    answer = _first_answer(envoy, "/v1/chat/completions", **_auth("alice"))
    immediate = answer.immediate_response
    assert immediate.status.code == 500
    assert "cannot carry a pick" in json.loads(immediate.body)["error"]["message"]
    envoy.cancel()
    # Without a body there is nothing to rewrite: picked on the headers, as before.
    envoy = _envoy(env, mode)
    answer = _first_answer(envoy, "/v1/models", method="GET", eos=True, **_auth("alice"))
    assert "x-gateway-destination-endpoint" in set_headers(answer.request_headers.response)
    envoy.cancel()


@pytest.mark.parametrize("mode", [Mode.BUFFERED, Mode.FULL_DUPLEX_STREAMED])
def test_the_key_and_the_clients_destination_headers_never_reach_a_worker(env: Env,
                                                                         mode: int) -> None:
    """H5.2: the pick's header mutation removes `authorization` and every client header of
    the `x-gateway-destination-endpoint` family it does not overwrite, and overwrites the
    destination itself."""
    envoy = Envoy(env, body_mode=mode)
    client = {"x-gateway-destination-endpoint": "10.6.6.6:80",
              "x-gateway-destination-endpoint-served": "10.6.6.6:80",
              "x-gateway-destination-endpoint-fallback": "10.6.6.6:80", **_auth("bob")}
    envoy.send(request_headers=headers("/v1/chat/completions", **client))
    if mode == Mode.BUFFERED:
        assert envoy.recv().WhichOneof("response") == "request_headers"
    envoy.send(request_body=ep.HttpBody(body=json.dumps(CHAT).encode(), end_of_stream=True))
    answer = envoy.recv()
    common = answer.request_body.response if mode == Mode.BUFFERED \
        else answer.request_headers.response
    removed = set(common.header_mutation.remove_headers)
    assert removed == {"authorization", "x-gateway-destination-endpoint-served",
                       "x-gateway-destination-endpoint-fallback"}
    destination = set_headers(common)["x-gateway-destination-endpoint"]
    assert "10.6.6.6" not in destination
    envoy.cancel()


def test_ext_proc_rewrites_the_salt_and_kv_transfer_params(env: Env) -> None:
    """H5.1: alice's body with bob's salt and a session of her choosing in kv_transfer_params
    goes on with her own salt and only the `restore` she may set (plus the router's fields)."""
    body = {**CHAT, "cache_salt": TENANTS.cache_salt("bob"),
            "kv_transfer_params": {"restore": "none", "session_id": "bobs-session",
                                   "previous_worker": "w1", "mine": 1}}
    envoy = Envoy(env)
    envoy.send(request_headers=headers("/v1/chat/completions", **_auth("alice")))
    envoy.recv()
    envoy.send(request_body=ep.HttpBody(body=json.dumps(body).encode(), end_of_stream=True))
    sent = json.loads(envoy.recv().request_body.response.body_mutation.body)
    assert sent["cache_salt"] == TENANTS.cache_salt("alice") != TENANTS.cache_salt("bob")
    assert set(sent.get("kv_transfer_params", {})) <= {"restore"}
    assert sent.get("kv_transfer_params", {}).get("restore") == "none"
    envoy.cancel()


def test_a_get_forwards_no_body(env: Env) -> None:
    envoy = Envoy(env)
    envoy.send(request_headers=headers("/v1/models", method="GET", **_auth("alice")))
    envoy.recv()
    envoy.send(request_body=ep.HttpBody(body=json.dumps({"cache_salt": "x"}).encode(),
                                        end_of_stream=True))
    common = envoy.recv().request_body.response
    assert common.body_mutation.body == b""
    assert set_headers(common)["content-length"] == "0"
    envoy.cancel()


def _config(*flags: str) -> RouterConfig:
    return config_from_args(build_parser().parse_args(["router", "serve", *flags]))


def _key_file(tmp_path: Path) -> Path:
    path = tmp_path / "api-keys"
    path.write_text("".join(f"{k} {'*' if t == 'ops' else t}\n" for t, k in KEYS.items()))
    return path


def test_ext_proc_listens_beyond_loopback_only_with_keys(tmp_path: Path) -> None:
    """H5.4: `--extproc-listen 0.0.0.0:9002` without keys is refused, as `--listen` is."""
    for address in ("0.0.0.0:9002", ":9002", "10.1.2.3:9002", "[::]:9002"):
        with pytest.raises(ConfigError, match="loopback only"):
            _config("--extproc-listen", address)
    assert _config("--extproc-listen", "127.0.0.1:9002").extproc_listen == "127.0.0.1:9002"
    assert _config("--extproc-listen", "[::1]:9002").extproc_listen == "[::1]:9002"
    keyed = _config("--extproc-listen", "0.0.0.0:9002", "--api-keys", str(_key_file(tmp_path)))
    assert keyed.extproc_listen == "0.0.0.0:9002"
    with pytest.raises(ConfigError, match="loopback only"):  # built in code, not by the CLI
        ExtProcServer(None, "0.0.0.0:9002")  # type: ignore[arg-type]


def test_cache_salts_are_keyed_by_a_secret(tmp_path: Path) -> None:
    """The salt is no longer a public function of the tenant name: the old derivation
    (blake2b of the name) does not give it; the same key file gives the same salts on every
    replica; a salt key file decides them alone, and another file gives other salts."""
    public = "kvkeep-" + hashlib.blake2b(b"bob", digest_size=16,
                                         person=b"kvkeep-tenant").hexdigest()
    assert TENANTS.cache_salt("bob") != public
    assert ApiKeys({KEYS["bob"]: "bob"}).cache_salt("bob") == TENANTS.cache_salt("bob")
    assert ApiKeys({"another-key-of-bob-01": "bob"}).cache_salt("bob") != \
        TENANTS.cache_salt("bob")  # keyed by his keys: nobody else can compute it
    for tenant in ("alice", "bob", "*"):
        salt = TENANTS.cache_salt(tenant)
        assert salt.startswith("kvkeep-") and len(salt) == 39
    keys = _key_file(tmp_path)
    secret = tmp_path / "salt.key"
    secret.write_text("ab" * 32 + "\n")
    one = _config("--api-keys", str(keys), "--cache-salt-key-file", str(secret)).api_keys
    two = _config("--api-keys", str(keys), "--cache-salt-key-file", str(secret),
                  "--api-key", "extra-key-0123456789").api_keys
    assert one is not None and two is not None
    assert one.cache_salt("bob") == two.cache_salt("bob") != TENANTS.cache_salt("bob")
    secret.write_text("cd" * 32 + "\n")
    other = _config("--api-keys", str(keys), "--cache-salt-key-file", str(secret)).api_keys
    assert other is not None and other.cache_salt("bob") != one.cache_salt("bob")
    with pytest.raises(ConfigError, match="needs API keys"):
        _config("--cache-salt-key-file", str(secret))
    short = tmp_path / "short.key"
    short.write_text("too short")
    with pytest.raises(ConfigError):
        _config("--api-keys", str(keys), "--cache-salt-key-file", str(short))


def test_the_http_front_sets_the_keyed_salt(env: Env) -> None:
    """The HTTP front and ext_proc give a tenant the same salt (one rule for both fronts)."""
    worker_requests = [len(w.requests) for w in env.workers.values()]
    r = httpx.post(f"{env.router.url}/v1/chat/completions",
                   json={**CHAT, "cache_salt": TENANTS.cache_salt("bob")},
                   headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=10)
    assert r.status_code == 200, r.text
    sent = [w.requests[-1] for w, n in zip(env.workers.values(), worker_requests, strict=True)
            if len(w.requests) > n]
    assert [s["cache_salt"] for s in sent] == [TENANTS.cache_salt("alice")]


# --- M11: no cross-tenant exact-prompt oracle --------------------------------------------------
def test_one_tenants_tokenized_prompt_is_no_hit_for_another() -> None:
    """M11: bob sends P; alice sending P again is a tokenize-cache miss (the counter does not
    move, and the worker is asked again), while bob's own repeat is a hit."""
    import asyncio

    from router.front.admission import admit
    from router.front.api import Endpoint, parse_request
    from tests.test_router_tokenize import StandIn, _with_stand_ins

    def request(tenant: str, prompt: str) -> Any:
        raw = json.dumps({"model": "m", "prompt": prompt}).encode()
        return admit(parse_request(Endpoint.COMPLETIONS, raw, None), tenant, keys=TENANTS)

    async def go() -> None:
        stand_in = StandIn()
        tok, http, _ = await _with_stand_ins(stand_in)
        cached = tok.outcomes.labels("cached")
        try:
            secret = "a templated question about my diagnosis"
            assert (await tok.features(request("bob", secret))).prompt_tokens is not None
            assert cached._value.get() == 0 and len(stand_in.calls) == 1
            assert (await tok.features(request("alice", secret))).prompt_tokens is not None
            assert cached._value.get() == 0 and len(stand_in.calls) == 2  # no hit for her
            await tok.features(request("bob", secret))
            assert cached._value.get() == 1 and len(stand_in.calls) == 2  # his own entry
        finally:
            await http.close()
            assert stand_in.runner is not None
            await stand_in.runner.cleanup()

    asyncio.run(go())


def test_metrics_and_health_detail_are_an_operators(env: Env) -> None:
    """M11: with API keys `/metrics` needs an operator's key (401 without a key, 403 with a
    tenant's), and `/health` tells anyone else only that the router is up."""
    url = env.router.url
    auth = {who: {"Authorization": f"Bearer {key}"} for who, key in KEYS.items()}
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401
    assert httpx.get(f"{url}/metrics", headers=auth["alice"], timeout=10).status_code == 403
    metrics = httpx.get(f"{url}/metrics", headers=auth["ops"], timeout=10)
    assert metrics.status_code == 200 and "kvkeep_router_requests_total" in metrics.text
    for headers_ in ({}, auth["alice"], {"Authorization": "Bearer wrong-key-0123456789"}):
        bare = httpx.get(f"{url}/health", headers=headers_, timeout=10)
        assert bare.status_code == 200 and bare.json() == {"status": "ok"}
    detail = httpx.get(f"{url}/health", headers=auth["ops"], timeout=10).json()
    assert detail["status"] == "ok" and detail["workers"]["usable"] == 2


# --- M10: one tenant cannot take every session -------------------------------------------------
def test_one_tenant_cannot_use_up_every_new_session(tmp_path: Path) -> None:
    """M10 (the review's probe): with `--max-sessions 50` and API keys, tenant A opening 50
    sessions is stopped at its own share, and B's first new session is served; without keys
    the one tenant may use the whole total."""
    import random

    from kvstore.keys import SessionId
    from router.core import RouterCore
    from router.decision import RequestFeatures
    from router.errors import TooManySessions
    from router.hooks import Outcome
    from router.membership.workers import WorkerInfo
    from router.policy import build_policy

    keyed = _config("--max-sessions", "50", "--api-keys", str(_key_file(tmp_path))).limits
    assert keyed.sessions_per_tenant == 5
    assert _config("--max-sessions", "50").limits.sessions_per_tenant == 50
    assert _config("--max-sessions", "50", "--max-sessions-per-tenant", "20",
                   "--api-keys", str(_key_file(tmp_path))).limits.sessions_per_tenant == 20
    core = RouterCore(build_policy("kvkeep", rng=random.Random(0)), block_size=4,
                      limits=keyed)
    for i in range(3):
        core.add_worker(WorkerInfo(WorkerId(f"w{i}"), f"sim://w{i}", ("m",)))

    def open_session(tenant: str, sid: str) -> None:
        p = core.place_now(core.route(RequestFeatures("m", SessionId(sid), tenant=tenant)))
        core.finish(p, Outcome(ok=True))

    opened = 0
    for i in range(50):
        try:
            open_session("alice", f"a{i}")
            opened += 1
        except TooManySessions as exc:
            assert "max_sessions_per_tenant 5" in exc.message
    assert opened == 5
    open_session("bob", "b0")  # not a 429
    assert core.sessions.owned_by("bob") == 1


def test_a_served_endpoint_that_was_never_offered_fails_no_worker(env: Env) -> None:
    """H5: whoever sends the stream cannot take a worker out of rotation by claiming that
    an address outside the pick's ranked list served (only a listed fallback means the first
    pick failed)."""
    from google.protobuf import struct_pb2

    assert env.router.service is not None
    core = env.router.service.core
    failed = core.metrics.upstream_failures
    envoy = Envoy(env)
    envoy.send(request_headers=headers("/v1/chat/completions", **_auth("alice")))
    envoy.recv()
    envoy.send(request_body=ep.HttpBody(body=json.dumps(CHAT).encode(), end_of_stream=True))
    answer = envoy.recv()
    first = set_headers(answer.request_body.response)["x-gateway-destination-endpoint"]
    worker = next(w for w, fw in env.workers.items()
                  if first.split(",")[0] == f"127.0.0.1:{fw.port}")
    before = failed.labels(worker)._value.get()
    served = struct_pb2.Struct()
    served.update({"upstream.address": "10.9.9.9:1"})
    envoy.send(response_headers=headers("", eos=True, **{":status": "200"}),
               attributes={"envoy.filters.http.ext_proc": served})
    reply = set_headers(envoy.recv().response_headers.response)
    assert reply["x-kvkeep-worker"] == worker  # not "10.9.9.9:1", not a fallback
    assert failed.labels(worker)._value.get() == before
    assert all(core.usable(s) for s in core.workers())
    envoy.close()
