"""Reading and decoding a request body within stated limits, before pydantic sees it.

- size: at most `limit` bytes (413), counted as it arrives, so a lying Content-Length or a
  chunked body cannot get past it;
- time: the whole body within `timeout_s` (408), so a client that dribbles bytes cannot hold
  a connection and a buffer forever;
- nesting: at most MAX_JSON_DEPTH levels of arrays and objects (an OpenAI chat body needs 4):
  Python's C decoder stops at the interpreter's recursion limit (a RecursionError, caught),
  and a walk of the decoded value checks the stated limit;
- numbers: literals of at most MAX_NUMBER_CHARS characters (Python refuses to convert ints
  past 4,300 digits with a ValueError; nothing we accept needs more than 20); no NaN or
  Infinity, which are not JSON.
Each limit is a 4xx with one sentence naming it. Decoding runs in the server's worker
thread, never on the event loop.
"""
from __future__ import annotations

import json

import anyio
from starlette.requests import ClientDisconnect, Request

from localrun.server.protocol import APIError

MAX_JSON_DEPTH = 32
MAX_NUMBER_CHARS = 64


class ClientGone(Exception):
    """The client hung up before its body arrived: nothing to answer, one log line."""


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s",
                       code="body_timeout") from None
    except ClientDisconnect:
        raise ClientGone(f"{request.method} {request.url.path}: the client disconnected while sending "
                         "its body") from None
    return b"".join(chunks)


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes, the most this server's "
                         "context can use", code="body_too_large")


def json_depth(value, limit: int = MAX_JSON_DEPTH) -> int:
    """The nesting depth of arrays and objects in a decoded JSON value (a scalar is 0), or
    limit + 1 as soon as it is known to exceed limit. Iterative: no recursion to exhaust."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _number_hook(convert):
    def parse(text: str):
        if len(text) > MAX_NUMBER_CHARS:
            raise APIError(400, f"the body has a number of {len(text)} characters; at most "
                                f"{MAX_NUMBER_CHARS} are accepted", code="number_too_long")
        return convert(text)
    return parse


def _no_constant(name: str):
    raise APIError(400, f"the request body is not valid JSON: {name} is not a JSON value")


def decode(raw: bytes) -> dict:
    """The body as a JSON object, or an APIError (400) with one sentence."""
    too_deep = APIError(400, f"the body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
                        code="json_too_deep")
    try:
        data = json.loads(raw, parse_int=_number_hook(int), parse_float=_number_hook(float),
                          parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise too_deep from None
    except ValueError as e:      # a backstop: the number hook should catch what int() refuses
        raise APIError(400, f"the request body is not acceptable JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if json_depth(data) > MAX_JSON_DEPTH:
        raise too_deep
    return data
