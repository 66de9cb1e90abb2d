"""What the API server refused, as types: callers catch `NotFound` or `Conflict`, not a
status number compared in every module.

Every error keeps the status, the reason and the API server's own message (the one that names
the field a tenant got wrong), so a caller can pass it on unchanged.
"""

from __future__ import annotations

import json


class ApiError(Exception):
    """A request the API server answered with 4xx/5xx, or did not answer (`status` 0)."""

    status = 0

    def __init__(self, status: int, reason: str = "", body: str = "") -> None:
        self.status = status
        self.reason = reason
        self.body = body
        self.message = _message(body) or reason or f"HTTP {status}"
        super().__init__(f"{status} {reason}: {self.message}" if status else self.message)

    @staticmethod
    def of(status: int, reason: str = "", body: str = "") -> ApiError:
        """The most specific error type for `status`."""
        kind = _BY_STATUS.get(status) or (ServerError if status >= 500 else ApiError)
        return kind(status, reason, body)


class Unreachable(ApiError):
    """No answer: connection refused or reset, TLS failure, timeout."""

    def __init__(self, reason: str) -> None:
        super().__init__(0, reason)


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401


class Forbidden(ApiError):
    status = 403


class NotFound(ApiError):
    status = 404


class Conflict(ApiError):
    """409: it exists already, or it changed since the version the write named."""

    status = 409


class Gone(ApiError):
    """410: a watch asked for a version the API server no longer keeps; list again."""

    status = 410


class Invalid(ApiError):
    """422: the object breaks the schema or a validation rule (the message names the field)."""

    status = 422


class TooManyRequests(ApiError):
    status = 429


class ServerError(ApiError):
    """5xx: the API server (or what it calls, e.g. a webhook, etcd) failed; try again."""


_BY_STATUS: dict[int, type[ApiError]] = {
    400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict,
    410: Gone, 422: Invalid, 429: TooManyRequests,
}


def _message(body: str) -> str:
    """The `message` of a Kubernetes Status body, else the body itself (short)."""
    if not body:
        return ""
    try:
        decoded = json.loads(body)
    except ValueError:
        return body[:500]
    if isinstance(decoded, dict) and decoded.get("message"):
        return str(decoded["message"])
    return body[:500]
