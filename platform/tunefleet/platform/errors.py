"""Domain errors. Each carries the HTTP status, OpenAI error type, code and the bad param.

The API maps them to ``{"error": {"message", "type", "param", "code"}}`` in one handler;
messages quote the bad value and say what to do instead.
"""

from __future__ import annotations


class TuneFleetError(Exception):
    status_code = 500
    error_type = "server_error"
    default_code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code


class InvalidRequest(TuneFleetError):
    status_code = 400
    error_type = "invalid_request_error"
    default_code = "invalid_request"


class InvalidFile(InvalidRequest):
    default_code = "invalid_file"


class Unauthenticated(TuneFleetError):
    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class Forbidden(TuneFleetError):
    status_code = 403
    error_type = "permission_error"
    default_code = "forbidden"


class NotFound(TuneFleetError):
    status_code = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class Conflict(TuneFleetError):
    status_code = 409
    error_type = "invalid_request_error"
    default_code = "conflict"


class PayloadTooLarge(TuneFleetError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "file_too_large"


class QuotaExceeded(TuneFleetError):
    status_code = 429
    error_type = "rate_limit_error"
    default_code = "quota_exceeded"


class RateLimited(TuneFleetError):
    """Over a rate or concurrency limit: 429 with ``Retry-After``, in the shape OpenAI
    answers its rate limits with (type ``requests``, code ``rate_limit_exceeded``). Unlike
    a quota, waiting helps, so clients may retry after ``retry_after_s``."""

    status_code = 429
    error_type = "requests"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float, param: str | None = None):
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s


class Unavailable(TuneFleetError):
    status_code = 503
    error_type = "server_error"
    default_code = "unavailable"
