"""`dspark serve` against hostile and broken clients, as real server processes on loopback: the API
key, bodies over the limit, deep JSON, stalled connections, and a request that fails in the engine
while others run beside it."""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from serving import WINDOW, Server, chat, open_stream, openai

KEY = "sk-test-0123456789"
LIMIT = 1 << 20


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def raw_exchange(server: Server, head: bytes, body_chunks=(), timeout: float = 30) -> bytes:
    """Send a raw request (its body in chunks, stopping when the server stops reading); return what
    the server answers until it closes the connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(head)
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it answered and closed: what it said is still in our receive buffer
        out = b""
        try:
            while data := sock.recv(65536):
                out += data
        except ConnectionResetError:
            pass
        return out


@pytest.fixture(scope="module")
def guarded(tiny_dirs):
    model_dir, _ = tiny_dirs
    server = Server("--model", str(model_dir), "--drafter", "none", "--dtype", "float32", "--max-batch", "2",
                    "--max-model-len", str(WINDOW), "--served-model-name", "tiny", "--read-timeout", "1",
                    "--max-request-bytes", str(LIMIT), env={**os.environ, "DSPARK_API_KEY": KEY})
    yield server
    assert server.stop() == 0


def test_api_key_guards_v1_and_leaves_probes_open(guarded):
    body = chat("hi", max_tokens=3)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, reply, got = guarded.post("/v1/chat/completions", body, headers)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key", reply
        assert got["www-authenticate"] == "Bearer"
    assert guarded.get("/v1/models")[0] == 401
    status, reply, _ = guarded.post("/v1/chat/completions", body, {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and reply["usage"]["completion_tokens"] == 3
    assert guarded.get("/health")[0] == 200 and guarded.get("/metrics")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        guarded.client().models.list()
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0)
    assert client.models.list().data[0].id == "tiny"


def test_bodies_over_the_limit_get_413_unread(guarded):
    """200 MB offered, declared or chunked: 413 as soon as the headers or the bytes read pass the
    limit, and the server's memory does not grow by the limit (measured after a first round, which
    warms the allocator and the code paths)."""
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    declared = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 200000000\r\n\r\n"
    chunked = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Transfer-Encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n%s\r\n" % (1 << 16, b"[" * (1 << 16))
    before = None
    for _ in range(4):
        reply = raw_exchange(guarded, declared, (b"x" * (1 << 20) for _ in range(200)))
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b'"request_too_large"' in reply
        reply = raw_exchange(guarded, chunked, (chunk for _ in range(3200)))
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        before = before or rss_kib(guarded.proc.pid)
    grown = rss_kib(guarded.proc.pid) - before
    assert grown * 1024 < LIMIT, f"RSS grew by {grown} KiB"
    assert guarded.get("/health")[0] == 200


def test_deep_or_malformed_json_gets_400_never_500(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    for raw in ("[" * 100_000 + "]" * 100_000, '{"model": ' + "[" * 40 + "]" * 40 + "}", "{" * 50_000, "\ud800"):
        status, reply, _ = guarded.post("/v1/chat/completions", raw.encode("utf-8", "surrogatepass"), auth)
        assert status == 400 and reply["error"]["type"] == "invalid_request_error", (raw[:20], reply)
    status, reply, _ = guarded.post("/v1/chat/completions", "[" * 100_000 + "]" * 100_000, auth)
    assert "nests deeper" in reply["error"]["message"]


def test_stalled_connections_are_closed(guarded):
    started = time.monotonic()
    stalled = []
    for _ in range(50):  # half a request line and header, then nothing
        sock = socket.create_connection(("127.0.0.1", guarded.port), timeout=10)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        stalled.append(sock)
    assert guarded.get("/health")[0] == 200  # served meanwhile
    for sock in stalled:
        assert sock.recv(100) == b""  # closed by the server
        sock.close()
    assert time.monotonic() - started < 5  # --read-timeout 1
    # a body that stops arriving: 408
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Length: 100\r\n\r\n{\"model\"").encode()
    reply = raw_exchange(guarded, head)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_a_request_failing_in_the_engine_leaves_the_others_exact(tiny_dirs):
    """A fault injected into one request's token handling (tests/fault_server.py) fails that request
    with an OpenAI-shaped 500, whole or streamed; the requests decoding beside it finish exactly as
    they do alone, and the server stays healthy."""
    from fault_server import FAULT_MARK

    model_dir, drafter_dir = tiny_dirs
    server = Server("--model", str(model_dir), "--drafter", str(drafter_dir), "--policy", "full", "--dtype",
                    "float32", "--max-batch", "4", "--max-model-len", str(WINDOW), "--served-model-name", "tiny",
                    program=(str(Path(__file__).with_name("fault_server.py")),))
    try:
        client = server.client().with_options(timeout=60)
        bodies = [chat(f"Question {i}", max_tokens=40, temperature=0 if i % 2 else 1.0, seed=i) for i in range(3)]

        def text(body):
            return client.chat.completions.create(**body).choices[0].message.content

        alone = [text(b) for b in bodies]
        faulty = chat(f"{FAULT_MARK} now", max_tokens=40, temperature=0)
        with ThreadPoolExecutor(4) as pool:
            crowd = [pool.submit(text, b) for b in bodies]
            status, reply, _ = server.post("/v1/chat/completions", faulty)
            sock, reader = open_stream(server, faulty)
            events = []
            while (e := reader.next_event()) != "[DONE]" and "error" not in e:
                events.append(e)
            sock.close()
            assert [c.result() for c in crowd] == alone
        assert status == 500 and reply["error"]["type"] == "server_error" and "injected fault" in \
            reply["error"]["message"], reply
        assert e["error"]["type"] == "server_error"
        assert server.get("/health")[0] == 200
        assert text(bodies[0]) == alone[0]
        m = server.wait_idle()
        assert m[("dspark:request_success_total", (("finished_reason", "error"),))] == 2
        assert m[("dspark:kv_cache_usage_perc", ())] == 0
    finally:
        assert server.stop() == 0


def test_fuzzing_the_published_schema_finds_nothing(tiny_dirs):
    """Schemathesis against GET /openapi.json, every check but positive-data acceptance (a prompt's
    tokens plus its limit must fit the window, which no schema says), response time held to the request
    timeout (a speed depends on the machine and its load: benchmarks measure it), on a 256-token window:
    no 5xx, every response (status, content type, body, SSE events) as documented, no traceback logged."""
    import subprocess
    import sys

    server = Server("--model", str(tiny_dirs[0]), "--drafter", str(tiny_dirs[1]), "--policy", "full", "--dtype",
                    "float32", "--max-batch", "4", "--max-model-len", "256", "--served-model-name", "tiny",
                    "--api-key", KEY)
    try:
        done = subprocess.run([Path(sys.executable).with_name("schemathesis"), "run", f"{server.url}/openapi.json",
                               "--checks", "all", "--exclude-checks", "positive_data_acceptance",
                               "--max-response-time", "60", "--max-examples",
                               "25", "--seed", "48", "--workers", "2", "--request-timeout", "60", "-H",
                               f"Authorization: Bearer {KEY}"], capture_output=True, text=True, timeout=600)
        server.log.seek(0)
        log = server.log.read()
    finally:
        assert server.stop() == 0
    assert done.returncode == 0, done.stdout[-4000:]
    assert "passed" in done.stdout and "Traceback" not in log


def test_serve_bounds_the_kernel_caches_unless_the_user_sets_them(monkeypatch):
    """oneDNN / ideep cache a primitive per shape; a server's shapes vary with its batch, so `dspark serve`
    caps both caches (RSS grew for minutes at their default 1,024 entries) and keeps a user's own value."""
    from dspark.cli.serve import KERNEL_CACHE_ENTRIES, bound_kernel_caches

    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    bound_kernel_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == str(KERNEL_CACHE_ENTRIES) and KERNEL_CACHE_ENTRIES < 1024
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"
