"""The OpenAI API's request bodies as pydantic models (as vLLM declares them).

A model checks JSON types and the wire's ranges; the limits proper (temperature, max_tokens
against the context, logprobs...) are kvmesh.params', checked by the router for every entry
point. `parse` turns the first validation error into a 400 naming the field as the client wrote
it (`messages[0].content`) and what it must be. Unknown fields are ignored, as OpenAI's API and
vLLM do; fields OpenAI has and kvmesh cannot honour are refused by name.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from kvmesh.params import MAX_CHOICES, MAX_LOGPROBS

UINT32_MAX = 2**32 - 1


class SchemaError(ValueError):
    """A body that does not fit its schema; `param` names the field as the client wrote it."""

    def __init__(self, param: str | None, message: str):
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number, got {_shown(value)}")
    return float(value)


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX
                                           for t in value)


def _prompts(value: Any) -> list[str | list[int]]:
    """A string, a list of token ids, or a list of either: always a list of prompts."""
    if isinstance(value, str) or (_token_ids(value) and value and not isinstance(value[0], list)):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, str) or (_token_ids(p)) for p in value):
        return value
    raise ValueError("must be a string, a list of token ids, or a non-empty list of those")


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("must be a string or a list of strings")


def _logit_bias(value: Any) -> dict[int, float] | None:
    """{"token id": bias}; JSON keys are strings, so ids come as decimal strings."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be an object mapping token ids to biases")
    bias = {}
    for key, v in value.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) <= UINT32_MAX):
            raise ValueError(f"keys must be token ids, got {_shown(key)}")
        bias[int(key)] = _number(v)
    return bias


def _content(value: Any) -> str | None:
    """A message's content: a string, or a list of text parts (joined)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                       for p in value):
        return "".join(p["text"] for p in value)
    raise ValueError('must be a string or a list of text parts ({"type": "text", "text": ...})')


def _format_type(value: Any) -> str:
    if value in ("text", "json_object", "json_schema"):
        return value
    raise ValueError(f"must be text, json_object or json_schema, got {_shown(value)}")


Number = Annotated[float, BeforeValidator(_number)]
Uint32 = Annotated[StrictInt, Field(ge=0, le=UINT32_MAX)]
Int32 = Annotated[StrictInt, Field(ge=-2**31, le=2**31 - 1)]
Choices = Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)]
TopLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema is enforced whether or not `strict` is set, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict = Field(alias="schema")  # `schema` would shadow BaseModel's
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: text (free), json_object (any JSON object) or json_schema (kvmesh.params.StructuredOutput)."""

    model_config = ConfigDict(extra="ignore")

    type: Annotated[str, BeforeValidator(_format_type)]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(BaseModel):
    """What both endpoints take: the model, sampling, stopping, streaming."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Int32 | None = None
    repetition_penalty: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=2**64 - 1)] | None = None
    logit_bias: Annotated[dict[int, float] | None, BeforeValidator(_logit_bias)] = None
    stop: Annotated[list[str], BeforeValidator(_stops)] = []
    ignore_eos: StrictBool = False
    n: Choices = 1
    priority: Int32 | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stream_interval: Annotated[StrictInt, Field(ge=1, le=UINT32_MAX)] | None = None  # vLLM's: tokens per chunk
    response_format: ResponseFormat | None = None
    # OpenAI's, not kvmesh's: refused by name when set.
    tools: Any = None
    functions: Any = None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: Annotated[list[str | list[int]], BeforeValidator(_prompts)]
    max_tokens: Uint32 | None = None
    echo: StrictBool = False
    logprobs: TopLogprobs | None = None
    best_of: Choices | None = None
    suffix: StrictStr | None = None


class ChatMessage(BaseModel):
    """One message: `role`, text `content`; other fields (name, tool_call_id...) go to the template."""

    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: Annotated[str | None, BeforeValidator(_content)] = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Uint32 | None = None
    max_completion_tokens: Uint32 | None = None
    logprobs: StrictBool = False
    top_logprobs: TopLogprobs | None = None


Request = TypeVar("Request", bound=BaseModel)


def parse(schema: type[Request], body: dict) -> Request:
    """`body` as `schema`; SchemaError naming the first field that does not fit, and why."""
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        raise SchemaError(_param(error["loc"]), _why(error)) from None


def _param(loc: tuple) -> str | None:
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    return param or None


def _why(error: dict) -> str:
    if error["type"] == "missing":
        return "is required"
    message = error["msg"].removeprefix("Value error, ")
    message = message.replace("Input should be", "must be").replace("List should have", "must have")
    message = re.sub(r" or instance of \w+", "", message)  # a nested model's class name means nothing to a client
    if error["type"] != "value_error":  # our own messages say what they got
        message += f", got {_shown(error.get('input'))}"
    return message
