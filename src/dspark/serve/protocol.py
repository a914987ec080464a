"""The OpenAI request bodies the server accepts, validated strictly, and its error objects.

Unknown fields are refused (as OpenAI does: "Unrecognized request argument"); fields OpenAI
defines but dspark does not implement are accepted only at their neutral value, so a client never
silently gets something other than what it asked for."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

MAX_JSON_DEPTH = 32  # an OpenAI body nests 4 deep (messages[].content[].text); deeper is refused with 400

Probability = Annotated[float, Field(gt=0.0, le=1.0)]


def _only(value, kind: type):
    """A field accepted only at its neutral `value`, typed strictly (`Literal[False]` would let 0 in:
    0 == False)."""

    def check(v):
        if v != value:
            raise ValueError(f"only {json.dumps(value)} is supported")
        return v

    return Annotated[kind, AfterValidator(check), Field(json_schema_extra={"enum": [value]})]


NoPenalty = _only(0.0, float)
Off = _only(False, bool)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Sampling(_Body):
    model: str
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Probability = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1  # vLLM's extension; -1 or 0 = off
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # defined by OpenAI, not implemented here: only their neutral values are accepted
    presence_penalty: NoPenalty = 0.0
    frequency_penalty: NoPenalty = 0.0
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n = 1 is supported; send separate requests for several choices")
        return n

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, options, info: ValidationInfo):
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return options

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Off = False

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, limit, info: ValidationInfo):
        if limit is not None and info.data.get("max_tokens") is not None:
            raise ValueError("give max_completion_tokens or max_tokens, not both")
        return limit

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    echo: Off = False
    logprobs: None = None
    suffix: None = None

    @property
    def token_limit(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions


def parse_body(raw: bytes, model: type[_Body]) -> _Body:
    """The request body `raw` as `model`, or an APIError (400) that names what is wrong."""
    too_deep = APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise too_deep from None
    if _depth(data) > MAX_JSON_DEPTH:
        raise too_deep
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def _depth(value) -> int:
    """How deeply JSON `value` nests (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            if depth > MAX_JSON_DEPTH:
                break
            stack.extend((child, depth + 1) for child in children)
    return deepest


# ---- errors ---------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered as OpenAI's error object: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_NAMES = {"str", "int", "float", "bool"}


def _field(loc) -> str:
    """The user's field path of an error location, without pydantic's union-branch names
    (`str`, `list[str]`, `constrained-str`, ...)."""
    return ".".join(str(x) for x in loc if isinstance(x, int) or (x != "body" and x not in _TYPE_NAMES
                                                                  and _FIELD.fullmatch(x)))


def validation_error(errors: list[dict]) -> APIError:
    """A 400 naming the offending field of pydantic / FastAPI validation errors. Of a union's branches
    the one that got furthest tells what is wrong (`prompt.1` not an integer, `stop` a list too long)."""
    e = errors[0]
    if e.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})")
    if e.get("type") == "extra_forbidden":
        field = _field(e.get("loc", ()))
        return APIError(400, f"Unrecognized request argument supplied: {field}", field)
    top = _field(e.get("loc", ())).split(".")[0]
    branches = [x for x in errors if _field(x.get("loc", ())).split(".")[0] == top]

    def reach(x):
        return len(_field(x.get("loc", ())).split(".")), not x.get("type", "").endswith("_type")

    best = max(reach(x) for x in branches)
    chosen = [x for x in branches if reach(x) == best]
    field = _field(chosen[0].get("loc", ()))
    msgs = list(dict.fromkeys(x["msg"].removeprefix("Value error, ") for x in chosen))
    msg = msgs[0] if len(msgs) == 1 else "wrong type (" + "; ".join(msgs) + ")"
    return APIError(400, f"{field}: {msg}" if field else f"invalid request body: {msg}", field or None)
