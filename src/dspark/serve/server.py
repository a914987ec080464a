"""`dspark serve`: an OpenAI-compatible HTTP API (FastAPI + uvicorn) on the batched engine.

POST /v1/chat/completions and /v1/completions (streaming as server-sent events, or whole), GET
/v1/models, /health and /metrics (Prometheus). Each response carries the speculative-decoding stats
of its request in a `dspark` field."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from dspark.decode import engine as engine_mod
from dspark.decode.streaming import TextStreamer
from dspark.errors import DsparkError
from dspark.model.target import Target
from dspark.sampling import SamplingParams
from dspark.serve.guard import RequestGuard
from dspark.serve.openapi import ERROR, completion_route, install_schema
from dspark.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body
from dspark.serve.service import EngineFailed, EngineService, Job, QueueFull

POLL_S = 0.25  # how often a handler waiting for tokens checks whether its client is still there


@dataclasses.dataclass
class ServerInfo:
    model_name: str
    drafter: str
    policy: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


class ClientGone(Exception):
    pass


class _Api:
    """What the completion routes share: parsing a request body, and running one request on the engine."""

    def __init__(self, target: Target, service: EngineService, info: ServerInfo):
        self.target, self.service, self.info = target, service, info

    async def parse(self, http: Request, model):
        body = parse_body(await http.body(), model)
        if body.model != self.info.model_name:
            raise APIError(400, f"model: the model {body.model!r} does not exist; this server serves "
                           f"{self.info.model_name!r} (GET /v1/models)", "model", "model_not_found")
        return body

    async def generate(self, http: Request, body, prompt_ids: list[int], prompt_field: str, limit_field: str,
                       chat: bool):
        n, window = len(prompt_ids), self.service.engine.max_len
        if n > self.service.engine.max_prompt_len:
            raise APIError(400, f"{prompt_field}: the prompt has {n} tokens; this model's context window is "
                           f"{window} tokens (at most {self.service.engine.max_prompt_len} for the prompt)", prompt_field,
                           "context_length_exceeded")
        limit = body.token_limit if body.token_limit is not None else window - n
        if n + limit > window:
            raise APIError(400, f"{limit_field}: {limit} completion tokens plus the prompt's {n} exceed this model's "
                           f"context window of {window} tokens (at most {window - n})", limit_field,
                           "context_length_exceeded")
        params = SamplingParams(body.temperature, max(body.top_k, 0), body.top_p)  # ranges checked by the protocol
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        request = engine_mod.Request(prompt_ids, limit, params, seed=body.seed, stop=body.stop_strings, id=rid)
        try:
            job = self.service.submit(request)
        except QueueFull as e:
            raise APIError(429, str(e), code="rate_limit_exceeded", type="rate_limit_error",
                           headers={"Retry-After": "1"}) from None
        except EngineFailed as e:
            raise APIError(503, str(e), type="server_error") from None
        reply = _Reply(rid, chat, self.info, self.target, body, request)
        if body.stream:
            return _CancellingStream(reply.sse(_events(job, http)), lambda: self.service.cancel(job))
        try:
            async for _ in _events(job, http):
                pass
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the request is cancelled below
        except DsparkError as e:
            raise APIError(500, str(e), type="server_error") from None
        finally:
            self.service.cancel(job)
        return reply.whole()


@dataclasses.dataclass(frozen=True)
class Access:
    """Who may call the server and how much a request may bring (serve/guard.py)."""

    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    read_timeout: float = 20.0


def create_app(target: Target, service: EngineService, info: ServerInfo, access: Access = Access()) -> FastAPI:
    api = _Api(target, service, info)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        service.stop()  # uvicorn has finished (or timed out) the in-flight requests: end the engine loop

    app = FastAPI(title="dspark", version="0.1.0", lifespan=lifespan)
    app.add_middleware(RequestGuard, api_key=access.api_key, max_body_bytes=access.max_body_bytes,
                       read_timeout=access.read_timeout)
    install_schema(app, info.model_name, service.engine.max_len)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):  # unknown route, wrong method: OpenAI's shape too
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code,
                            headers=e.headers)  # 405 names the allowed methods

    @app.get("/health", responses={503: {"description": "the engine is not running",
                                         "content": {"application/json": {"schema": ERROR}}}})
    async def health():
        if not service.alive:
            raise APIError(503, f"the engine is not running: {service.error or 'shutting down'}", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}}})
    async def metrics():
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses={401: {"description": "no or a wrong API key",
                                            "content": {"application/json": {"schema": ERROR}}}})
    async def models():
        return {"object": "list", "data": [{"id": info.model_name, "object": "model", "created": info.created,
                                            "owned_by": "dspark", "root": str(target.path),
                                            "max_model_len": service.engine.max_len}]}

    @app.post("/v1/chat/completions", **completion_route(ChatCompletionRequest))
    async def chat_completions(http: Request):
        body = await api.parse(http, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt_ids = target.encode_chat(messages)
        except DsparkError as e:
            raise APIError(400, str(e), "messages") from None
        limit_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return await api.generate(http, body, prompt_ids, "messages", limit_field, chat=True)

    @app.post("/v1/completions", **completion_route(CompletionRequest))
    async def completions(http: Request):
        body = await api.parse(http, CompletionRequest)
        if isinstance(body.prompt, str):
            prompt_ids = target.tokenizer.encode(body.prompt, add_special_tokens=True)
        else:
            try:
                target.check_token_ids(body.prompt, "prompt: token ids")
            except DsparkError as e:
                raise APIError(400, str(e), "prompt") from None
            prompt_ids = list(body.prompt)
        return await api.generate(http, body, prompt_ids, "prompt", "max_tokens", chat=False)

    return app


async def _events(job: Job, http: Request):
    """The job's token-id lists as they come; raises ClientGone when the client disconnects (checked
    every POLL_S, tokens flowing or not)."""
    next_check = time.monotonic() + POLL_S
    while True:
        try:
            event = await asyncio.wait_for(job.events.get(), POLL_S)
        except TimeoutError:
            event = ...
        if time.monotonic() >= next_check:
            if await http.is_disconnected():
                raise ClientGone()
            next_check = time.monotonic() + POLL_S
        if event is ...:
            continue
        if event is None:
            return
        if isinstance(event, Exception):
            raise event
        yield event


class _CancellingStream(StreamingResponse):
    """An SSE response whose request is cancelled however the stream ends (a client that goes away
    mid-stream ends it with a failed send)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Reply:
    """The response objects of one request, in OpenAI's chat.completion / text_completion shapes."""

    def __init__(self, rid: str, chat: bool, info: ServerInfo, target: Target, body, request):
        self.rid, self.chat, self.info, self.target, self.body, self.request = rid, chat, info, target, body, request
        self.created = int(time.time())

    def _envelope(self, choices: list, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.info.model_name,
                "choices": choices}

    def _choice(self, text: str | None, finish_reason: str | None, delta: dict | None = None) -> dict:
        if self.chat:
            content = {"delta": delta} if delta is not None else {"message": {"role": "assistant", "content": text}}
            return {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def usage(self) -> dict:
        n, m = len(self.request.prompt_ids), len(self.request.token_ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m,
                "prompt_tokens_details": {"cached_tokens": self.request.cached_tokens}}

    def spec_stats(self) -> dict:
        r = self.request
        rounds, drafts = len(r.rounds), sum(x.verified for x in r.rounds)
        accepted = sum(x.accepted for x in r.rounds)
        return {"drafter": self.info.drafter, "policy": self.info.policy, "rounds": rounds,
                "tau": (len(r.token_ids) - 1) / rounds if rounds else 0.0,
                "draft_tokens": drafts, "accepted_tokens": accepted,
                "acceptance_rate": accepted / drafts if drafts else None}

    def whole(self) -> dict:
        r = self.request
        return {**self._envelope([self._choice(r.text, r.finish_reason)], chunk=False), "usage": self.usage(),
                "dspark": self.spec_stats()}

    async def sse(self, events):
        """Server-sent events: text deltas, a last chunk with the finish reason and the stats, a usage
        chunk when asked (`stream_options.include_usage`), then [DONE]."""
        usage = {"usage": None} if self.body.include_usage else {}

        def event(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

        def text_chunk(text: str) -> str:
            choice = self._choice(None, None, {"content": text}) if self.chat else self._choice(text, None)
            return event({**self._envelope([choice], chunk=True), **usage})

        if self.chat:
            yield event({**self._envelope([self._choice(None, None, {"role": "assistant", "content": ""})], True),
                         **usage})
        deltas: list[str] = []
        streamer = TextStreamer(self.target.decode, deltas.append, self.request.stop)
        try:
            async for ids in events:
                streamer.push(ids)
                if deltas:
                    yield text_chunk("".join(deltas))
                    deltas.clear()
        except ClientGone:
            return
        except DsparkError as e:
            yield event(APIError(500, str(e), type="server_error").body())
            return
        r = self.request
        streamer.finish(r.text)
        if deltas:
            yield text_chunk("".join(deltas))
        last = self._choice(None, r.finish_reason, {}) if self.chat else self._choice("", r.finish_reason)
        yield event({**self._envelope([last], chunk=True), **usage, "dspark": self.spec_stats()})
        if self.body.include_usage:
            yield event({**self._envelope([], chunk=True), "usage": self.usage()})
        yield "data: [DONE]\n\n"
