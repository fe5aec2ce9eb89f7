"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param",
"code"}}`` with the status as ``code``.

:class:`APIError` is raised by the routes and answered by the app's
handler; :func:`api_error` maps asyncstep's own errors: a request the
engine refuses (:class:`~asyncstep.errors.InvalidRequestError`) is 400, a
dead or closed engine 503. Nothing a client sends may end in a 500: that
status is left to bugs.
"""

from __future__ import annotations

from http import HTTPStatus

import msgspec

from asyncstep.errors import EngineDeadError, InvalidRequestError, describe
from asyncstep.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
)

#: OpenAI's error ``type`` of each status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error response: its status, one-line message, and (optionally)
    the request field at fault and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    kind = ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "server_error")
    info = ErrorInfo(message=message, type=kind, param=param, code=status)
    return msgspec.json.encode(ErrorResponse(error=info))


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param)


def api_error(error: BaseException) -> APIError:
    """The response for an error raised while serving a request."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        return bad_request(describe(error), param=_leading_field(str(error)))
    if isinstance(error, EngineDeadError):
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, describe(error))
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {describe(error)}")


def _leading_field(message: str) -> str | None:
    """The request field an engine message starts with (``"top_p must be
    ..."``, ``"structured_outputs.json is ..."``), if it starts with one."""
    word = message.split(" ", 1)[0].split(".", 1)[0].split("[", 1)[0]
    return word if word in _FIELDS else None


#: The request fields an engine message may name.
_FIELDS = frozenset(
    field.name
    for kind in (CompletionRequest, ChatCompletionRequest)
    for field in msgspec.structs.fields(kind)
)
