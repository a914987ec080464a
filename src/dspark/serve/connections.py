"""The HTTP connection: uvicorn's h11 protocol with a deadline for each request's head.

uvicorn closes a keep-alive connection idle between requests, but a client that sends part of a
request line or headers and stalls is held forever (any byte cancels the idle timer), so a few
hundred such sockets pin the server's connection slots (slowloris). Here every request head (the
first on a connection, and each after a response) must arrive whole within `head_timeout` seconds,
else the connection is closed. The body's deadline is the request guard's (serve/guard.py)."""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def with_head_timeout(head_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class whose connections close when a request head is late."""

    class HeadTimeoutProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()

        def connection_lost(self, exc) -> None:
            self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            if getattr(self, "_head_timer", None) is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(head_timeout, self._head_deadline)

        def _head_deadline(self) -> None:
            # their_state leaves IDLE once h11 has parsed a whole request head
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutProtocol
