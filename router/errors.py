"""Router errors: one branch of kvkeep's exception tree, each mapped to an OpenAI-style reply.

Every error a client can cause or suffer carries its HTTP status and OpenAI error `type`, so the
proxy renders all of them the same way at one boundary. Errors that never reach a client
(state backend trouble during a background rebind) derive from `RouterError` too, so callers can
catch the family.
"""

from __future__ import annotations

from typing import ClassVar

from kvstore.errors import KVKeepError

__all__ = [
    "RouterError",
    "BadRequest",
    "InvalidSessionId",
    "PayloadTooLarge",
    "Unauthorized",
    "Forbidden",
    "NotFound",
    "ModelNotFound",
    "SessionNotFound",
    "MethodNotAllowed",
    "Saturated",
    "TooManySessions",
    "NoHealthyWorker",
    "UpstreamError",
    "UpstreamTooLarge",
    "StateUnavailable",
    "HistoryUnavailable",
    "ContinuationUnsupported",
]


class RouterError(KVKeepError):
    """Root of the router's errors; `status` and `error_type` decide the HTTP reply."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    param: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, object]:
        """The OpenAI error object: `{"error": {"message", "type", "param", "code"}}`."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }

    def headers(self) -> dict[str, str]:
        return {}


class BadRequest(RouterError):
    """Malformed JSON, a body that is not an object, a missing or ill-typed field."""

    status = 400
    error_type = "invalid_request_error"


class InvalidSessionId(BadRequest):
    """A session id (header or body) outside kvkeep's session-id charset or length."""


class PayloadTooLarge(RouterError):
    status = 413
    error_type = "invalid_request_error"


class Unauthorized(RouterError):
    status = 401
    error_type = "authentication_error"


class Forbidden(RouterError):
    """A valid key that may not do this (an operator endpoint asked with a tenant's key)."""

    status = 403
    error_type = "permission_error"


class NotFound(RouterError):
    status = 404
    error_type = "not_found_error"


class ModelNotFound(NotFound):
    """No registered worker serves the requested model."""


class SessionNotFound(NotFound):
    """The session id belongs to another tenant: to this one it does not exist."""


class MethodNotAllowed(RouterError):
    status = 405
    error_type = "invalid_request_error"


class Saturated(RouterError):
    """Every worker that could serve the request is saturated; the client should retry later."""

    status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = max(1, retry_after_s)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class TooManySessions(Saturated):
    """A new session would pass the tenant's or the router's session limit. Retrying soon
    rarely helps: sessions end by expiring (the session TTL) or by being reused."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after_s=30)


class NoHealthyWorker(RouterError):
    """No live worker serves the model (all dead, draining or failing)."""

    status = 503
    error_type = "service_unavailable"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class UpstreamError(RouterError):
    """Every worker the request was tried on failed before answering."""

    status = 502
    error_type = "upstream_error"


class UpstreamTooLarge(UpstreamError):
    """A worker sent more than the router takes (a body, one SSE event, a stream's tokens):
    that worker has failed the request (`router/limits.py`)."""


class StateUnavailable(RouterError):
    """The state backend (etcd) cannot be reached; the router keeps routing from its cache."""

    status = 503
    error_type = "service_unavailable"


class HistoryUnavailable(RouterError):
    """A stateful continuation whose session history the store does not hold (never recorded,
    expired, lost, or the store unreachable): the client must resend the whole history."""

    status = 409
    error_type = "history_unavailable"


class ContinuationUnsupported(RouterError):
    """Stateful continuation is off on this router, or the model's chat template cannot render
    a turn as a continuation: the client must send the whole history."""

    status = 501
    error_type = "not_implemented_error"
