"""Who may talk to the server: the Host and Origin policy, CORS, and JSON-only API bodies.

A web page the user visits can send requests to http://127.0.0.1:8080 (and, through DNS
rebinding, make its own domain resolve to 127.0.0.1). So by default, as Ollama and llama.cpp
now do:
- the `Host` header must be one host and an optional port, nothing else (RFC 9112's
  `uri-host [":" port]`, the host a DNS name or an IP address: `parse_host`), sent once. It
  must name a loopback address (localhost, 127.x.y.z, [::1], any port) or one given with
  `--allow-host` (`*`: any). A server bound to a non-loopback address skips the name check
  (it is meant to be reached by other names; its API key guards it), not the form check;
- a request with an `Origin` header must be same-origin (the server's own scheme, which is
  http: it does not terminate TLS, and the Host's name and port) or from an origin given
  with `--allow-origin` (`*`: any). Allowed origins get CORS headers and preflight answers;
  the others get a 403 before any handler runs (a "simple" cross-origin POST would
  otherwise run even though the page cannot read the answer);
- POST bodies on the API must be JSON: another declared Content-Type (text/plain, a form) is
  a 415, which also keeps browsers from sending "simple" requests without a preflight.

The API key itself is checked by the app (`Server.check_auth`); which keys can work at all is
`api_key_problem`'s rule, applied at start.
"""
from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type"
PREFLIGHT_MAX_AGE_S = 600
DEFAULT_PORTS = {"http": 80, "https": 443}
MAX_API_KEY_BYTES = 4096      # with "Authorization: Bearer ", well inside an HTTP server's header limit

# RFC 9112's Host: uri-host [":" port], the host an IP literal ("[::1]") or a name of DNS
# characters (an IPv4 address is one of those, told apart by ipaddress).
HOST_HEADER = re.compile(r"(?:\[(?P<ip_literal>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._-]+))(?::(?P<port>[0-9]*))?")
DNS_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")


@dataclass(frozen=True)
class AccessPolicy:
    allowed_hosts: tuple[str, ...] = ()       # beyond loopback; "*" allows any Host
    allowed_origins: tuple[str, ...] = ()     # beyond same-origin; "*" allows any Origin
    check_host: bool = True                   # False when bound to a non-loopback address
    scheme: str = "http"                      # the server's own: same-origin means this scheme

    def host_allowed(self, host: str | None) -> bool:
        if host is None:                      # HTTP/1.0 sends none: no name a page could have chosen
            return True
        parsed = parse_host(host)
        if parsed is None:
            return False
        if not self.check_host or "*" in self.allowed_hosts:
            return True
        name = parsed[0]
        return is_loopback_name(name) or name in {hostname(h) for h in self.allowed_hosts}

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        if "*" in self.allowed_origins or origin.rstrip("/").lower() in {
                o.rstrip("/").lower() for o in self.allowed_origins}:
            return True
        return host is not None and same_origin(origin, host, self.scheme)


def parse_host(host: str) -> tuple[str, int | None] | None:
    """A Host header (or an origin's host part) as (name, port): the name lower-case, without a
    final dot, an IPv6 address without its brackets; None if it is anything but one host and an
    optional port ('localhost:80@evil.com', '[::1]evil.com', 'a:1:2', 'a b', 'a/x')."""
    match = HOST_HEADER.fullmatch(host)
    if match is None:
        return None
    port = match["port"]
    if port is not None and port != "" and (len(port) > 5 or int(port) > 65535):
        return None
    port_number = int(port) if port else None
    if match["ip_literal"] is not None:
        try:
            return str(ipaddress.IPv6Address(match["ip_literal"])), port_number
        except ValueError:
            return None
    name = match["name"].lower()
    name = name[:-1] if name.endswith(".") else name
    if len(name) > 253 or not all(DNS_LABEL.fullmatch(label) for label in name.split(".")):
        return None
    return name, port_number


def hostname(host: str) -> str:
    """'LocalHost:8080' -> 'localhost', '[::1]:80' -> '::1', 'localhost.' -> 'localhost'; a
    string that is not a host (parse_host) stays as it is, lower-case, and so matches no host."""
    parsed = parse_host(host)
    return parsed[0] if parsed is not None else host.lower()


def is_loopback_name(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def same_origin(origin: str, host: str, scheme: str) -> bool:
    """Whether origin is exactly `scheme://host` (default ports filled in, names compared as
    parse_host gives them): the page was served by this server."""
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    if parts.scheme != scheme or not parts.netloc or parts.path or parts.query or parts.fragment \
            or "?" in origin or "#" in origin:
        return False
    theirs, ours = parse_host(parts.netloc), parse_host(host)
    if theirs is None or ours is None:
        return False
    default = DEFAULT_PORTS.get(scheme)
    return (theirs[0], theirs[1] or default) == (ours[0], ours[1] or default)


def api_key_problem(key: str) -> str | None:
    """Why key cannot work as an API key, as a sentence's end ('must not ...'), or None. A
    client sends it as `Authorization: Bearer KEY` and the server compares the header's bytes
    with the key's UTF-8: an empty key would let every request in; HTTP strips spaces and tabs
    around a header's value, so a key with whitespace at either end could never match; control
    characters cannot travel in a header at all, nor a key past the servers' header limits."""
    if not key.strip():
        return "must not be empty or only whitespace (such a key would let every request in)"
    if key != key.strip():
        return ("must not start or end with whitespace (HTTP strips it from the header, so no request "
                "could match the key)")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        return "must not contain control characters (they cannot travel in an HTTP header)"
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return "must be valid text (the key is compared as UTF-8)"
    if size > MAX_API_KEY_BYTES:
        return f"must be at most {MAX_API_KEY_BYTES} bytes (a longer header is refused by HTTP servers)"
    return None


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
        headers, repeated = {}, set()
        for k, v in scope["headers"]:
            name = k.decode("latin-1").lower()
            if name in headers:
                repeated.add(name)
            headers[name] = v.decode("latin-1")
        host, origin = headers.get("host"), headers.get("origin")
        if "host" in repeated or "origin" in repeated:      # which one would a handler read?
            name = "Host" if "host" in repeated else "Origin"
            return await error(send, 403, f"the request has more than one {name} header", "host_not_allowed"
                               if name == "Host" else "origin_not_allowed")
        if host is not None and parse_host(host) is None:
            return await error(send, 403, f"the Host header '{host[:100]}' is not one host name and an optional "
                                          "port", "host_not_allowed")
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
