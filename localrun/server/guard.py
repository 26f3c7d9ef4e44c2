"""Who may talk to the server: the Host and Origin policy, CORS, and JSON-only API bodies.

A web page the user visits can send requests to http://127.0.0.1:8080 (and, through DNS
rebinding, make its own domain resolve to 127.0.0.1). So by default, as Ollama and llama.cpp
now do:
- the `Host` header must name a loopback address (localhost, 127.x.y.z, [::1], any port) or
  one given with `--allow-host` (`*`: any). A server bound to a non-loopback address skips
  this check (it is meant to be reached by other names; its API key guards it);
- a request with an `Origin` header must be same-origin or from an origin given with
  `--allow-origin` (`*`: any). Allowed origins get CORS headers and preflight answers;
  the others get a 403 before any handler runs (a "simple" cross-origin POST would
  otherwise run even though the page cannot read the answer);
- POST bodies on the API must be JSON: another declared Content-Type (text/plain, a form) is
  a 415, which also keeps browsers from sending "simple" requests without a preflight.
"""
from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type"
PREFLIGHT_MAX_AGE_S = 600


@dataclass(frozen=True)
class AccessPolicy:
    allowed_hosts: tuple[str, ...] = ()       # beyond loopback; "*" allows any Host
    allowed_origins: tuple[str, ...] = ()     # beyond same-origin; "*" allows any Origin
    check_host: bool = True                   # False when bound to a non-loopback address

    def host_allowed(self, host: str | None) -> bool:
        if host is None or not self.check_host or "*" in self.allowed_hosts:
            return True
        name = hostname(host)
        return is_loopback_name(name) or name in {hostname(h) for h in self.allowed_hosts}

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        if "*" in self.allowed_origins or origin.rstrip("/").lower() in {
                o.rstrip("/").lower() for o in self.allowed_origins}:
            return True
        parts = urlsplit(origin)
        return (parts.scheme in ("http", "https") and host is not None
                and same_netloc(parts.netloc, host, parts.scheme))


def hostname(host: str) -> str:
    """'LocalHost:8080' -> 'localhost', '[::1]:80' -> '::1', 'localhost.' -> 'localhost'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":")[0]
    return host[:-1] if host.endswith(".") else host


def is_loopback_name(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def same_netloc(origin_netloc: str, host: str, scheme: str) -> bool:
    default = ":443" if scheme == "https" else ":80"

    def norm(netloc: str) -> str:
        netloc = netloc.lower()
        return netloc if netloc.rsplit("]", 1)[-1].count(":") else netloc + default
    return norm(origin_netloc) == norm(host)


def is_json_content_type(value: str) -> bool:
    media_type = value.split(";", 1)[0].strip().lower()
    return media_type == "application/json"


class RequestGuard:
    """ASGI middleware applying an AccessPolicy before any route sees the request."""

    def __init__(self, app, policy: AccessPolicy, api_prefix: str = "/v1/"):
        self.app, self.policy, self.api_prefix = app, policy, api_prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host, origin = headers.get("host"), headers.get("origin")
        if not self.policy.host_allowed(host):
            return await error(send, 403, f"the Host '{host[:100]}' is not allowed; start the server with "
                                          "--allow-host to accept it", "host_not_allowed")
        cors = {}
        if origin is not None:
            if not self.policy.origin_allowed(origin, host):
                return await error(send, 403, f"cross-origin requests from '{origin[:100]}' are not allowed; "
                                              "start the server with --allow-origin to accept them",
                                   "origin_not_allowed")
            cors = {"access-control-allow-origin": "*" if "*" in self.policy.allowed_origins else origin,
                    "vary": "Origin"}
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                requested = headers.get("access-control-request-headers", ALLOW_HEADERS)
                return await respond(send, 204, b"", {
                    **cors, "access-control-allow-methods": ALLOW_METHODS,
                    "access-control-allow-headers": requested,
                    "access-control-max-age": str(PREFLIGHT_MAX_AGE_S)})
        content_type = headers.get("content-type")
        if (scope["method"] == "POST" and scope["path"].startswith(self.api_prefix)
                and content_type is not None and not is_json_content_type(content_type)):
            return await error(send, 415, f"the body must be JSON (Content-Type: application/json), "
                                          f"not '{content_type[:100]}'", "unsupported_media_type", cors)
        if not cors:
            return await self.app(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  *((k.encode(), v.encode("latin-1")) for k, v in cors.items())]}
            await send(message)
        return await self.app(scope, receive, send_with_cors)


async def error(send, status: int, message: str, code: str, extra: dict | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await respond(send, status, body, {"content-type": "application/json", **(extra or {})})


async def respond(send, status: int, body: bytes, headers: dict[str, str]) -> None:
    raw = [(k.encode(), v.encode("latin-1")) for k, v in headers.items()]
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
