"""The OpenAI-compatible HTTP API on the router, driven by the official `openai` client over a real mesh."""

import asyncio
import contextlib
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.services.launcher import Child, free_port, serve_command, stop, wait_serving
from kvmesh.services.router.openai_api import api_error
from kvmesh.services.router.output import send_now
from kvmesh.services.router.server import RouterError
from kvmesh.tokenizer import Tokenizer
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc
from local_mesh import collect, page_stats, wait_idle

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a river."}]


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=f"http://{mesh.child('router').http}/v1", api_key="x", max_retries=0)


@contextlib.contextmanager
def second_router(mesh, model_dir, *flags):
    """Another router on the same mesh, started with `flags`; yields its Child."""
    port, http_port = free_port(), free_port()
    proc = subprocess.Popen(serve_command("router", mesh.redis_url, port, "--http-port", str(http_port),
                                          "--model", str(model_dir), *flags),
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    child = Child("router-" + flags[0].strip("-"), f"127.0.0.1:{port}", proc, f"127.0.0.1:{http_port}")
    try:
        wait_serving(child.address, 120, proc)
        yield child
    finally:
        stop([child], None)


@pytest.fixture(scope="module")
def keyed_router(mesh, model_dir):
    """A second router on the same mesh that wants `Bearer k1` or `Bearer k2`; yields its HTTP address."""
    with second_router(mesh, model_dir, "--api-keys", "k1,k2") as child:
        yield child.http


@pytest.fixture(scope="module")
def interval_router(mesh, model_dir):
    """A second router on the same mesh started with --stream-interval 3, holding tokens for the
    count however slowly they come (a loaded machine's gaps would send some early); yields its Child."""
    with second_router(mesh, model_dir, "--stream-interval", "3", "--stream-interval-max-gap-ms", "0") as child:
        yield child


def greedy(max_tokens=12, **extra_body):
    """OpenAI arguments for a greedy request of exactly `max_tokens` tokens."""
    return dict(model="default", max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True, **extra_body})


def grpc_generate(mesh, prompt=None, prompt_token_ids=None, max_tokens=12, **stopping):
    request = gen.GenerateRequest(sampling=gen.SamplingParams(temperature=0.0),
                                  stopping=gen.StoppingParams(max_new_tokens=max_tokens, ignore_eos=True, **stopping))
    if prompt_token_ids is not None:
        request.prompt_token_ids.ids.extend(prompt_token_ids)
    else:
        request.prompt = prompt

    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            return await collect(generation_pb2_grpc.GenerationStub(ch), request)

    return asyncio.run(run())


def http_call(address, path, body=None, headers=None):
    """(status, headers, JSON body) of a plain HTTP request; `body` bytes make it a POST."""
    request = urllib.request.Request(f"http://{address}{path}", data=body,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def router_metric(mesh, name, **labels):
    with urllib.request.urlopen(f"http://{mesh.child('router').http}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_completion_matches_grpc_for_the_same_greedy_request(client, mesh):
    tokens, logprobs, text, finish = grpc_generate(mesh, "garden river stone")
    answer = client.completions.create(prompt="garden river stone", **greedy())
    assert answer.id.startswith("cmpl-") and answer.object == "text_completion" and answer.model == "default"
    assert answer.created == pytest.approx(time.time(), abs=60)
    [choice] = answer.choices
    assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == (0, text, "length", None)
    usage = answer.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (finish.prompt_tokens, 12)
    assert usage.total_tokens == usage.prompt_tokens + 12
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_a_prompt_of_token_ids_is_the_same_as_its_text(client, model_dir):
    ids = Tokenizer.from_dir(model_dir).encode("north garden cloud")
    by_text = client.completions.create(prompt="north garden cloud", **greedy())
    by_ids = client.completions.create(prompt=ids, **greedy())
    by_batch_of_one = client.completions.create(prompt=[ids], **greedy())
    assert by_ids.choices[0].text == by_batch_of_one.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_streamed_completion_equals_non_streamed_and_ends_with_usage(client):
    whole = client.completions.create(prompt="alpha beta gamma", **greedy(20))
    chunks = list(client.completions.create(prompt="alpha beta gamma", stream=True,
                                            stream_options={"include_usage": True}, **greedy(20)))
    *with_text, last = chunks
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert "".join(c.choices[0].text for c in with_text) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in with_text][-1] == "length"
    assert all(c.usage is None for c in with_text)
    assert last.choices == [] and last.usage.completion_tokens == 20
    assert last.usage.total_tokens == last.usage.prompt_tokens + 20


def chunk_sizes(chunks) -> list[int]:
    """Tokens per streamed completion chunk (its logprobs list one entry per token), chunks without any left out."""
    return [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs]


def test_a_stream_interval_sends_that_many_tokens_a_chunk_with_the_same_text(client, interval_router):
    """vLLM's `stream_interval`: after the first token, a chunk goes out once that many tokens wait,
    and the finish takes the rest; the text is the same as streamed a token at a time. (The router
    merges a slow reader's waiting tokens too, so a chunk may hold more, never fewer.)"""
    held = openai.OpenAI(base_url=f"http://{interval_router.http}/v1", api_key="x", max_retries=0)
    whole = client.completions.create(prompt="cedar marsh pebble", **greedy(48))
    one_by_one = list(client.completions.create(prompt="cedar marsh pebble", stream=True, logprobs=1, **greedy(48)))
    by_four = list(held.completions.create(prompt="cedar marsh pebble", stream=True, logprobs=1,
                                           **greedy(48, stream_interval=4)))
    for chunks in (one_by_one, by_four):
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        assert sum(chunk_sizes(chunks)) == 48 and chunks[-1].choices[0].finish_reason == "length"
    first, *middle, last = chunk_sizes(by_four)
    assert middle and all(n >= 4 for n in middle), chunk_sizes(by_four)


def test_held_tokens_go_once_the_interval_is_reached_or_a_slow_token_comes():
    """The stream interval's rule (output.send_now): the first token at once; then a chunk per
    `interval` tokens while they come fast; a token that came `max_gap_s` or more after the one
    before goes at once with those held; with max_gap_s 0 only the count counts."""
    assert not send_now(0, False, 4, None, 0.05)  # nothing held
    assert send_now(1, False, 4, None, 0.05)  # the first token
    assert [send_now(n, True, 4, 0.01, 0.05) for n in (1, 2, 3, 4, 5)] == [False, False, False, True, True]
    assert send_now(1, True, 4, 0.05, 0.05) and send_now(2, True, 4, 1.5, 0.05)  # tokens come slowly
    assert not send_now(2, True, 4, 1.5, 0.0) and send_now(4, True, 4, 1.5, 0.0)  # the gap rule off


def test_the_routers_stream_interval_is_the_least_a_request_gets(mesh, interval_router):
    """--stream-interval 3 on the router: a gRPC request that asks for nothing or for less gets three
    tokens a message after the first, one that asks for more gets that; the tokens are those of a
    router streaming them one at a time."""
    def messages(address, stream_interval):
        request = gen.GenerateRequest(prompt="amber fjord lantern", stream_interval=stream_interval,
                                      sampling=gen.SamplingParams(temperature=0.0),
                                      stopping=gen.StoppingParams(max_new_tokens=40, ignore_eos=True))

        async def run():
            async with grpc.aio.insecure_channel(address) as ch:
                return [r async for r in generation_pb2_grpc.GenerationStub(ch).Generate(request, timeout=60)]

        return asyncio.run(run())

    reference = [t.id for r in messages(mesh.addr, 0) for t in r.tokens]
    assert len(reference) == 40
    for asked, least in ((0, 3), (2, 3), (6, 6)):
        responses = messages(interval_router.address, asked)
        assert [t.id for r in responses for t in r.tokens] == reference
        first, *middle, last = [len(r.tokens) for r in responses]
        assert middle and all(n >= least for n in middle), (asked, [len(r.tokens) for r in responses])
        assert responses[-1].HasField("finish")


def test_a_token_after_a_pause_goes_out_at_once_with_the_tokens_held(mesh):
    """The gap rule in a running mesh (the default router: 50 ms): a stream whose interval it will
    never reach gets, after its first token, nothing while tokens come fast; when the worker stops
    for a while (SIGSTOP, the pause a prompt burst's long step makes), the first token after it goes
    out at once with those held, before the stream's end. Without the rule the only message after the
    first would be the last, with the finish."""
    request = gen.GenerateRequest(prompt="a pause in the river", stream_interval=100_000,
                                  sampling=gen.SamplingParams(temperature=0.0),
                                  stopping=gen.StoppingParams(max_new_tokens=1500, ignore_eos=True))
    workers = [c.process for c in mesh.children if c.service == "worker"]

    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            call = generation_pb2_grpc.GenerationStub(ch).Generate(request, timeout=120)
            first = await call.read()
            for w in workers:
                w.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(0.3)  # the pause itself (the stimulus), six times the rule's gap
            finally:
                for w in workers:
                    w.send_signal(signal.SIGCONT)
            after = await call.read()
            call.cancel()  # mid-stream, with tokens held: its pages come back all the same
            return first, after, await wait_idle(mesh.kvcache_addr, timeout=60)

    first, after, idle = asyncio.run(run())
    assert len(first.tokens) == 1 and not first.HasField("finish")
    assert after is not grpc.aio.EOF and not after.HasField("finish"), after
    assert len(after.tokens) >= 1
    assert all(w.used_pages == 0 for w in idle), idle


def test_chat_renders_the_chat_template_and_matches_grpc(client, mesh, model_dir):
    ids = Tokenizer.from_dir(model_dir).encode_chat(CHAT)
    _, _, text, _ = grpc_generate(mesh, prompt_token_ids=ids)
    answer = client.chat.completions.create(messages=CHAT, **greedy())
    assert answer.id.startswith("chatcmpl-") and answer.object == "chat.completion"
    [choice] = answer.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", text, "length")
    assert answer.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(messages=CHAT, stream=True, **greedy()))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_takes_max_completion_tokens_and_text_parts(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "river."}]}]
    plain = [{"role": "user", "content": "Name a river."}]
    by_parts = client.chat.completions.create(model="default", messages=parts, max_completion_tokens=7,
                                              temperature=0, extra_body={"ignore_eos": True})
    by_text = client.chat.completions.create(messages=plain, **greedy(7))
    assert by_parts.usage.completion_tokens == 7
    assert by_parts.choices[0].message.content == by_text.choices[0].message.content


def test_stop_string_ends_the_completion_with_finish_reason_stop(client):
    text = client.completions.create(prompt="river stone light", **greedy(24)).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    stopped = client.completions.create(prompt="river stone light", stop=[stop, "never seen"], **greedy(24))
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.find(stop)]


def test_logprobs_are_those_of_the_sampled_tokens(client, mesh, model_dir):
    _, logprobs, text, _ = grpc_generate(mesh, "cloud north")
    answer = client.completions.create(prompt="cloud north", logprobs=0, **greedy())
    lp = answer.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(logprobs, abs=1e-5)
    assert "".join(lp.tokens) == text and lp.text_offset[0] == 0
    ids = Tokenizer.from_dir(model_dir).encode_chat(CHAT)
    _, chat_logprobs, _, _ = grpc_generate(mesh, prompt_token_ids=ids)
    chat = client.chat.completions.create(messages=CHAT, logprobs=True, **greedy())
    assert [c.logprob for c in chat.choices[0].logprobs.content] == pytest.approx(chat_logprobs, abs=1e-5)


@pytest.mark.parametrize("kwargs, param", [
    (dict(prompt="hello", max_tokens=5000), "max_tokens"),
    (dict(prompt="hello", max_tokens=0), "max_tokens"),
    (dict(prompt="hello", n=17), "n"),
    (dict(prompt="hello", n=3, best_of=2), "best_of"),
    (dict(prompt="hello", n=2, best_of=3, stream=True), "best_of"),
    (dict(prompt="hello", suffix="and then"), "suffix"),
    (dict(prompt="hello", logit_bias={"7": 101}), "logit_bias"),
    (dict(prompt="hello", logit_bias={"seven": 1}), "logit_bias"),
    (dict(prompt="hello", logit_bias={"100000": 1}), "logit_bias"),
    (dict(prompt="hello", temperature=-1), "temperature"),
    (dict(prompt="hello", top_p=0), "top_p"),
    (dict(prompt="hello", presence_penalty=3), "presence_penalty"),
    (dict(prompt="hello", logprobs=21), "logprobs"),
    (dict(prompt="hello", echo="yes"), "echo"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=["one", 2]), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(prompt=[1, 2, 100000]), "prompt"),
])
def test_bad_completion_parameters_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="default", **kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"
    assert err.value.body["message"].startswith(f"{param}: ")


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_completion_tokens=5000), "max_completion_tokens"),
    (dict(max_tokens=5000), "max_tokens"),
    (dict(n=0), "n"),
    (dict(top_logprobs=21, logprobs=True), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
])
def test_bad_chat_parameters_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=CHAT, **kwargs)
    assert err.value.body["param"] == param and param in err.value.body["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"model": "default", "prompt": ', None),
    ("/v1/completions", b'["a list"]', None),
    ("/v1/completions", b'{"model": "default"}', "prompt"),
    ("/v1/completions", b'{"prompt": "hello"}', "model"),
    ("/v1/completions", b'{"model": "default", "prompt": "hello", "temperature": "hot"}', "temperature"),
    ("/v1/completions", b'{"model": "default", "prompt": "hello", "max_tokens": 2.5}', "max_tokens"),
    ("/v1/completions", b'{"model": "default", "prompt": "hello", "max_tokens": -3}', "max_tokens"),
    ("/v1/completions", b'{"model": "default", "prompt": "hello", "stop": [1]}', "stop"),
    ("/v1/completions", b'{"model": "default", "prompt": "hello", "stream": "yes"}', "stream"),
    ("/v1/completions", b'{"model": "default", "prompt": "hello", "stream": true, "stream_interval": 0}', "stream_interval"),
    ("/v1/completions", b'{"model": "default", "prompt": "hello", "stream": true, "stream_interval": "4"}',
     "stream_interval"),
    ("/v1/chat/completions", b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], '
                             b'"stream": true, "stream_interval": 2.5}', "stream_interval"),
    ("/v1/chat/completions", b'{"model": "default"}', "messages"),
    ("/v1/chat/completions", b'{"model": "default", "messages": "hi"}', "messages"),
    ("/v1/chat/completions", b'{"model": "default", "messages": []}', "messages"),
    ("/v1/chat/completions", b'{"model": "default", "messages": [{"content": "hi"}]}', "messages[0].role"),
    ("/v1/chat/completions", b'{"model": "default", "messages": [{"role": "user", "content": 7}]}',
     "messages[0].content"),
    ("/v1/chat/completions", b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], '
                             b'"stream": true, "stream_options": {"include_usage": 1}}',
     "stream_options.include_usage"),
])
def test_malformed_bodies_are_400_naming_the_field(mesh, path, body, param):
    status, _, answer = http_call(mesh.child("router").http, path, body)
    assert status == 400
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
    if param:
        assert answer["error"]["message"].startswith(f"{param}: ")


def test_errors_of_a_streamed_request_before_any_output_are_plain_http_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="default", prompt="hello", max_tokens=5000, stream=True)
    assert err.value.body["param"] == "max_tokens"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hello")
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_models_lists_the_served_model(client, model_dir):
    model, by_path = client.models.list().data  # the pool, and the folder it was started from (as vLLM names it)
    assert (model.id, model.object, model.owned_by) == ("default", "model", "kvmesh")
    assert (by_path.id, by_path.root) == (str(model_dir), "default")
    assert model.max_model_len == 2048
    assert client.models.retrieve("default").id == "default"


def test_health_and_ready(mesh):
    http = mesh.child("router").http
    assert http_call(http, "/health")[::2] == (200, {"status": "alive"})
    assert http_call(http, "/ready")[::2] == (200, {"status": "ready", "models": ["default"]})


def test_trace_id_comes_back_as_a_header_following_traceparent(client):
    traced = client.with_options(default_headers={"traceparent": TRACEPARENT})
    raw = traced.completions.with_raw_response.create(prompt="hello", **greedy(3))
    assert raw.headers["kvmesh-trace-id"] == TRACE_ID
    raw = traced.chat.completions.with_raw_response.create(messages=CHAT, stream=True, **greedy(3))
    assert raw.headers["kvmesh-trace-id"] == TRACE_ID
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    with pytest.raises(openai.BadRequestError) as err:
        traced.completions.create(model="default", prompt="hello", max_tokens=5000)
    assert err.value.response.headers["kvmesh-trace-id"] == TRACE_ID


def test_closing_a_stream_early_cancels_it_upstream_and_frees_its_pages(client, mesh):
    finished_before = router_metric(mesh, "kvmesh_request_success_total")
    # ~1900 tokens take the tiny model many seconds: idle pages soon after the close mean a cancel.
    stream = client.completions.create(prompt="a stream that goes on", stream=True, **greedy(1900))
    chunks = [next(stream) for _ in range(3)]
    in_use = sum(w.used_pages for w in asyncio.run(page_stats(mesh.kvcache_addr)))
    stream.close()
    idle = asyncio.run(wait_idle(mesh.kvcache_addr, timeout=10))
    assert all(c.choices[0].text is not None for c in chunks)
    assert in_use > 0
    assert all(w.used_pages == 0 for w in idle), idle
    assert all(w.cached_pages + w.free_pages == w.total_pages for w in idle)
    assert router_metric(mesh, "kvmesh_request_success_total") == finished_before  # cancelled, not finished
    assert router_metric(mesh, "kvmesh_requests_in_flight") == 0


def test_api_keys_are_checked_when_configured(keyed_router):
    def keyed(key):
        return openai.OpenAI(base_url=f"http://{keyed_router}/v1", api_key=key, max_retries=0)

    with pytest.raises(openai.AuthenticationError) as err:
        keyed("wrong").completions.create(prompt="hello", **greedy(3))
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        keyed("wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        keyed("wrong").chat.completions.create(messages=CHAT, stream=True, **greedy(3))
    status, _, _ = http_call(keyed_router, "/v1/completions", b'{"model": "default", "prompt": "hello"}')
    assert status == 401  # no key at all
    assert keyed("k2").completions.create(prompt="hello", **greedy(3)).usage.completion_tokens == 3
    assert [m.id for m in keyed("k1").models.list().data][0] == "default"
    assert http_call(keyed_router, "/health")[0] == 200  # probes need no key


@pytest.mark.parametrize("code, trailing, status, headers", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, (("retry-after-ms", "1500"),), 429,
     {"Retry-After": "2", "retry-after-ms": "1500"}),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, (), 429, {}),
    (grpc.StatusCode.UNAVAILABLE, (), 503, {}),
    (grpc.StatusCode.UNAUTHENTICATED, (), 401, {}),
    (grpc.StatusCode.INTERNAL, (), 500, {}),
])
def test_router_errors_map_to_openai_statuses(code, trailing, status, headers):
    error = api_error(RouterError(code, "why", trailing), {})
    assert (error.status, error.headers) == (status, headers)
    assert error.body()["error"]["message"] == "why"
