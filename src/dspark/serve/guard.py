"""What a request must pass before a route sees it: the API key, a bounded body, a read deadline.

An ASGI middleware in front of the app (as vLLM's `--api-key` and llama-server's limits):
  - with an API key, every /v1 route needs `Authorization: Bearer KEY` (401 otherwise); /health and
    /metrics stay open, so probes and scrapers need no secret (as vLLM);
  - a body longer than `max_body_bytes` is refused with 413 before it is buffered: at once when its
    Content-Length says so, else as soon as the bytes read pass the limit (chunked uploads);
  - a body that does not arrive within `read_timeout` seconds gets 408 (a client dribbling bytes
    cannot hold a handler).
Errors are OpenAI's error objects. The body read here is handed to the app whole."""

from __future__ import annotations

import asyncio
import hmac
import json

from dspark.serve.protocol import APIError


class RequestGuard:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, read_timeout: float):
        self.app, self.max_body_bytes, self.read_timeout = app, max_body_bytes, read_timeout
        self._key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # names are lower-case in ASGI
        if self._key is not None and scope["path"].startswith("/v1") and not hmac.compare_digest(
                headers.get(b"authorization", b""), self._key):
            error = APIError(401, "Incorrect or missing API key: send it as `Authorization: Bearer KEY` (the "
                             "server's --api-key)", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await _answer(send, error)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await _answer(send, self._too_large(int(declared)))
        try:
            body = await asyncio.wait_for(self._read(receive), self.read_timeout)
        except TimeoutError:
            return await _answer(send, APIError(408, f"the request body did not arrive within {self.read_timeout:g} "
                                                     "seconds", code="request_timeout"))
        if body is None:
            return  # the client went away while sending
        if isinstance(body, int):
            return await _answer(send, self._too_large(body, partial=True))
        return await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive) -> bytes | int | None:
        """The whole body; or, once it passes the limit, the bytes read so far (no exception: its
        traceback would keep the chunks alive); None when the client went away."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return size
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, size: int, partial: bool = False) -> APIError:
        seen = f"more than {size - 1}" if partial else str(size)
        return APIError(413, f"the request body has {seen} bytes; this server accepts at most {self.max_body_bytes} "
                        "(its --max-request-bytes)", code="request_too_large")


def _replay(body: bytes, receive):
    """A receive that hands the app the body read already, then passes through (disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _answer(send, error: APIError) -> None:
    """An error response that also closes the connection: the body may be left unread."""
    raw = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
               (b"connection", b"close")]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})
