"""The OpenAI-compatible HTTP API on the router: `POST /v1/completions`, `POST /v1/chat/completions`,
`GET /v1/models` and `GET /v1/models/{model}`.

Each request becomes one GenerateRequest for `RouterService.generate`, which validates it (the
limits live in `kvmesh.params`, not here). This module checks only JSON types and what OpenAI's API
has and kvmesh does not (`n` > 1, `echo`, top logprobs, tools...), so such a request gets a 400
rather than a silently different answer. Chat messages go through the checkpoint's chat template
with the generation prompt added.

Answers have OpenAI's shapes; with `"stream": true` they are server-sent events (`data: {json}`)
ending in `data: [DONE]`, plus a usage chunk with empty choices when
`stream_options.include_usage` is set. Errors have OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: 400 bad input (`param` names the field), 401
missing or wrong API key, 404 unknown model, 413 a body over max_request_bytes, 415 a body that is
not `Content-Type: application/json` (so a browser page cannot post one cross-site as a form or
text/plain), 429 (with Retry-After and retry-after-ms) when the API key is over one of its limits
or the pool is overloaded (its queue is full, or could not start the request within the scheduler's
max_queue_wait_s), 503 nothing ready. JSON nested deeper than
MAX_JSON_DEPTH is a 400, as is a prompt over max_prompt_chars (checked before tokenizing, which
runs off the event loop).
An error after a stream has started is one `data: {"error": ...}` event, then `[DONE]`. A traced
request's trace id comes back as the `kvmesh-trace-id` header. A client that leaves cancels its
request upstream at once (the app runs with aiohttp's handler cancellation), which frees its KV pages.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field

import grpc
from aiohttp import web

from kvmesh import telemetry
from kvmesh.params import InvalidRequest
from kvmesh.services.router.server import RouterError
from kvmesh.v1 import generation_pb2 as gen

UINT32_MAX = 2**32 - 1
# OpenAI bodies nest a few levels (messages -> content parts -> fields); far deeper is an attack
# on whatever walks the value (json.dumps of it in an error message would hit the recursion limit).
MAX_JSON_DEPTH = 32

# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code); anything else is a 500.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
}
_FINISH_REASONS = {gen.LENGTH: "length", gen.STOP: "stop", gen.EOS: "stop"}
# Parameters kvmesh cannot honour; a request that sets one gets a 400 naming it.
_UNSUPPORTED = ("echo", "suffix", "logit_bias", "tools", "functions")
_STRUCTURED_RENAMES = {"structured_output": "response_format",
                       "structured_output.json_schema": "response_format.json_schema.schema"}


class ApiError(Exception):
    """An error answered in OpenAI's shape with an HTTP status (and extra headers, e.g. Retry-After)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str]) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers={**headers, **self.headers})


def bad_request(param: str, message: str) -> ApiError:
    """A 400 whose message starts with the field, as kvmesh.params' messages do."""
    return ApiError(400, f"{param}: {message}", param=param)


def api_error(e: RouterError, renames: dict[str, str]) -> ApiError:
    """The OpenAI error for a router error. `renames` maps kvmesh field names (`max_new_tokens`)
    to the request's own (`max_tokens`), so a 400 names the field the client sent."""
    status, type_, code = _HTTP_STATUS.get(e.code, (500, "server_error", None))
    param, message, headers = None, e.message, {}
    if e.code == grpc.StatusCode.INVALID_ARGUMENT:
        param, message = _renamed(e.message, renames)
    elif e.code == grpc.StatusCode.NOT_FOUND:
        param = "model"
    elif e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        headers = _retry_after(e.trailing)
    return ApiError(status, message, type_, param, code, headers)


def _renamed(message: str, renames: dict[str, str]) -> tuple[str | None, str]:
    field_name, sep, rule = message.partition(": ")
    if not sep:
        return None, message
    if renames:
        words = re.compile(r"\b(" + "|".join(map(re.escape, renames)) + r")\b")
        rule = words.sub(lambda m: renames[m.group(1)], rule)
    param = renames.get(field_name, field_name)
    return param, f"{param}: {rule}"


def _retry_after(trailing) -> dict[str, str]:
    try:
        ms = float(dict(trailing).get("retry-after-ms", ""))
    except (TypeError, ValueError):
        return {}
    # The openai client reads retry-after-ms first; Retry-After (whole seconds) is the standard one.
    return {"retry-after-ms": str(int(ms)), "Retry-After": str(max(1, math.ceil(ms / 1000)))}


class _Fields:
    """A JSON object read field by field: a wrong type is a 400 naming the field; null is absent."""

    def __init__(self, body: dict, prefix: str = ""):
        self.body, self.prefix = body, prefix

    def get(self, name: str, kinds: tuple, what: str, required: bool = False):
        value = self.body.get(name)
        if value is None:
            if required:
                raise bad_request(self.prefix + name, "is required")
            return None
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise bad_request(self.prefix + name, f"must be {what}, got {json.dumps(value)[:40]}")
        return value

    def string(self, name: str, required: bool = False) -> str | None:
        return self.get(name, (str,), "a string", required)

    def number(self, name: str) -> float | None:
        return self.get(name, (int, float), "a number")

    def flag(self, name: str) -> bool:
        return bool(self.get(name, (bool,), "true or false"))

    def integer(self, name: str, low: int = 0, high: int = UINT32_MAX) -> int | None:
        """An integer in the wire type's range [low, high] (the limits proper are kvmesh.params')."""
        value = self.get(name, (int,), "an integer")
        if value is not None and not low <= value <= high:
            raise bad_request(self.prefix + name, f"must be an integer in [{low}, {high}], got {value}")
        return value

    def nested(self, name: str) -> _Fields:
        return _Fields(self.get(name, (dict,), "an object") or {}, f"{self.prefix}{name}.")


@dataclass
class _Call:
    """One OpenAI request, translated: what to ask the router and how to answer."""

    request: gen.GenerateRequest
    stream: bool
    include_usage: bool
    logprobs: bool
    renames: dict[str, str]  # kvmesh field -> the request's parameter, for 400 messages
    created: int = field(default_factory=lambda: int(time.time()))


class _TextCompletion:
    """The shapes of /v1/completions answers."""

    id_prefix, object, chunk_object = "cmpl-", "text_completion", "text_completion"

    @staticmethod
    def choice(text: str, logprobs: dict | None, reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}

    delta = choice

    @staticmethod
    def opening() -> dict | None:
        return None

    @staticmethod
    def logprobs(tokens, offset: int) -> dict:
        """`tokens` are the text each token released; `text_offset` counts from the completion's start."""
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t.text)
        return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": None, "text_offset": offsets}


class _ChatCompletion:
    """The shapes of /v1/chat/completions answers."""

    id_prefix, object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def choice(text: str, logprobs: dict | None, reason: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": reason}

    @staticmethod
    def delta(text: str, logprobs: dict | None, reason: str | None) -> dict:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": logprobs, "finish_reason": reason}

    @staticmethod
    def opening() -> dict | None:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    @staticmethod
    def logprobs(tokens, offset: int) -> dict:
        return {"content": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode()), "top_logprobs": []}
                            for t in tokens]}


def add_routes(app: web.Application, service) -> None:
    """Adds the /v1 routes to the router's aiohttp app."""
    api = OpenAIApi(service)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model:.+}", api.model)  # a folder path holds slashes


class OpenAIApi:
    """The /v1 handlers over one RouterService (see the module docstring for the contract)."""

    def __init__(self, service):
        self.service = service
        self.created = int(time.time())

    async def completions(self, http: web.Request) -> web.StreamResponse:
        """`prompt` is a string, a list of token ids, or a list holding one of those."""
        return await self._serve(http, _TextCompletion, self._completion_call)

    async def chat_completions(self, http: web.Request) -> web.StreamResponse:
        """`messages` (text content only) are rendered with the chat template; without `max_tokens`
        or `max_completion_tokens` the completion may fill the rest of the context."""
        return await self._serve(http, _ChatCompletion, self._chat_call)

    async def models(self, http: web.Request) -> web.Response:
        """The model pools that have a ready worker, one card per name each answers to (as the gRPC ListModels)."""
        try:
            self._key(http)
        except RouterError as e:
            return api_error(e, {}).response({})
        data = [self._model_card(p, name) for p in self.service.pools.values() if p.ready for name in (p.name, *p.aliases)]
        return web.json_response({"object": "list", "data": data})

    async def model(self, http: web.Request) -> web.Response:
        """A served model's card; 404 for any other name."""
        try:
            self._key(http)
            pool = self.service.pool_for(http.match_info["model"])
        except RouterError as e:
            return api_error(e, {}).response({})
        return web.json_response(self._model_card(pool, http.match_info["model"]))

    def _model_card(self, pool, name: str) -> dict:
        """The card of one name `pool` answers to (its own, or an alias: `root` is the pool)."""
        return {"id": name, "object": "model", "created": self.created, "owned_by": "kvmesh", "root": pool.name,
                "max_model_len": pool.model.max_position_embeddings}

    def _key(self, http: web.Request):
        """The caller's API key limits (None when keys are off); RouterError(UNAUTHENTICATED) when wrong."""
        return self.service.check_api_key(http.headers.get("Authorization"))

    async def _serve(self, http: web.Request, shape, translate) -> web.StreamResponse:
        span = self.service.open_span([(key.lower(), value) for key, value in http.headers.items()])
        trace_id = telemetry.trace_id_hex(span)
        headers = {"kvmesh-trace-id": trace_id} if trace_id else {}
        try:
            key = self._key(http)
            call = await translate(_Fields(await _json_object(http, self.service.cfg.max_request_bytes)))
            return await self._run(http, shape, call, span, headers, key)
        except ApiError as e:
            return e.response(headers)
        except RouterError as e:  # a wrong API key; an unknown model while translating a chat request
            return api_error(e, {}).response(headers)
        except InvalidRequest as e:  # a chat message the tokenizer refuses (a role, the size)
            return ApiError(400, str(e), param=e.field).response(headers)
        finally:
            span.end()

    async def _run(self, http, shape, call: _Call, span, headers: dict[str, str], key) -> web.StreamResponse:
        stream = self.service.generate(call.request, None, span, key)
        try:
            if call.stream:
                return await self._stream(http, shape, call, stream, headers)
            return await self._complete(shape, call, stream, headers)
        except RouterError as e:
            return api_error(e, call.renames).response(headers)
        finally:
            await stream.aclose()  # at once: cancels the request upstream if it is still running

    def _head(self, shape, call: _Call, chunk: bool) -> dict:
        return {"id": shape.id_prefix + call.request.request_id,
                "object": shape.chunk_object if chunk else shape.object,
                "created": call.created, "model": call.request.model or self.service.default_pool}

    async def _complete(self, shape, call: _Call, stream, headers: dict[str, str]) -> web.Response:
        tokens, finish = [], None
        async for out in stream:
            tokens.extend(out.tokens)
            if out.HasField("finish"):
                finish = out.finish
        reason = _finish_reason(finish)
        logprobs = shape.logprobs(tokens, 0) if call.logprobs else None
        choice = shape.choice("".join(t.text for t in tokens), logprobs, reason)
        body = {**self._head(shape, call, chunk=False), "choices": [choice], "usage": _usage(finish)}
        return web.json_response(body, headers=headers)

    async def _stream(self, http, shape, call: _Call, stream, headers: dict[str, str]) -> web.StreamResponse:
        first = await anext(stream, None)  # an error before any output is a plain HTTP error
        response = web.StreamResponse(
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(http)
        try:
            try:
                await self._relay(response, shape, call, first, stream)
            except RouterError as e:
                await _send(response, api_error(e, call.renames).body())
            except ApiError as e:
                await _send(response, e.body())
            await response.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            pass  # the client left; the caller closes `stream`, which cancels the request upstream
        return response

    async def _relay(self, response: web.StreamResponse, shape, call: _Call, first, stream) -> None:
        """One chunk per GenerateResponse (`first`, then the rest of `stream`) that carries text,
        logprobs or the finish reason; then the usage chunk when asked for."""
        head = self._head(shape, call, chunk=True)
        if call.include_usage:
            head["usage"] = None  # as OpenAI: null on every chunk but the last
        if (opening := shape.opening()) is not None:
            await _send(response, {**head, "choices": [opening]})
        offset, out = 0, first
        while True:
            if out is None:
                _finish_reason(None)  # the stream ended without a finish: raises
            text = "".join(t.text for t in out.tokens)
            reason = _finish_reason(out.finish) if out.HasField("finish") else None
            logprobs = shape.logprobs(out.tokens, offset) if call.logprobs and out.tokens else None
            offset += len(text)
            if text or logprobs or reason:
                await _send(response, {**head, "choices": [shape.delta(text, logprobs, reason)]})
            if reason:
                if call.include_usage:
                    await _send(response, {**head, "choices": [], "usage": _usage(out.finish)})
                return
            out = await anext(stream, None)

    async def _completion_call(self, f: _Fields) -> _Call:
        _reject_unsupported(f)
        if f.integer("best_of") not in (None, 1):
            raise bad_request("best_of", "only 1 is supported")
        logprobs = f.integer("logprobs")
        if logprobs not in (None, 0):
            raise bad_request("logprobs", "only 0 is supported (the sampled token's logprob; alternatives are "
                                          f"not computed), got {logprobs}")
        request = _generate_request(f, "max_tokens")
        _set_prompt(f, request)
        return _call(f, request, logprobs is not None, {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt",
                                                          **_STRUCTURED_RENAMES})

    async def _chat_call(self, f: _Fields) -> _Call:
        _reject_unsupported(f)
        logprobs = f.flag("logprobs")
        if (top := f.integer("top_logprobs")) not in (None, 0):
            raise bad_request("top_logprobs", f"only 0 is supported (alternatives are not computed), got {top}")
        pool = self.service.pool_for(f.body.get("model") if isinstance(f.body.get("model"), str) else "")
        ids = await self._chat_prompt_ids(pool, f)
        max_name = "max_completion_tokens" if f.body.get("max_completion_tokens") is not None else "max_tokens"
        rest_of_context = max(1, pool.model.max_position_embeddings - len(ids))
        request = _generate_request(f, max_name, default_max=rest_of_context)
        request.prompt_token_ids.ids.extend(ids)
        renames = {"max_new_tokens": max_name, "prompt": "messages", "prompt_token_ids": "messages", **_STRUCTURED_RENAMES}
        return _call(f, request, logprobs, renames)

    async def _chat_prompt_ids(self, pool, f: _Fields) -> list[int]:
        messages = f.get("messages", (list,), "a list of messages", required=True)
        chat = [_chat_message(i, m) for i, m in enumerate(messages)]
        try:
            return await self.service.tokenize_chat(pool, chat)
        except InvalidRequest:
            raise
        except ValueError as e:
            raise bad_request("messages", str(e)) from None


def _reject_unsupported(f: _Fields) -> None:
    if (n := f.integer("n")) not in (None, 1):
        raise bad_request("n", f"only 1 choice per request is supported, got {n}")
    for name in _UNSUPPORTED:
        if f.body.get(name):
            raise bad_request(name, "is not supported by kvmesh")


def _structured_output(f: _Fields) -> gen.StructuredOutput | None:
    """`response_format`: text (None), json_object, or json_schema with its `json_schema.schema`
    (enforced whether or not `strict` is set, as vLLM does)."""
    response_format = f.nested("response_format")
    kind = response_format.string("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return gen.StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise bad_request("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    spec = response_format.nested("json_schema")
    spec.flag("strict")
    schema = spec.get("schema", (dict,), "a JSON Schema object", required=True)
    return gen.StructuredOutput(json_schema=json.dumps(schema))


def _generate_request(f: _Fields, max_tokens_name: str, default_max: int | None = None) -> gen.GenerateRequest:
    """The model, sampling and stopping parameters common to both endpoints (`user` is ignored)."""
    request = gen.GenerateRequest(model=f.string("model", required=True), request_id=uuid.uuid4().hex,
                                  sampling=_sampling(f), stopping=_stopping(f, max_tokens_name, default_max))
    if (priority := f.integer("priority", -2**31, 2**31 - 1)) is not None:
        request.priority = priority
    return request


def _sampling(f: _Fields) -> gen.SamplingParams:
    sampling = gen.SamplingParams()
    for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if (value := f.number(name)) is not None:
            setattr(sampling, name, value)
    if (top_k := f.integer("top_k", -2**31, 2**31 - 1)) is not None:
        sampling.top_k = top_k
    if (seed := f.integer("seed", 0, 2**64 - 1)) is not None:
        sampling.seed = seed
    if (structured := _structured_output(f)) is not None:
        sampling.structured_output.CopyFrom(structured)
    return sampling


def _stopping(f: _Fields, max_tokens_name: str, default_max: int | None) -> gen.StoppingParams:
    stopping = gen.StoppingParams(stop=_stop_strings(f), ignore_eos=f.flag("ignore_eos"))
    max_tokens = f.integer(max_tokens_name)
    if max_tokens is None:
        max_tokens = default_max
    if max_tokens is not None:
        stopping.max_new_tokens = max_tokens
    return stopping


def _stop_strings(f: _Fields) -> list[str]:
    stop = f.get("stop", (str, list), "a string or a list of strings")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not all(isinstance(s, str) for s in stops):
        raise bad_request("stop", "must be a string or a list of strings")
    return stops


def _set_prompt(f: _Fields, request: gen.GenerateRequest) -> None:
    prompt = f.get("prompt", (str, list), "a string or a list of token ids", required=True)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):  # a batch of prompts
        if len(prompt) != 1:
            raise bad_request("prompt", f"holds {len(prompt)} prompts; send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        request.prompt = prompt
        return
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX for t in prompt):
        raise bad_request("prompt", "must be a string, a list of token ids, or a list holding one of those")
    request.prompt_token_ids.SetInParent()
    request.prompt_token_ids.ids.extend(prompt)


def _chat_message(i: int, message) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request(where, "must be an object with a string `role`")
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(_text_part(where, part) for part in content)
    elif content is not None and not isinstance(content, str):
        raise bad_request(f"{where}.content", "must be a string or a list of text parts")
    return {**message, "content": content}


def _text_part(where: str, part) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    raise bad_request(f"{where}.content", 'only text parts ({"type": "text", "text": ...}) are supported')


def _call(f: _Fields, request: gen.GenerateRequest, logprobs: bool, renames: dict[str, str]) -> _Call:
    stream = f.flag("stream")
    include_usage = f.nested("stream_options").flag("include_usage")
    return _Call(request, stream, stream and include_usage, logprobs, renames)


async def _json_object(http: web.Request, limit: int) -> dict:
    """The body as a JSON object: 415 unless it says it is JSON, 413 over `limit` bytes (the app's
    client_max_size), 400 if it does not parse or nests deeper than MAX_JSON_DEPTH."""
    if http.content_type != "application/json":
        raise ApiError(415, f"the body must be JSON, sent with `Content-Type: application/json` "
                            f"(got {http.headers.get('Content-Type', 'none')[:60]!r})")
    if http.content_length is not None and http.content_length > limit:  # refused before it is read
        raise _too_large(http.content_length, limit)
    try:
        body = json.loads(await http.read())
    except web.HTTPRequestEntityTooLarge as e:
        raise _too_large(e.actual_size, limit) from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError:  # also UnicodeDecodeError
        raise ApiError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    if _nests_deeper(body, MAX_JSON_DEPTH):
        raise _too_deep()
    return body


def _too_large(size: int | None, limit: int) -> ApiError:
    got = f"{size} bytes" if size is not None else "more"
    return ApiError(413, f"the body has {got}, over the router's limit of {limit} bytes (max_request_bytes)")


def _too_deep() -> ApiError:
    return ApiError(400, f"the body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep")


def _nests_deeper(value, depth: int) -> bool:
    """Whether `value` (parsed JSON) has containers more than `depth` levels deep. Iterates only
    over containers that hold containers, so a long flat list (a prompt of ids) costs one pass in C."""
    level = [value]
    for _ in range(depth):
        inner = []
        for container in level:
            items = container.values() if isinstance(container, dict) else container
            if {list, dict} & set(map(type, items)):
                inner.extend(v for v in items if isinstance(v, (list, dict)))
        if not inner:
            return False
        level = inner
    return True


def _finish_reason(finish: gen.Finish | None) -> str:
    """OpenAI's finish_reason; a request that ended in ERROR (or without a finish) is a 500."""
    if finish is not None and finish.reason in _FINISH_REASONS:
        return _FINISH_REASONS[finish.reason]
    why = (finish.message or gen.FinishReason.Name(finish.reason).lower()) if finish is not None else "no finish"
    raise ApiError(500, f"generation failed: {why}", "server_error")


def _usage(finish: gen.Finish) -> dict:
    return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finish.cached_prompt_tokens}}


async def _send(response: web.StreamResponse, event: dict) -> None:
    await response.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
