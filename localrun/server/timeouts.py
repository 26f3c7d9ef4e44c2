"""Slow clients cannot hold a connection forever: uvicorn's settings, plus a header timeout.

- idle keep-alive connections close after KEEP_ALIVE_S (uvicorn's timeout_keep_alive);
- request headers are at most MAX_HEADER_BYTES (h11's max_incomplete_event_size; past it
  the client gets a 400);
- request headers must be complete within HEADER_TIMEOUT_S of the connection opening or of the
  previous response (uvicorn has no such timer: a slowloris client sending a header line every
  few seconds would otherwise keep its connection open forever). `HeaderTimeoutProtocol` adds
  it to uvicorn's h11 protocol;
- the body must arrive within ServerConfig.body_timeout_s (json_body.read_body, a 408).
"""
from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("localrun.server")

KEEP_ALIVE_S = 5.0
HEADER_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 16 * 1024


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose request headers do not complete in time."""

    header_timeout_s = HEADER_TIMEOUT_S
    header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:     # the request line and headers are in
            self.disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.arm_header_timer()     # the next request's headers (keep-alive closes an idle one)

    def connection_lost(self, exc) -> None:
        self.disarm_header_timer()
        super().connection_lost(exc)

    def arm_header_timer(self) -> None:
        self.disarm_header_timer()
        self.header_timer = asyncio.get_running_loop().call_later(self.header_timeout_s, self.on_header_timeout)

    def disarm_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def on_header_timeout(self) -> None:
        self.header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("closed a connection whose request headers took over %g s", self.header_timeout_s)
            self.transport.close()


def uvicorn_options(header_timeout_s: float = HEADER_TIMEOUT_S, keep_alive_s: float = KEEP_ALIVE_S) -> dict:
    """uvicorn.Config keywords for the limits above."""
    protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})
    return {"http": protocol, "timeout_keep_alive": keep_alive_s,
            "h11_max_incomplete_event_size": MAX_HEADER_BYTES}
