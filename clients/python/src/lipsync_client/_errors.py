"""The errors the client raises: one class per kind of refusal, all `LipsyncError`s."""

from __future__ import annotations

import json
from typing import Any


class LipsyncError(Exception):
    """An error answered by the server (or a stream it cut short).

    Attributes:
        status: the HTTP status (for a live session's error message, the status the same
            refusal has over HTTP: 400, 404, 429, 503; None when there is none).
        error_type: the server's stable snake_case name (`no_face`, `overloaded`, ...).
        message: the server's explanation, for people.
        retry_after: seconds to wait before trying again (`Retry-After`), when given.
        close_code: the WebSocket close code of a live session's error, else None.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        error_type: str = "error",
        retry_after: float | None = None,
        close_code: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.retry_after = retry_after
        self.close_code = close_code

    def __str__(self) -> str:
        where = f"{self.status} " if self.status is not None else ""
        return f"{where}{self.error_type}: {self.message}"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(status={self.status!r}, error_type={self.error_type!r}, "
            f"message={self.message!r}, retry_after={self.retry_after!r})"
        )


class BadRequest(LipsyncError):
    """400, 413, 415 or 422: a bad field, media too large, not media, no face, ..."""


class Unauthorized(LipsyncError):
    """401: the API key is missing or wrong."""


class NotFound(LipsyncError):
    """404: an unknown (or evicted) avatar, an unknown job."""


class Overloaded(LipsyncError):
    """429: too much work, too many streams, jobs or sessions; see `retry_after`."""


class Unavailable(LipsyncError):
    """503: the model is loading or warming up, or the server is shutting down."""


_BY_STATUS: dict[int, type[LipsyncError]] = {
    400: BadRequest,
    413: BadRequest,
    415: BadRequest,
    422: BadRequest,
    401: Unauthorized,
    404: NotFound,
    429: Overloaded,
    503: Unavailable,
}


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None  # an HTTP date: lipsync always sends seconds


def from_response(status: int, body: bytes, headers: Any) -> LipsyncError:
    """The error of an HTTP response whose status is 400 or more."""
    error_type, message = "http_error", ""
    try:
        doc = json.loads(body)
        if isinstance(doc, dict):
            error_type = str(doc.get("error_type") or error_type)
            message = str(doc.get("error") or "")
    except ValueError:
        message = body[:500].decode("utf-8", "replace")
    if not message:
        message = f"HTTP {status}"
    cls = _BY_STATUS.get(status, LipsyncError)
    return cls(
        message,
        status=status,
        error_type=error_type,
        retry_after=_retry_after(headers.get("retry-after") if headers is not None else None),
    )


# A live session's `{"type": "error"}` message: its HTTP equivalent by error_type.
_LIVE_STATUS: dict[str, int] = {
    "avatar_not_found": 404,
    "overloaded": 429,
    "over_capacity": 429,
    "not_ready": 503,
    "shutting_down": 503,
}


def from_live_message(msg: dict[str, Any], close_code: int | None = None) -> LipsyncError:
    """The error of a live session's error message (`{"type": "error", "error",
    "error_type"}`)."""
    error_type = str(msg.get("error_type") or "error")
    message = str(msg.get("error") or error_type)
    status = _LIVE_STATUS.get(error_type)
    if status is None and error_type.startswith("bad_"):
        status = 400
    cls = _BY_STATUS.get(status, LipsyncError) if status is not None else LipsyncError
    retry = msg.get("retry_after")
    return cls(
        message,
        status=status,
        error_type=error_type,
        retry_after=float(retry) if isinstance(retry, (int, float)) else None,
        close_code=close_code,
    )
