"""The ext_proc endpoint picker against the protocol, with a real gRPC client playing Envoy:
buffered and full-duplex request bodies, the destination header and envoy.lb metadata with
ranked fallbacks, subset hints, the served endpoint, immediate errors, cancelled streams and
the health names. The router is a real replica (in-process state) over fake vLLM workers."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import grpc
import httpx
import pytest

ep = pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2",
                         reason="the gateway extra (xds-protos) is not installed")

from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc  # noqa: E402
from google.protobuf import struct_pb2  # noqa: E402

from deploy.local.services import free_port  # noqa: E402
from kvstore._proto import health_pb2  # noqa: E402
from router.config import RouterConfig, StaticWorker  # noqa: E402
from router.membership.workers import WorkerId  # noqa: E402
from router.policy import Thresholds, policy_preset  # noqa: E402
from tests.router_harness import FakeWorker, LoopThread, RouterHandle, wait_until  # noqa: E402

Mode = processing_mode_pb2.ProcessingMode
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass
class Env:
    lt: LoopThread
    workers: dict[str, FakeWorker]
    router: RouterHandle
    channel: grpc.Channel

    def endpoint(self, worker: str) -> str:
        return f"127.0.0.1:{self.workers[worker].port}"

    def inflight(self) -> int:
        return sum(w["inflight"] for w in httpx.get(f"{self.router.url}/kvkeep/workers").json())


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    lt = LoopThread()
    workers = {w: FakeWorker() for w in ("w1", "w2", "w3")}
    for worker in workers.values():
        lt.run(worker.start())
    port = free_port()
    policy = policy_preset("kvkeep")
    config = RouterConfig(port=free_port(), static_workers=tuple(
        StaticWorker(WorkerId(w), fw.url) for w, fw in workers.items()),
        static_ttl_s=30.0, extproc_listen=f"127.0.0.1:{port}", scrape_interval_s=0.1,
        policy=replace(policy, thresholds=Thresholds(max_waiting=4)))
    router = RouterHandle(lt, config).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    e = Env(lt, workers, router, channel)
    wait_until(lambda: len([w for w in httpx.get(f"{router.url}/kvkeep/workers").json()
                            if w["usable"]]) == 3, timeout=15)
    yield e
    channel.close()
    router.stop()
    for worker in workers.values():
        lt.run(worker.stop())
    lt.close()


class Envoy:
    """One ext_proc stream, driven message by message as Envoy would."""

    def __init__(self, env: Env, *, body_mode: int = Mode.BUFFERED,
                 response_mode: int = Mode.NONE) -> None:
        self._out: queue.Queue[Any] = queue.Queue()
        self._config = ep.ProtocolConfiguration(request_body_mode=body_mode,
                                                response_body_mode=response_mode)
        self._first = True
        self._responses = ep_grpc.ExternalProcessorStub(env.channel).Process(
            iter(self._out.get, None), timeout=10)

    def send(self, **fields: Any) -> None:
        request = ep.ProcessingRequest(**fields)
        if self._first:
            request.protocol_config.CopyFrom(self._config)
            self._first = False
        self._out.put(request)

    def recv(self) -> Any:
        return next(self._responses)

    def close(self) -> None:
        self._out.put(None)

    def cancel(self) -> None:
        self._responses.cancel()


def headers(path: str, *, eos: bool = False, method: str = "POST", **extra: str) -> Any:
    values = {":method": method, ":path": path, "content-type": "application/json", **extra}
    return ep.HttpHeaders(end_of_stream=eos, headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k.lower(), raw_value=v.encode()) for k, v in values.items()]))


def set_headers(common: Any) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def _body(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


def test_buffered_request_picks_with_fallbacks_and_rewrites_the_body(env: Env) -> None:
    envoy = Envoy(env)
    envoy.send(request_headers=headers("/v1/chat/completions", **{"x-session-id": "x-1"}))
    first = envoy.recv()
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.header_mutation.set_headers  # nothing picked yet
    envoy.send(request_body=ep.HttpBody(body=_body(CHAT), end_of_stream=True))
    answer = envoy.recv()
    common = answer.request_body.response
    picked = set_headers(common)["x-gateway-destination-endpoint"].split(",")
    assert len(picked) == 3 and len(set(picked)) == 3  # the pick, then 2 ranked fallbacks
    assert set(picked) == {env.endpoint(w) for w in env.workers}
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == ",".join(picked)
    assert common.clear_route_cache
    body = json.loads(common.body_mutation.body)
    assert body["kv_transfer_params"]["session_id"] == "x-1"
    assert set_headers(common)["content-length"] == str(len(common.body_mutation.body))
    assert env.inflight() == 1  # the pick is charged until the response ends
    served = struct_pb2.Struct()
    served.update({"upstream.address": picked[0]})
    envoy.send(response_headers=headers("", eos=True, **{":status": "200"}),
               attributes={"envoy.filters.http.ext_proc": served})
    reply = envoy.recv()
    added = set_headers(reply.response_headers.response)
    assert added["x-kvkeep-route"] == "new" and added["x-kvkeep-session"] == "x-1"
    envoy.close()
    wait_until(lambda: env.inflight() == 0)
    # The session sticks: its next request gets the same first endpoint.
    again = Envoy(env)
    again.send(request_headers=headers("/v1/chat/completions", **{"x-session-id": "x-1"}))
    again.recv()
    again.send(request_body=ep.HttpBody(body=_body(CHAT), end_of_stream=True))
    common = again.recv().request_body.response
    assert set_headers(common)["x-gateway-destination-endpoint"].split(",")[0] == picked[0]
    again.cancel()  # Envoy gives up on the stream: the charge is released all the same
    wait_until(lambda: env.inflight() == 0)


def test_full_duplex_answers_after_the_last_chunk(env: Env) -> None:
    envoy = Envoy(env, body_mode=Mode.FULL_DUPLEX_STREAMED,
                  response_mode=Mode.FULL_DUPLEX_STREAMED)
    envoy.send(request_headers=headers("/v1/completions"))
    raw = _body({"model": "fake", "prompt": [1, 2, 3, 4], "max_tokens": 2})
    envoy.send(request_body=ep.HttpBody(body=raw[:10]))
    envoy.send(request_body=ep.HttpBody(body=raw[10:], end_of_stream=True))
    head = envoy.recv()  # the headers' answer comes only now, with the pick
    assert head.WhichOneof("response") == "request_headers"
    assert "x-gateway-destination-endpoint" in set_headers(head.request_headers.response)
    body = envoy.recv().request_body.response.body_mutation.streamed_response
    assert body.end_of_stream and json.loads(body.body)["prompt"] == [1, 2, 3, 4]
    envoy.send(response_headers=headers("", **{":status": "200"}))
    assert envoy.recv().WhichOneof("response") == "response_headers"
    for i, chunk in enumerate((b"data: {}\n\n", b"data: [DONE]\n\n")):
        envoy.send(response_body=ep.HttpBody(body=chunk, end_of_stream=i == 1))
        echoed = envoy.recv().response_body.response.body_mutation.streamed_response
        assert echoed.body == chunk and echoed.end_of_stream == (i == 1)
    wait_until(lambda: env.inflight() == 0)
    envoy.close()


def test_a_subset_hint_restricts_the_pick(env: Env) -> None:
    only = env.endpoint("w3")
    hint = struct_pb2.Struct()
    hint.update({"x-gateway-destination-endpoint-subset": [only]})
    for i in range(3):
        envoy = Envoy(env)
        envoy.send(request_headers=headers("/v1/chat/completions"),
                   metadata_context=base_pb2.Metadata(
                       filter_metadata={"envoy.lb.subset_hint": hint}))
        envoy.recv()
        envoy.send(request_body=ep.HttpBody(body=_body({**CHAT, "max_tokens": i + 1}),
                                            end_of_stream=True))
        common = envoy.recv().request_body.response
        assert set_headers(common)["x-gateway-destination-endpoint"] == only
        envoy.cancel()
    empty = struct_pb2.Struct()
    empty.update({"x-gateway-destination-endpoint-subset": ["10.9.9.9:1"]})
    envoy = Envoy(env)
    envoy.send(request_headers=headers("/v1/models", eos=True, method="GET"),
               metadata_context=base_pb2.Metadata(filter_metadata={"envoy.lb.subset_hint": empty}))
    assert envoy.recv().immediate_response.status.code == 503
    envoy.cancel()


def test_a_request_without_body_is_picked_on_its_headers(env: Env) -> None:
    envoy = Envoy(env)
    envoy.send(request_headers=headers("/v1/models", eos=True, method="GET"))
    answer = envoy.recv()
    picked = set_headers(answer.request_headers.response)["x-gateway-destination-endpoint"]
    assert picked.split(",")[0] in {env.endpoint(w) for w in env.workers}
    envoy.close()


@pytest.mark.parametrize(("body", "session", "status", "kind"), [
    (b"{nope", None, 400, "invalid_request_error"),
    (_body({**CHAT, "model": "missing"}), None, 404, "not_found_error"),
    (_body(CHAT), "../x", 400, "invalid_request_error"),
    (b"x" * (9 << 20), None, 413, "invalid_request_error"),
])
def test_bad_requests_get_immediate_openai_errors(env: Env, body: bytes, session: str | None,
                                                  status: int, kind: str) -> None:
    envoy = Envoy(env)
    extra = {"x-session-id": session} if session else {}
    envoy.send(request_headers=headers("/v1/chat/completions", **extra))
    envoy.recv()
    for start in range(0, len(body), 4 << 20):
        envoy.send(request_body=ep.HttpBody(body=body[start:start + (4 << 20)],
                                            end_of_stream=start + (4 << 20) >= len(body)))
    answer = envoy.recv()
    while answer.WhichOneof("response") == "request_body":  # STREAMED-style chunk answers
        answer = envoy.recv()
    immediate = answer.immediate_response
    assert immediate.status.code == status
    assert json.loads(immediate.body)["error"]["type"] == kind
    assert {h.header.key for h in immediate.headers.set_headers} >= {"content-type"}
    envoy.cancel()


def test_a_body_mode_that_routes_before_the_body_is_refused(env: Env) -> None:
    envoy = Envoy(env, body_mode=Mode.STREAMED)
    envoy.send(request_headers=headers("/v1/chat/completions"))
    immediate = envoy.recv().immediate_response
    assert immediate.status.code == 500
    assert "FULL_DUPLEX_STREAMED" in json.loads(immediate.body)["error"]["message"]
    envoy.cancel()


def test_saturated_workers_are_a_429_with_retry_after(env: Env) -> None:
    for worker in env.workers.values():
        worker.waiting = 10
    try:
        wait_until(lambda: all(w["waiting"] == 10 for w in
                               httpx.get(f"{env.router.url}/kvkeep/workers").json()))
        envoy = Envoy(env)
        envoy.send(request_headers=headers("/v1/chat/completions"))
        envoy.recv()
        envoy.send(request_body=ep.HttpBody(body=_body(CHAT), end_of_stream=True))
        immediate = envoy.recv().immediate_response
        assert immediate.status.code == 429
        assert "retry-after" in {h.header.key for h in immediate.headers.set_headers}
        envoy.cancel()
    finally:
        for worker in env.workers.values():
            worker.waiting = 0


def test_health_names(env: Env) -> None:
    check = env.channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString)
    serving = health_pb2.HealthCheckResponse.ServingStatus.SERVING
    for name in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == serving
    with pytest.raises(grpc.RpcError) as err:
        check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_api_keys_apply_in_ext_proc_mode_too(env: Env) -> None:
    """With API keys, the picker maps Envoy's forwarded Authorization header to a tenant as the
    HTTP front does: no key or a wrong one is a 401, never a pick; a good key picks."""
    from router.tenants import ApiKeys

    keys = ApiKeys({"alice-key-0123456789": "alice"})
    port = free_port()
    config = RouterConfig(port=free_port(), api_keys=keys, static_workers=tuple(
        StaticWorker(WorkerId(w), fw.url) for w, fw in env.workers.items()),
        static_ttl_s=30.0, extproc_listen=f"127.0.0.1:{port}", scrape_interval_s=0.1)
    router = RouterHandle(env.lt, config).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    keyed = Env(env.lt, env.workers, router, channel)
    try:
        assert router.service is not None
        core = router.service.core
        wait_until(lambda: len(core.workers()) == 3, timeout=15)
        for auth in ({}, {"authorization": "Bearer wrong-key-0123456789"}):
            envoy = Envoy(keyed)
            envoy.send(request_headers=headers("/v1/chat/completions", **auth))
            envoy.recv()
            envoy.send(request_body=ep.HttpBody(body=_body(CHAT), end_of_stream=True))
            answer = envoy.recv()
            assert answer.immediate_response.status.code == 401, auth
            envoy.cancel()
        envoy = Envoy(keyed)
        envoy.send(request_headers=headers("/v1/chat/completions",
                                           authorization="Bearer alice-key-0123456789"))
        envoy.recv()
        envoy.send(request_body=ep.HttpBody(body=_body(CHAT), end_of_stream=True))
        answer = envoy.recv()
        assert answer.WhichOneof("response") == "request_body"
        picked = set_headers(answer.request_body.response)
        assert picked["x-gateway-destination-endpoint"].split(",")[0] in {
            keyed.endpoint(w) for w in env.workers}
        envoy.cancel()
    finally:
        channel.close()
        router.stop()
