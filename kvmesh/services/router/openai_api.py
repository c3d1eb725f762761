"""The OpenAI-compatible HTTP API on the router: `POST /v1/completions`, `POST /v1/chat/completions`,
`GET /v1/models` and `GET /v1/models/{model}`.

A body is read into its pydantic schema (schemas.py: JSON types and wire ranges), then becomes one
GenerateRequest per prompt for `RouterService.generate`, which validates it (the limits live in
`kvmesh.params`, not here) and runs its `n` choices; a prompt list is one request of several
sequences, and choice `index` counts prompt by prompt (prompt i's choice j is i * n + j). What
OpenAI's API has and kvmesh does not (`suffix`, tools) is a 400 naming it, rather than a silently
different answer. Chat messages go through the checkpoint's chat template with the generation
prompt added; without max_tokens a chat completion may run to the end of the context, as far as
the pool's KV pages can hold it. The answers' text and logprobs are rendered by output.py.

`echo` puts the prompt before each completion (with `logprobs`, the prompt's tokens and logprobs
too: the first token's is null); `best_of` samples that many choices and returns the `n` with the
highest sum of token logprobs (not streamed, as OpenAI).

Answers have OpenAI's shapes; with `"stream": true` they are server-sent events (`data: {json}`)
ending in `data: [DONE]`, plus a usage chunk with empty choices when
`stream_options.include_usage` is set. A chunk carries one token's text, or, after a choice's
first, `stream_interval` tokens' (vLLM's extra field; the router's --stream-interval is the least
it can be), sooner when tokens come slowly (output.send_now). Errors have OpenAI's shape
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

import asyncio
import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field

import grpc
from aiohttp import web

from kvmesh import telemetry
from kvmesh.params import MAX_SEQUENCES, InvalidRequest
from kvmesh.services.router import output
from kvmesh.services.router.schemas import ChatCompletionRequest, CompletionRequest, SchemaError, parse
from kvmesh.services.router.server import RouterError
from kvmesh.v1 import generation_pb2 as gen

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
_UNSUPPORTED = {"suffix": "is not supported (kvmesh does no fill-in-the-middle completion)",
                "tools": "is not supported by kvmesh", "functions": "is not supported by kvmesh"}
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


@dataclass
class _Call:
    """One OpenAI request, translated: what to ask the router and how to answer."""

    requests: list[gen.GenerateRequest]  # one per prompt, each with its n (best_of) choices
    n: int  # choices answered per prompt
    stream: bool
    include_usage: bool
    logprobs: bool  # answer with logprobs
    top: bool  # /v1/completions: with top_logprobs ({token: logprob} per token)
    echoes: list[str] | None  # /v1/completions echo: each prompt's text, put before its completions
    renames: dict[str, str]  # kvmesh field -> the request's parameter, for 400 messages
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def best_of(self) -> int:
        return max(1, self.requests[0].n)


@dataclass
class _Choice:
    """What one choice has received so far."""

    tokens: list = field(default_factory=list)
    finish: gen.Finish | None = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(t.logprob for t in self.tokens)


class _TextCompletion:
    """The shapes of /v1/completions answers."""

    id_prefix, object, chunk_object = "cmpl-", "text_completion", "text_completion"

    @staticmethod
    def choice(index: int, text: str, logprobs: dict | None, reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    delta = choice

    @staticmethod
    def opening(index: int) -> dict | None:
        return None

    @staticmethod
    def logprobs(tokenizer, call: _Call, tokens, offset: int, with_prompt: bool) -> dict:
        return output.completion_logprobs(tokenizer, tokens, offset, first_is_prompt=with_prompt, top=call.top)


class _ChatCompletion:
    """The shapes of /v1/chat/completions answers."""

    id_prefix, object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def choice(index: int, text: str, logprobs: dict | None, reason: str | None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": reason}

    @staticmethod
    def delta(index: int, text: str, logprobs: dict | None, reason: str | None) -> dict:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs, "finish_reason": reason}

    @staticmethod
    def opening(index: int) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    @staticmethod
    def logprobs(tokenizer, call: _Call, tokens, offset: int, with_prompt: bool) -> dict:
        return output.chat_logprobs(tokenizer, tokens)


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
        """`prompt` is a string, a list of token ids, or a list of those (several sequences)."""
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
            call = await translate(await _json_object(http, self.service.cfg.max_request_bytes))
            return await self._run(http, shape, call, span, headers, key)
        except SchemaError as e:
            return ApiError(400, str(e), param=e.param).response(headers)
        except ApiError as e:
            return e.response(headers)
        except RouterError as e:  # a wrong API key; an unknown model while translating
            return api_error(e, {}).response(headers)
        except InvalidRequest as e:  # a chat message the tokenizer refuses (a role, the size)
            return ApiError(400, str(e), param=e.field).response(headers)
        finally:
            span.end()

    async def _run(self, http, shape, call: _Call, span, headers: dict[str, str], key) -> web.StreamResponse:
        tokenizer = self.service.pool_for(call.requests[0].model).tokenizer
        # Each prompt of a list is a request of its own under the key's limits.
        streams = [self.service.generate(r, None, span, key) for r in call.requests]
        merged = streams[0] if len(streams) == 1 else _merged(streams)
        try:
            if call.stream:
                return await self._stream(http, shape, call, merged, tokenizer, headers)
            return await self._complete(shape, call, merged, tokenizer, headers)
        except RouterError as e:
            return api_error(e, call.renames).response(headers)
        finally:
            await merged.aclose()  # at once: cancels what is still running upstream
            for stream in streams:
                await stream.aclose()

    def _head(self, shape, call: _Call, chunk: bool) -> dict:
        return {"id": shape.id_prefix + call.requests[0].request_id,
                "object": shape.chunk_object if chunk else shape.object,
                "created": call.created, "model": call.requests[0].model or self.service.default_pool}

    async def _complete(self, shape, call: _Call, stream, tokenizer, headers: dict[str, str]) -> web.Response:
        choices: dict[tuple[int, int], _Choice] = {}
        prompts: dict[int, list] = {}
        async for prompt, out in _numbered(stream, len(call.requests)):
            choice = choices.setdefault((prompt, out.index), _Choice())
            choice.tokens.extend(out.tokens)
            if out.prompt_tokens:
                prompts[prompt] = list(out.prompt_tokens)
            if out.HasField("finish"):
                choice.finish = out.finish
        answers, finishes = [], []
        for prompt in range(len(call.requests)):
            sampled = [choices.get((prompt, j)) or _Choice() for j in range(call.best_of)]
            finishes += [c.finish for c in sampled]
            for c in sampled:
                _finish_reason(c.finish)  # any choice that failed fails the answer
            if call.best_of > call.n:  # the n likeliest, as OpenAI's best_of
                sampled = sorted(sampled, key=lambda c: c.cumulative_logprob, reverse=True)[: call.n]
            for j, c in enumerate(sampled):
                reason = _finish_reason(c.finish)
                echo, tokens = self._echo(call, prompt, prompts), c.tokens
                logprobs = None
                if call.logprobs:
                    with_prompt = bool(call.echoes) and prompt in prompts
                    logprobs = shape.logprobs(tokenizer, call, (prompts[prompt] if with_prompt else []) + tokens, 0,
                                              with_prompt)
                answers.append(shape.choice(prompt * call.n + j, echo + "".join(t.text for t in tokens), logprobs, reason))
        body = {**self._head(shape, call, chunk=False), "choices": answers, "usage": _usage(finishes, call.best_of)}
        return web.json_response(body, headers=headers)

    @staticmethod
    def _echo(call: _Call, prompt: int, prompts: dict[int, list]) -> str:
        """The text echoed before prompt `prompt`'s completions: with logprobs, its tokens' text
        (so that text_offset counts along it), otherwise the prompt as sent."""
        if not call.echoes:
            return ""
        if call.logprobs and prompt in prompts:
            return "".join(t.text for t in prompts[prompt])
        return call.echoes[prompt]

    async def _stream(self, http, shape, call: _Call, stream, tokenizer, headers: dict[str, str]) -> web.StreamResponse:
        first = await anext(stream, None)  # an error before any output is a plain HTTP error
        response = web.StreamResponse(
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(http)
        try:
            try:
                await self._relay(response, shape, call, first, stream, tokenizer)
            except RouterError as e:
                await _send(response, api_error(e, call.renames).body())
            except ApiError as e:
                await _send(response, e.body())
            await response.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            pass  # the client left; the caller closes `stream`, which cancels the request upstream
        return response

    async def _relay(self, response: web.StreamResponse, shape, call: _Call, first, stream, tokenizer) -> None:
        """One chunk per GenerateResponse (`first`, then the rest of `stream`) that carries text,
        logprobs or a finish reason; a choice's first chunk starts with the echoed prompt. Then
        the usage chunk when asked for."""
        head = self._head(shape, call, chunk=True)
        if call.include_usage:
            head["usage"] = None  # as OpenAI: null on every chunk but the last
        total = len(call.requests) * call.n
        for index in range(total):
            if (opening := shape.opening(index)) is not None:
                await _send(response, {**head, "choices": [opening]})
        offsets: dict[int, int] = {}
        prompts: dict[int, list] = {}
        finishes: dict[int, gen.Finish] = {}
        numbered = _numbered(_chained(first, stream), len(call.requests))
        async for prompt, out in numbered:
            index = prompt * call.n + out.index
            if out.prompt_tokens:
                prompts[prompt] = list(out.prompt_tokens)
            text, tokens, with_prompt = "".join(t.text for t in out.tokens), list(out.tokens), False
            if index not in offsets and call.echoes:
                text = self._echo(call, prompt, prompts) + text
                with_prompt = call.logprobs and prompt in prompts
                tokens = (prompts[prompt] if with_prompt else []) + tokens
            offset = offsets.get(index, 0)
            offsets[index] = offset + len(text)
            reason = _finish_reason(out.finish) if out.HasField("finish") else None
            logprobs = shape.logprobs(tokenizer, call, tokens, offset, with_prompt) if call.logprobs and tokens else None
            if text or logprobs or reason:
                await _send(response, {**head, "choices": [shape.delta(index, text, logprobs, reason)]})
            if reason:
                finishes[index] = out.finish
        if len(finishes) < total:
            _finish_reason(None)  # a stream ended without its finish: raises
        if call.include_usage:
            await _send(response, {**head, "choices": [], "usage": _usage([finishes[i] for i in sorted(finishes)], call.n)})

    async def _completion_call(self, body: dict) -> _Call:
        req = parse(CompletionRequest, body)
        _refuse_unsupported(req)
        best_of = req.best_of or req.n
        if best_of < req.n:
            raise bad_request("best_of", f"must be at least n ({req.n}), got {best_of}")
        if req.stream and best_of > req.n:
            raise bad_request("best_of", "cannot be streamed: the best choices are known only at the end")
        if len(req.prompt) * best_of > MAX_SEQUENCES:
            raise bad_request("prompt", f"{len(req.prompt)} prompts of {best_of} choices each make "
                                        f"{len(req.prompt) * best_of} sequences, over the limit of {MAX_SEQUENCES}")
        k = req.logprobs
        request_id = uuid.uuid4().hex
        requests = []
        for i, prompt in enumerate(req.prompt):
            request = _generate_request(req, request_id if i == 0 else f"{request_id}-{i}", req.max_tokens, best_of,
                                        logprobs=k or 0, prompt_logprobs=k if req.echo and k is not None else None)
            if isinstance(prompt, str):
                request.prompt = prompt
            else:
                request.prompt_token_ids.ids.extend(prompt)
            requests.append(request)
        echoes = None
        if req.echo:
            tokenizer = self.service.pool_for(req.model).tokenizer
            echoes = [p if isinstance(p, str) else await asyncio.to_thread(tokenizer.decode, p) for p in req.prompt]
        renames = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt", "prompt_logprobs": "logprobs",
                   **_STRUCTURED_RENAMES}
        return _Call(requests, req.n, req.stream, req.stream and _include_usage(req), k is not None,
                     bool(k), echoes, renames)

    async def _chat_call(self, body: dict) -> _Call:
        req = parse(ChatCompletionRequest, body)
        _refuse_unsupported(req)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs", "needs `logprobs: true`")
        pool = self.service.pool_for(req.model)
        ids = await self._chat_prompt_ids(pool, req)
        max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # the rest of the context, as far as a worker's KV pages hold it
            max_tokens = max(1, pool.room_after(len(ids)))
        request = _generate_request(req, uuid.uuid4().hex, max_tokens, req.n,
                                    logprobs=req.top_logprobs or 0 if req.logprobs else 0)
        request.prompt_token_ids.ids.extend(ids)
        renames = {"max_new_tokens": max_name, "prompt": "messages", "prompt_token_ids": "messages",
                   "logprobs": "top_logprobs", **_STRUCTURED_RENAMES}
        return _Call([request], req.n, req.stream, req.stream and _include_usage(req), req.logprobs, False, None, renames)

    async def _chat_prompt_ids(self, pool, req: ChatCompletionRequest) -> list[int]:
        chat = [m.model_dump() for m in req.messages]
        try:
            return await self.service.tokenize_chat(pool, chat)
        except InvalidRequest:
            raise
        except ValueError as e:
            raise bad_request("messages", str(e)) from None


def _refuse_unsupported(req) -> None:
    for name, why in _UNSUPPORTED.items():
        if getattr(req, name, None):
            raise bad_request(name, why)


def _structured_output(req) -> gen.StructuredOutput | None:
    """`response_format`: text (None), json_object, or json_schema with its `json_schema.schema`
    (enforced whether or not `strict` is set, as vLLM does)."""
    response_format = req.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return gen.StructuredOutput(json_object=True)
    if response_format.json_schema is None:
        raise bad_request("response_format.json_schema", "is required with type json_schema")
    return gen.StructuredOutput(json_schema=json.dumps(response_format.json_schema.schema_))


def _include_usage(req) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _generate_request(req, request_id: str, max_tokens: int | None, n: int, logprobs: int = 0,
                      prompt_logprobs: int | None = None) -> gen.GenerateRequest:
    """The model, sampling and stopping parameters common to both endpoints (`user` is ignored)."""
    sampling = gen.SamplingParams(logprobs=logprobs, logit_bias=req.logit_bias or {})
    for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "top_k", "seed"):
        if (value := getattr(req, name)) is not None:
            setattr(sampling, name, value)
    if prompt_logprobs is not None:
        sampling.prompt_logprobs = prompt_logprobs
    if (structured := _structured_output(req)) is not None:
        sampling.structured_output.CopyFrom(structured)
    stopping = gen.StoppingParams(stop=req.stop, ignore_eos=req.ignore_eos)
    if max_tokens is not None:
        stopping.max_new_tokens = max_tokens
    request = gen.GenerateRequest(model=req.model, request_id=request_id, n=n, sampling=sampling, stopping=stopping)
    if req.priority is not None:
        request.priority = req.priority
    if req.stream and req.stream_interval is not None:  # ignored without streaming, as vLLM does
        request.stream_interval = req.stream_interval
    return request


async def _chained(first, stream):
    if first is not None:
        yield first
    async for out in stream:
        yield out


async def _numbered(stream, prompts: int):
    """(prompt number, response) pairs: `_merged` yields them so; a single prompt's stream is prompt 0."""
    async for item in stream:
        yield item if prompts > 1 else (0, item)


async def _merged(streams: list):
    """(i, response) from every stream as they come; the first error raised ends them all."""
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(i, stream):
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(e)
        finally:
            queue.put_nowait(finished)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            item = await queue.get()
            if item is finished:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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


def _usage(finishes: list[gen.Finish], per_prompt: int) -> dict:
    """Usage of every choice (`per_prompt` of them for each prompt, in order): each prompt counted once."""
    prompts = finishes[::per_prompt]
    prompt_tokens = sum(f.prompt_tokens for f in prompts)
    completion_tokens = sum(f.completion_tokens for f in finishes)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(f.cached_prompt_tokens for f in prompts)}}


async def _send(response: web.StreamResponse, event: dict) -> None:
    await response.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
