"""What the port answers while the server gets ready (the one-time SPS profile of a first start):
every request gets 503 with Retry-After and a line that says what the server is doing, instead of a
refused connection; /health says "starting". The real app takes the port over when it is ready."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import uvicorn

from dspark.serve.protocol import APIError

RETRY_AFTER_S = 10


class StartingApp:
    def __init__(self, doing: str):
        self.doing, self.since = doing, time.monotonic()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        waited = time.monotonic() - self.since
        if scope["path"] == "/health":
            body = {"status": "starting", "detail": self.doing, "seconds": round(waited)}
        else:
            body = APIError(503, f"the server is starting ({self.doing}, {waited:.0f} s so far); retry in "
                            f"{RETRY_AFTER_S} s", code="server_starting", type="server_error").body()
        raw = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
            (b"retry-after", str(RETRY_AFTER_S).encode())]})
        await send({"type": "http.response.body", "body": raw})


@contextlib.contextmanager
def answering_meanwhile(host: str, port: int, doing: str):
    """Serve StartingApp on host:port for the duration of the block."""
    server = uvicorn.Server(uvicorn.Config(StartingApp(doing), host=host, port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, name="dspark-starting", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(10)
