"""uvicorn's h11 protocol with the server's limits below the application.

Slow headers: uvicorn closes an idle keep-alive connection, but a connection
that trickles its headers a byte at a time is held for as long as the client
likes (uvicorn 0.54 has no header timeout): 200 such connections would hold
200 sockets forever. This protocol gives each request's headers `seconds`
from the moment the server waits for them (a new connection, or the end of
the previous response); the body's time is the route's (body.py).

Malformed requests (a broken request line, headers over h11's 16 KiB) get
OpenAI's JSON error body, as everything else the server answers, instead of
uvicorn's plain text.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def limited_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, with a deadline on every request's headers
    and JSON for the requests it cannot parse."""

    class LimitedProtocol(H11Protocol):
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()  # before: a pipelined request may start inside
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            body = json.dumps({"error": {"message": f"the HTTP request is not valid: {msg}",
                                         "type": "invalid_request_error", "param": None,
                                         "code": "invalid_http_request"}}).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return LimitedProtocol
