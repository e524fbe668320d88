"""One HTTP request's ext_proc stream: the phases Envoy sends and what the picker answers.

Request phase. The request headers are authenticated and their path checked first, whatever
the body mode (`EndpointPicker.authorize`: 401, 404, 405). With a `BUFFERED` body the request
headers are then answered at once and the pick rides on the body's answer. Every other mode but
full duplex (`STREAMED` and `BUFFERED_PARTIAL` choose the upstream before the body arrives;
`NONE`, `GRPC`, or no `protocol_config` at all, leave the body unseen, so neither its salt nor
its `kv_transfer_params` could be rewritten) is refused with a 500 that says so: a request
that has a body is never passed on unpicked and unrewritten (trust-review H5). In
`FULL_DUPLEX_STREAMED` (what the protocol requires an EPP to support) Envoy does not wait:
the body's chunks are gathered, and after the last one the headers answer (with the pick)
and the whole new body are sent. A request without a body is picked on its headers.

The pick is sent both ways the protocol asks: the `x-gateway-destination-endpoint` header
(`ip:port[,ip:port...]`, ranked fallbacks after the first) and the same value in the
`envoy.lb` dynamic metadata. A client's own destination header is overwritten, and every
other `x-gateway-destination-endpoint*` header it sent and its `authorization` (the tenant's
API key, which no worker needs) are removed. Errors are immediate responses in the OpenAI
error shape (400, 401, 404, 429 with Retry-After, 503).

Response phase. The response headers are answered with the router's `x-kvkeep-*` headers;
body chunks (full duplex) are passed back unchanged. The endpoint that served (the
`x-gateway-destination-endpoint-served` metadata, or the `upstream.address` attribute) is
compared with the pick: a fallback served means the first pick failed (marked in the pool).
The placement is finished exactly once: at the response's end, or when the stream ends.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from router.errors import BadRequest, RouterError
from router.extproc.picker import EndpointPicker, Pick
from router.hooks import FAILED, Outcome

__all__ = ["DESTINATION", "SERVED", "SUBSET", "LB_NAMESPACE", "SUBSET_NAMESPACE",
           "RequestStream"]

log = logging.getLogger(__name__)

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
_Mode = processing_mode_pb2.ProcessingMode
_FULL_DUPLEX = _Mode.FULL_DUPLEX_STREAMED
_CAN_PICK = frozenset({_Mode.BUFFERED, _FULL_DUPLEX})
"""Body modes in which the pick (and the rewritten body) can follow the whole body."""
_MODE_NAMES = {v: k for k, v in _Mode.BodySendMode.items()}
_STRIPPED = "authorization"
"""The client's header no worker is sent (a tenant's key is the router's business only)."""
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_MAX_BODY = 8 << 20
_DUMPS = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _set(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE)


def _value(header: base_pb2.HeaderValue) -> str:
    return header.raw_value.decode("latin-1") if header.raw_value else str(header.value)


class RequestStream:
    """The state of one ext_proc stream (one HTTP request)."""

    def __init__(self, picker: EndpointPicker, *, max_body_bytes: int = _MAX_BODY) -> None:
        self.picker = picker
        self.max_body_bytes = max_body_bytes
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.body_mode = -1  # unknown until the data plane's protocol_config says
        self.full_duplex = False
        self.response_full_duplex = False
        self.subset: list[str] | None = None
        self.pick: Pick | None = None
        self.status = 0
        self.finished = False

    async def run(self, requests: AsyncIterator[ep.ProcessingRequest]
                  ) -> AsyncIterator[ep.ProcessingResponse]:
        try:
            async for request in requests:
                for response in await self.handle(request):
                    yield response
        finally:
            self.finish(Outcome(ok=200 <= self.status < 300) if self.status else FAILED)

    async def handle(self, request: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        kind = request.WhichOneof("request")
        if request.HasField("protocol_config"):
            config = request.protocol_config
            self.body_mode = config.request_body_mode
            self.full_duplex = config.request_body_mode == _FULL_DUPLEX
            self.response_full_duplex = config.response_body_mode == _FULL_DUPLEX
        self._read_metadata(request)
        try:
            if kind == "request_headers":
                return await self._request_headers(request.request_headers)
            if kind == "request_body":
                return await self._request_body(request.request_body)
        except RouterError as exc:
            return [_immediate(exc)]
        if kind == "response_headers":
            return [await self._response_headers(request)]
        if kind == "response_body":
            return [self._response_body(request.response_body)]
        if kind == "request_trailers":
            return [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_trailers":
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        return []

    def finish(self, outcome: Outcome) -> None:
        if not self.finished and self.pick is not None and self.pick.placement is not None:
            self.finished = True
            self.picker.core.finish(self.pick.placement, outcome)

    # --- request ----------------------------------------------------------------------------
    async def _request_headers(self, msg: ep.HttpHeaders) -> list[ep.ProcessingResponse]:
        self.headers = {h.key.lower(): _value(h) for h in msg.headers.headers}
        # Before anything else, whatever the body mode: a request without a good key, or for a
        # path no worker may be sent, ends here.
        self.picker.authorize(self.headers.get(":method", "GET"), self.headers.get(":path", "/"),
                              self.headers)
        if self.body_mode not in _CAN_PICK and not msg.end_of_stream:
            # The upstream is chosen once the headers are answered, before the body (or the
            # body is never shown to the picker): a pick could only ignore the body (model,
            # session field, prompt) and pass its salt and kv_transfer_params on. Refused.
            mode = _MODE_NAMES.get(self.body_mode, "unknown (no protocol_config)")
            raise RouterError(f"ext_proc request_body_mode {mode} cannot carry a pick; use "
                              "FULL_DUPLEX_STREAMED or BUFFERED")
        if msg.end_of_stream:
            await self._decide()
            return [self._headers_answer()]
        if self.full_duplex:
            return []  # answered once the body is in
        return [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]

    async def _request_body(self, msg: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if len(self.body) + len(msg.body) > self.max_body_bytes:
            raise _TooLarge(f"request body exceeds {self.max_body_bytes} bytes")
        self.body += msg.body
        if not msg.end_of_stream:
            if self.full_duplex:
                return []
            # STREAMED without the end yet: let the chunk through, decide on the last one.
            return [ep.ProcessingResponse(request_body=ep.BodyResponse())]
        await self._decide()
        assert self.pick is not None
        body = self.pick.body if self.pick.body is not None else bytes(self.body)
        if self.full_duplex:
            return [self._headers_answer(len(body)), ep.ProcessingResponse(
                request_body=ep.BodyResponse(response=ep.CommonResponse(
                    body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
                        body=body, end_of_stream=True)))))]
        common = self._common(len(body))
        common.body_mutation.body = body
        return [ep.ProcessingResponse(request_body=ep.BodyResponse(response=common),
                                      dynamic_metadata=self._metadata())]

    async def _decide(self) -> None:
        self.pick = await self.picker.pick(self.headers.get(":method", "GET"),
                                           self.headers.get(":path", "/"), self.headers,
                                           bytes(self.body), self.subset)

    def _common(self, body_length: int | None = None) -> ep.CommonResponse:
        assert self.pick is not None
        mutation = ep.HeaderMutation(set_headers=[_set(DESTINATION, ",".join(
            self.pick.endpoints))], remove_headers=self._stripped())
        if body_length is not None and self.pick.body is not None:
            mutation.set_headers.append(_set("content-length", str(body_length)))
        return ep.CommonResponse(header_mutation=mutation, clear_route_cache=True)

    def _stripped(self) -> list[str]:
        """The client's headers to remove: its key, and any destination header of its own
        but the one the pick overwrites (an override host source Envoy might read)."""
        return [name for name in self.headers
                if name == _STRIPPED or (name.startswith(DESTINATION) and name != DESTINATION)]

    def _headers_answer(self, body_length: int | None = None) -> ep.ProcessingResponse:
        return ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(response=self._common(body_length)),
            dynamic_metadata=self._metadata())

    def _metadata(self) -> struct_pb2.Struct:
        assert self.pick is not None
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION: ",".join(self.pick.endpoints)}})
        return metadata

    def _read_metadata(self, request: ep.ProcessingRequest) -> None:
        hint = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
        if hint is not None and SUBSET in hint.fields:
            listed = hint.fields[SUBSET].list_value.values
            self.subset = [v.string_value for v in listed]

    # --- response ---------------------------------------------------------------------------
    async def _response_headers(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        msg = request.response_headers
        for header in msg.headers.headers:
            if header.key == ":status":
                self.status = int(_value(header) or 0)
        served = self._note_served(request)
        mutation = ep.HeaderMutation()
        pick = self.pick
        if (pick is not None and pick.placement is not None and served is None
                and 200 <= self.status < 300 and pick.placement.pending):
            # The worker accepted: a new session is bound now, as the HTTP front binds it
            # (never for a request no worker took; router-trust's bind-on-accept rule).
            _, placement = await self.picker.core.accepted(pick.placement)
            self.pick = pick = replace(pick, placement=placement)
        if pick is not None and pick.placement is not None:
            placement = pick.placement
            worker = placement.worker if served is None else served
            mutation.set_headers.extend([
                _set("x-kvkeep-worker", worker),
                _set("x-kvkeep-route", placement.label if worker == placement.worker
                     else "fallback"),
                _set("x-kvkeep-restore", "1" if placement.restore_from is not None else "0")])
            if pick.creq is not None and pick.creq.session_id is not None:
                mutation.set_headers.append(_set("x-kvkeep-session", pick.creq.session_id))
        if msg.end_of_stream:
            self.finish(Outcome(ok=200 <= self.status < 300))
        return ep.ProcessingResponse(response_headers=ep.HeadersResponse(
            response=ep.CommonResponse(header_mutation=mutation)))

    def _response_body(self, msg: ep.HttpBody) -> ep.ProcessingResponse:
        if msg.end_of_stream:
            self.finish(Outcome(ok=200 <= self.status < 300))
        if self.response_full_duplex:
            return ep.ProcessingResponse(response_body=ep.BodyResponse(
                response=ep.CommonResponse(body_mutation=ep.BodyMutation(
                    streamed_response=ep.StreamedBodyResponse(
                        body=msg.body, end_of_stream=msg.end_of_stream)))))
        return ep.ProcessingResponse(response_body=ep.BodyResponse())

    def _note_served(self, request: ep.ProcessingRequest) -> str | None:
        """The worker that served, when the data plane says and it is not the first pick."""
        served = _served(request)
        pick = self.pick
        if served is None or pick is None or pick.placement is None \
                or served == pick.endpoints[0]:
            return None
        if served not in pick.endpoints:
            # Envoy dials only the endpoints it was given: any other claim is not a fallback
            # and marks no worker failed (trust-review H5: a stream's sender could otherwise
            # take any worker out of rotation by naming another address).
            log.warning("ext_proc: served endpoint %r was not offered; ignored", served[:100])
            return None
        # Envoy fell back: the first pick failed to connect or answer.
        first = pick.placement.worker
        log.info("ext_proc: %s served instead of %s", served, first)
        self.picker.core.pool.record_failure(first, hard=True)
        self.picker.core.metrics.upstream_failures.labels(first).inc()
        self.finish(FAILED)
        return self.picker.book.worker(served) or served


def _served(request: ep.ProcessingRequest) -> str | None:
    lb = request.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if lb is not None and SERVED in lb.fields:
        return str(lb.fields[SERVED].string_value) or None
    for attributes in request.attributes.values():
        if "upstream.address" in attributes.fields:
            return str(attributes.fields["upstream.address"].string_value) or None
    return None


class _TooLarge(BadRequest):
    status = 413


def _immediate(exc: RouterError) -> ep.ProcessingResponse:
    headers = ep.HeaderMutation(set_headers=[_set("content-type", "application/json")])
    for name, value in exc.headers().items():
        headers.set_headers.append(_set(name.lower(), value))
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=exc.status), headers=headers,
        body=_DUMPS(exc.body()).encode(), details=f"kvkeep: {exc.message}"[:200]))

