"""The ASGI side of a generation response: server-sent events as the
OpenAI API streams them (``data: {json}`` events, then ``data: [DONE]``),
whole JSON bodies, and the watch for a client that goes away.

A client's disconnect is seen by reading ``receive`` until it returns
``http.disconnect``, in a task of its own (:func:`watch_disconnect`): that
works on every ASGI server and under Trio. (Starlette's
``Request.is_disconnected`` does not under Trio: it polls ``receive`` in a
cancelled scope, where Trio's channel raises before looking.)
"""

from __future__ import annotations

from collections.abc import Iterable

import anyio
import msgspec
from starlette.types import Receive, Send

#: The headers of an event stream (``x-accel-buffering``: no proxy buffering).
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
JSON_HEADERS = [(b"content-type", b"application/json")]
DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()


def encode(body: msgspec.Struct) -> bytes:
    return _encoder.encode(body)


def event(body: msgspec.Struct | bytes) -> bytes:
    """One server-sent event of a JSON body."""
    data = body if isinstance(body, bytes) else _encoder.encode(body)
    return b"data: " + data + b"\n\n"


async def send_whole(
    send: Send,
    status: int,
    body: bytes,
    headers: Iterable[tuple[bytes, bytes]] = JSON_HEADERS,
) -> None:
    """A whole response (JSON unless told otherwise)."""
    head = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def start_events(send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})


async def send_events(send: Send, data: bytes, *, last: bool = False) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": not last})


async def watch_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` once the client has gone (the request's body was
    read already: what ``receive`` returns now is its disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
