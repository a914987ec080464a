"""The OpenAPI document the server publishes (GET /openapi.json), completed with what FastAPI cannot
see: the routes parse their bodies themselves (for OpenAI-shaped errors), so their request schemas,
the served model's name and every error they answer are added here. Clients and fuzzers
(benchmarks/fuzz_server.py) read it."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from dspark.serve.protocol import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"
ERROR = {"$ref": "#/components/schemas/Error"}
ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
COMPLETION_SCHEMA = {
    "type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
        "model": {"type": "string"}, "choices": {"type": "array", "items": {"type": "object"}},
        "usage": {"type": "object"}, "dspark": {"type": "object"}}}
EVENT_SCHEMA = {  # one server-sent event: `data:` a completion chunk as JSON, or [DONE]
    "type": "object", "required": ["data"], "properties": {
        "data": {"type": "string", "contentMediaType": "application/json"}, "event": {"type": "string"}}}
ERRORS = {
    "400": "the body is not a valid request (the error names the field)",
    "401": "the server has an API key and the request did not bring it",
    "408": "the body did not arrive within the server's read timeout",
    "413": "the body is larger than the server's --max-request-bytes",
    "429": "the server's queue is full; retry after Retry-After seconds",
    "500": "the request failed in the engine (other requests are unaffected)",
    "503": "the engine is not running, or the server is at its connection limit",
}


def completion_route(request: type[BaseModel]) -> dict:
    """FastAPI route arguments that document a completion route taking `request`."""
    responses = {code: {"description": text, "content": {"application/json": {"schema": ERROR}}}
                 for code, text in ERRORS.items()}
    responses["200"] = {"description": "the completion whole (JSON), or streamed as server-sent events",
                        "content": {"application/json": {"schema": COMPLETION_SCHEMA},
                                    "text/event-stream": {"schema": EVENT_SCHEMA}}}
    body = {"required": True, "content": {"application/json": {"schema": {"$ref": REF.format(model=request.__name__)}}}}
    return {"openapi_extra": {"requestBody": body, "responses": responses}}


def install_schema(app: FastAPI, model_name: str, window: int) -> None:
    """Make `app.openapi()` publish the request bodies, with `model` fixed to the served name and the
    token limits to the context window. What a schema cannot say (the prompt's tokens plus the limit
    within the window, one of max_tokens / max_completion_tokens) is checked by the routes (400)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components["Error"] = ERROR_SCHEMA
            for model in (ChatCompletionRequest, CompletionRequest):
                body = model.model_json_schema(ref_template=REF)
                components.update(body.pop("$defs", {}))
                fields = body["properties"]
                fields["model"] = {"type": "string", "enum": [model_name]}
                fields["n"] = {"type": "integer", "enum": [1], "default": 1}
                for limit in ("max_tokens", "max_completion_tokens"):
                    if limit in fields:
                        fields[limit]["anyOf"][0]["maximum"] = window
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
