"""The gateway's domain errors, and the one table that turns any error into an
HTTP status and an OpenAI error body.

The core raises these (or libs.common's InvalidRequestError family); only the
HTTP layer calls `to_http`.
"""

import math
from dataclasses import dataclass
from typing import Any

from libs.protocol.errors import InvalidRequestError, KVServeError


class InvalidParameterError(InvalidRequestError):
    """A request field that is missing, of the wrong type, or out of range."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotServedError(KVServeError):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist or you do not have access to it.")


class AuthenticationError(KVServeError):
    """No API key, or the wrong one."""


class PermissionDeniedError(KVServeError):
    """A known API key whose tenant may not use the cluster now (disabled in the tenants file)."""


class ServiceUnavailableError(KVServeError):
    """A role the request needs is missing or does not answer (no prefill, no decode, no conductor)."""

    def __init__(self, message: str, code: str = "service_unavailable") -> None:
        super().__init__(message)
        self.code = code


class RateLimitedError(KVServeError):
    """The conductor rejected the request: the cluster cannot meet its targets now."""

    def __init__(self, message: str, retry_after: float | None = None, details: dict[str, float] | None = None,
                 reason: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.retry_after = retry_after
        self.details = details or {}  # the conductor's predictions, added to the error body
        self.reason = reason  # the target it would miss: ttft_slo, tbt_slo, decode_full, slo_unattainable


class QuotaExceededError(RateLimitedError):
    """The tenant is over one of its quotas (reason: the quota); ``headers`` are
    OpenAI's x-ratelimit-* headers of its request and token limits."""

    def __init__(self, message: str, reason: str, retry_after: float | None, headers: dict[str, str]) -> None:
        super().__init__(message, retry_after, reason=reason)
        self.headers = headers


class BodyTooLargeError(KVServeError):
    """The request body, once decoded, is larger than the gateway accepts."""


class UnsupportedEncodingError(KVServeError):
    """The request body came in a Content-Encoding the gateway does not decode."""


class RequestTimeoutError(KVServeError):
    """No token arrived for the configured number of seconds."""


class RequestBodyTimeoutError(KVServeError):
    """The request body did not arrive in time (a slow or stalled client)."""


class UpstreamError(KVServeError):
    """A worker or the conductor failed while serving the request."""

    def __init__(self, message: str, code: str = "internal_error") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class HTTPError:
    status: int
    body: dict[str, Any]  # {"error": {...}}
    headers: dict[str, str]


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def to_http(error: Exception) -> HTTPError:
    """The status, OpenAI error body and extra headers for ``error``."""
    message = str(error)
    if isinstance(error, BodyTooLargeError):
        return HTTPError(413, error_body(message, "invalid_request_error"), {})
    if isinstance(error, UnsupportedEncodingError):
        return HTTPError(415, error_body(message, "invalid_request_error"), {})
    if isinstance(error, InvalidRequestError):
        return HTTPError(400, error_body(message, "invalid_request_error", getattr(error, "param", None)), {})
    if isinstance(error, ModelNotServedError):
        return HTTPError(404, error_body(message, "invalid_request_error", None, "model_not_found"), {})
    if isinstance(error, AuthenticationError):
        return HTTPError(401, error_body(message, "invalid_request_error", None, "invalid_api_key"), {})
    if isinstance(error, PermissionDeniedError):
        return HTTPError(403, error_body(message, "invalid_request_error", None, "tenant_disabled"), {})
    if isinstance(error, RateLimitedError):
        headers = {"Retry-After": str(max(1, math.ceil(error.retry_after)))} if error.retry_after is not None else {}
        headers.update(getattr(error, "headers", {}))  # a tenant's quota: its x-ratelimit-* headers
        # a request no wait can help (its TTFT misses the target even on an idle worker) says so as its code
        code = "slo_unattainable" if error.reason == "slo_unattainable" else "rate_limit_exceeded"
        body = error_body(message, "rate_limit_error", None, code)
        body["error"].update(error.details)
        if error.reason is not None:
            body["error"]["reason"] = error.reason
        return HTTPError(429, body, headers)
    if isinstance(error, ServiceUnavailableError):
        return HTTPError(503, error_body(message, "server_error", None, error.code), {})
    if isinstance(error, RequestBodyTimeoutError):
        return HTTPError(408, error_body(message, "invalid_request_error", None, "request_timeout"), {})
    if isinstance(error, RequestTimeoutError):
        return HTTPError(504, error_body(message, "server_error", None, "timeout"), {})
    if isinstance(error, UpstreamError):
        return HTTPError(500, error_body(message, "server_error", None, error.code), {})
    return HTTPError(500, error_body("internal server error", "server_error", None, "internal_error"), {})
