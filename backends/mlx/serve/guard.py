"""Who may use the server: checks on a request's headers, before any route runs.

The server listens on 127.0.0.1 by default, but any web page the user opens
can send requests there, and a DNS name the attacker controls can be made to
resolve to 127.0.0.1 (DNS rebinding). So, in this order:

- `Host` must name the server: the address it was told to bind, localhost or
  a loopback address (any IP address when it binds all of them), or a name of
  `allowed_hosts` ("*": any). A rebinding page's requests carry its own name.
- `Origin`, which browsers send on cross-site requests, must be one of
  `allowed_origins` (none by default: CORS is off, and a browser's preflight
  gets no permission). Clients that are not browsers send no Origin.
- `/v1` routes need `Authorization: Bearer KEY` when the server has a key;
  `/health` stays open.
- A POST body must be `application/json`: a page can send a text/plain POST
  without a preflight, never a JSON one.

Each refusal is OpenAI's error body.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

from starlette.responses import JSONResponse

LOOPBACK = ("localhost", "127.0.0.1", "::1")
WILDCARD = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class AccessPolicy:
    bind_host: str = "127.0.0.1"
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    def host_allowed(self, header: str) -> bool:
        name = _host_name(header)
        if "*" in self.allowed_hosts or name in self.allowed_hosts:
            return True
        if name in LOOPBACK or name == self.bind_host.strip("[]").lower():
            return True
        return self.bind_host in WILDCARD and _is_ip(name)

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin.lower() in self.allowed_origins


def _host_name(header: str) -> str:
    """`Host`'s name without its port: example.com:8080 -> example.com, [::1]:80 -> ::1."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def refusal(status: int, message: str, code: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status)


class Guard:
    """ASGI middleware that applies an AccessPolicy to every HTTP request."""

    def __init__(self, app, policy: AccessPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refused = self.check(scope)
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope) -> JSONResponse | None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        policy = self.policy
        host = headers.get("host", "")
        if not policy.host_allowed(host):
            return refusal(400, f"this server does not answer to the host {host!r} (serve --allowed-hosts)",
                           "invalid_host")
        origin = headers.get("origin")
        if origin is not None and not policy.origin_allowed(origin):
            return refusal(403, f"requests from the web origin {origin!r} are not allowed (serve --allowed-origins)",
                           "origin_not_allowed")
        if scope["method"] == "OPTIONS":  # a preflight: CORS answers it (or nothing allows it)
            return None
        if policy.api_key is not None and scope["path"].startswith("/v1"):
            scheme, _, key = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), policy.api_key.encode()):
                return refusal(401, "a valid API key is needed: the header Authorization: Bearer KEY",
                               "invalid_api_key")
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").partition(";")[0].strip().lower()
            if kind != "application/json":
                return refusal(415, f"the request body must be application/json, got {kind or 'no Content-Type'!r}",
                               "unsupported_media_type")
        return None
