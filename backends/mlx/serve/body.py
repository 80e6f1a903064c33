"""A request body read within limits: at most so many bytes, in so much time.

Starlette's `request.body()` reads whatever a client sends, for as long as
it takes. A body over the limit is refused by its Content-Length before a
byte is read, or (a chunked body) as soon as its count passes the limit;
a body that trickles in is cut off by a total and an idle timeout.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request


class BodyError(Exception):
    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code


async def read_body(request: Request, limit: int, timeout: float, idle: float = 10.0) -> bytes:
    """The body, or BodyError: over `limit` bytes (413, refused by its
    Content-Length before a byte is read), or slower than `timeout` seconds
    in all or `idle` without a byte (408)."""
    length = request.headers.get("content-length")  # (h11 refuses one that is not a number)
    if length is not None and int(length) > limit:
        raise BodyError(413, f"the request body is {length} bytes; this server takes at most {limit} "
                             f"(serve --max-request-bytes)", "request_too_large")
    chunks, size = [], 0
    stream = request.stream()
    try:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    chunk = await asyncio.wait_for(anext(stream), idle)
                except StopAsyncIteration:
                    break
                size += len(chunk)
                if size > limit:
                    raise BodyError(413, f"the request body is over {limit} bytes, the most this server takes "
                                         f"(serve --max-request-bytes)", "request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyError(408, "the request body came too slowly", "request_timeout") from None
    return b"".join(chunks)
