"""A `dspark serve` process on 127.0.0.1 and raw-socket clients for it, shared by the server tests."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

openai = pytest.importorskip("openai")

VOCAB = 49152  # SmolLM2's: the tiny model then speaks through SmolLM2's real tokenizer and chat template
WINDOW = 4096


# ---- a server process ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`dspark serve ARGS` (or `PROGRAM serve ARGS`, a script that wraps the CLI) on a free port, up."""

    def __init__(self, *args: str, name: str = "tiny", program: tuple[str, ...] = ("-m", "dspark.cli"),
                 env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a server that logs much never blocks
        self.proc = subprocess.Popen([sys.executable, *program, "serve", "--port", str(self.port), "--log-level",
                                      "warning", *args], stdout=subprocess.DEVNULL, stderr=self.log, env=env)
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise AssertionError(f"server exited with {self.proc.returncode}: {self.log.read()}")
            try:
                if self.get("/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.2)

    def client(self):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=300)

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)

    def get(self, path: str, headers: dict | None = None) -> tuple[int, str]:
        c = self.connection()
        c.request("GET", path, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read().decode()

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict, dict]:
        c = self.connection()
        raw = body if isinstance(body, (str, bytes)) else json.dumps(body)
        c.request("POST", path, raw, {"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.getheaders()}

    def metrics(self) -> dict[tuple, float]:
        """{(sample name, sorted labels without model_name): value}."""
        status, text = self.get("/metrics")
        assert status == 200
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict:
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if m[("dspark:num_requests_running", ())] == 0 and m[("dspark:num_requests_waiting", ())] == 0:
                return m
            assert time.time() < deadline, f"requests still held: {m}"
            time.sleep(0.1)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            self.log.close()


def open_stream(server: Server, body: dict) -> tuple[socket.socket, "SSEReader"]:
    """A raw streaming request: (socket, reader of its events)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    raw = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
    return sock, SSEReader(sock)


class SSEReader:
    def __init__(self, sock):
        self.file = sock.makefile("rb")
        status = self.file.readline()
        assert b" 200 " in status, status
        while self.file.readline() not in (b"\r\n", b""):
            pass

    def next_event(self) -> dict | str:
        while True:
            line = self.file.readline()
            assert line, "stream ended"
            line = line.strip()
            if line.startswith(b"data: "):
                data = line[6:].decode()
                return data if data == "[DONE]" else json.loads(data)


def chat(content: str, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **kw}
