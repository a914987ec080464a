"""`dspark serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys

from dspark.cli.common import POLICIES, non_negative_int, open_target, positive_int, target_args
from dspark.errors import DsparkError

BYTES_PER_TOKEN = 256  # --max-request-bytes default per token of the window: text at ~4 bytes a token, escaped
PREFIX_CACHE_MIB = 256  # --prefix-cache-mib default (here, not in decode/prefix_cache.py: the CLI loads without torch)


def add_parsers(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server on the batched speculative engine",
        description="Serve the target over an OpenAI-compatible API: POST /v1/chat/completions and "
        "/v1/completions (streaming with `stream: true`), GET /v1/models, /health and /metrics (Prometheus). "
        "Requests join and leave one continuous batch of --max-batch rows between engine steps; the drafter "
        "drafts for all of them at once and --policy chooses how many drafts of each row the target verifies. "
        "Output is distributed exactly as the target's own sampling (token-identical at temperature 0). "
        "Stop with Ctrl-C or SIGTERM: in-flight requests get --shutdown-timeout seconds to finish.",
    )
    target_args(s, threads=True)
    s.add_argument("--drafter", default="auto",
                   help="auto | none | prompt-lookup | PATH to a drafter checkpoint (auto and PATH optionally "
                   "+lookup: prompt-lookup branches in its token trees), each optionally @POLICY (the same as "
                   "--policy POLICY); default auto: the DSpark drafter dspark ships for the target with prompt-lookup "
                   "branches under the tree policy (auto+lookup@tree, as in `dspark generate`), else prompt-lookup")
    s.add_argument("--policy", default=None, metavar="POLICY",
                   help=f"verification policy: {POLICIES} (auto's default tree, a PATH's dspark: both read the "
                   "target's SPS curve, measured once per machine and cached)")
    s.add_argument("--max-batch", type=positive_int, default=8, help="requests decoded together (default 8)")
    s.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context window per request, prompt + completion (default: the model's, at most 4096); "
                   "the KV cache for --max-batch such windows is allocated at start")
    s.add_argument("--max-waiting", type=positive_int, default=64,
                   help="requests that may wait for a free row; beyond it the server answers 429 (default 64)")
    s.add_argument("--prefix-cache-mib", type=non_negative_int, default=PREFIX_CACHE_MIB, metavar="MIB",
                   help="memory for the K/V of prompt prefixes already prefilled, in blocks of 16 tokens: a prompt "
                   "that begins as an earlier one did (a shared system prompt, a conversation's earlier turns) "
                   "prefills only the rest, with the same output; least recently used blocks go first "
                   f"(default {PREFIX_CACHE_MIB}; 0 turns it off; vLLM's automatic prefix caching)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model directory's name, or smollm2)")
    s.add_argument("--api-key", default=os.environ.get("DSPARK_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every /v1 route (401 otherwise); /health and /metrics "
                   "stay open. Default: $DSPARK_API_KEY, else no key")
    s.add_argument("--max-request-bytes", type=positive_int, default=None,
                   help=f"largest request body accepted; larger ones get 413 before they are read (default "
                   f"{BYTES_PER_TOKEN} bytes per token of the context window: 1 MiB for 4096 tokens)")
    s.add_argument("--read-timeout", type=float, default=20.0,
                   help="seconds a client has to send a request's head, and then its body; a stalled head closes the "
                   "connection, a stalled body gets 408 (default 20)")
    s.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection is held between requests (default 5)")
    s.add_argument("--max-connections", type=positive_int, default=512,
                   help="open connections and requests in progress at most; beyond it requests get 503 (default 512)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on shutdown before they are cancelled (default 30)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level (default info)")
    s.set_defaults(func=cmd_serve)


def _check_port(host: str, port: int) -> None:
    """Fail before loading the model when the address cannot be bound."""
    if not 0 <= port <= 65535:
        raise DsparkError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise DsparkError(f"--host {host!r} does not resolve: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
        except OSError as e:
            hint = "pick another with --port" if e.errno == errno.EADDRINUSE else "check --host / --port"
            raise DsparkError(f"cannot listen on {host}:{port}: {e.strerror}; {hint}") from None


def _profile_apart(args, max_tokens: int, policy: str) -> None:
    """Profile the SPS curve once with `dspark profile` in a process of its own: after forwards of
    hundreds of distinct sizes a process decodes ~10% slower (benchmarks/results/README.md, server),
    which the server would otherwise carry until restarted. Meanwhile the port answers 503 with
    Retry-After (serve/warming.py). If the profile fails, the server measures itself."""
    import subprocess
    import tempfile
    import time

    from dspark.serve.warming import answering_meanwhile

    print(f"[dspark] first start with this target on this machine: measuring its verify cost curve SPS(1..{max_tokens}) "
          f"for the {policy} policy, once (cached for later starts; --policy full or ar skip it). "
          "Until it is done, requests get 503 with Retry-After.", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "dspark.cli", "profile", "--max-tokens", str(max_tokens), "--dtype", args.dtype]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--threads", str(args.threads)] if args.threads else []
    t0 = time.monotonic()
    with answering_meanwhile(args.host, args.port, "profiling this machine's verify cost curve, once"), \
            tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(cmd + ["--plot", f"{tmp}/sps.png"], check=False, stdout=subprocess.DEVNULL)
    if done.returncode != 0:
        print("[dspark] the separate profile failed; measuring in this process", file=sys.stderr)
    else:
        print(f"[dspark] profiled in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)


def run_beside(server, service) -> None:
    """uvicorn in a thread, the engine loop in this one (the thread that loaded the model, see
    serve/service.py). SIGTERM / Ctrl-C start uvicorn's graceful shutdown (a second Ctrl-C forces
    it); its lifespan end stops the engine loop."""
    import threading

    def on_signal(signum, frame):
        if server.should_exit and signum == signal.SIGINT:
            server.force_exit = True
        server.should_exit = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    http = threading.Thread(target=server.run, name="dspark-http")
    http.start()
    service.run(keep_going=http.is_alive)  # the HTTP thread dies if uvicorn cannot start
    http.join()
    if not server.started:
        raise DsparkError("the HTTP server did not start (see the log above)")


KERNEL_CACHE_ENTRIES = 64  # compiled oneDNN / ideep primitives kept per cache (their default: 1,024 each)


def bound_kernel_caches() -> None:
    """Cap the per-shape primitive caches of oneDNN and ideep (PyTorch's CPU linears) unless the user
    set them: a server's shapes change with its batch (rows x verify lengths, catch-up lengths), and
    at 1,024 entries each the caches grow for minutes (in-process engine, 16 rows, mixed requests:
    RSS 1,548 -> 1,918 MiB over 6 batches and still rising; at 64: 1,280 -> 1,369, flat from the
    4th). Read at the first primitive, so this runs before the model loads."""
    for var in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(var, str(KERNEL_CACHE_ENTRIES))


def cmd_serve(args) -> int:
    from pathlib import Path

    import uvicorn

    from dspark.decode.engine import check_batch
    from dspark.decode.speculation import (
        check_drafter_spec,
        engine_curve_tokens,
        engine_factory,
        limited_policy,
        resolve_drafter_spec,
        split_spec,
        with_policy,
    )
    from dspark.model.loading import DEFAULT_MODEL, parse_dtype
    from dspark.schedule.sps import cached_sps, load_or_measure
    from dspark.serve.connections import with_head_timeout
    from dspark.serve.metrics import ServerMetrics
    from dspark.serve.server import Access, ServerInfo, create_app
    from dspark.serve.service import EngineService

    # validate everything cheap before loading the model
    requested = with_policy(args.drafter, args.policy)
    check_drafter_spec(requested)
    parse_dtype(args.dtype)
    for flag in ("shutdown_timeout", "read_timeout", "keep_alive_timeout"):
        if not getattr(args, flag) >= 0:
            raise DsparkError(f"--{flag.replace('_', '-')} must be >= 0 seconds, got {getattr(args, flag)}")
    if args.api_key is not None and not args.api_key.strip():
        raise DsparkError("--api-key (or DSPARK_API_KEY) is empty; give a key or leave it unset")
    _check_port(args.host, args.port)

    bound_kernel_caches()
    target = open_target(args)
    check_batch(target, args.max_batch)  # before any profiling
    spec, policy = split_spec(resolve_drafter_spec(requested, target), default="dspark")
    if args.max_model_len and args.max_model_len > target.model.max_positions:
        raise DsparkError(f"--max-model-len {args.max_model_len} exceeds the model's {target.model.max_positions} "
                          "positions")
    max_len = min(args.max_model_len or 4096, target.model.max_positions)
    make_engine, drafter_label, max_drafts = engine_factory(target, spec, max_len, args.prefix_cache_mib << 20)
    policy_name = policy if drafter_label != "none" else "ar"
    sps = None
    sps_tokens = engine_curve_tokens(policy_name, args.max_batch, max_drafts)
    if sps_tokens is not None:
        if cached_sps(target, sps_tokens) is None:
            _profile_apart(args, sps_tokens, policy_name)
        sps, _, measured = load_or_measure(target, max_tokens=sps_tokens)
        if measured:
            print(f"[dspark] profiled SPS(1..{sps.max_tokens}) of this target in this process; cached for later "
                  "starts", file=sys.stderr)
    engine = make_engine(limited_policy(target, policy_name, sps, max_drafts), args.max_batch)
    name = args.served_model_name or (Path(args.model).name.removesuffix(".gguf") if args.model else DEFAULT_MODEL)
    metrics = ServerMetrics(name, engine.drafter.max_drafts if engine.drafter else 0)
    if sps is not None:
        metrics.set_sps(engine.policy.sps.values)  # the curve the policy reads (cut at an int8 target's verify limit)
    service = EngineService(engine, metrics, args.max_waiting)
    info = ServerInfo(name, drafter_label, policy_name)
    access = Access(args.api_key, args.max_request_bytes or BYTES_PER_TOKEN * engine.max_len, args.read_timeout)
    app = create_app(target, service, info, access)
    print(f"[dspark] serving {name!r} on http://{args.host}:{args.port}/v1 — drafter {drafter_label}, policy "
          f"{policy_name}, {args.max_batch} rows x {engine.max_len} tokens, "
          f"{target.model.precision}{', API key required' if args.api_key else ''}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            http=with_head_timeout(args.read_timeout), timeout_keep_alive=args.keep_alive_timeout,
                            limit_concurrency=args.max_connections, timeout_graceful_shutdown=args.shutdown_timeout)
    run_beside(uvicorn.Server(config), service)
    return 0
