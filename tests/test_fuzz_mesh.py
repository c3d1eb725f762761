"""Fuzzing the public edge of a running mesh (issue 15): hypothesis builds GenerateRequests and
OpenAI JSON bodies from the whole range of each field's type (NaN and infinities, huge integers,
long and odd strings, wrong JSON types). Every answer is a completion or a clear client error
(gRPC INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED, HTTP 4xx in OpenAI's error shape), never a
server error nor an ERROR finish, and every service is still up and serving exact streams after."""

import json
import urllib.error
import urllib.request

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc


EXAMPLES = 60  # per test: about half a minute each on a laptop
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
SERVED = {gen.LENGTH, gen.STOP, gen.EOS}


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.addr) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


# ---- strategies -----------------------------------------------------------------------------------

floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
uint32 = st.integers(0, 2**32 - 1)
# Small counts run; huge ones must be refused: in between would only make the test slow.
max_new = st.one_of(st.integers(0, 12), st.integers(2**20, 2**32 - 1))
texts = st.text(max_size=300)
special = st.sampled_from(["<|im_start|>", "<|im_end|>", "<s>", "</s>", "\x00", "\ud7ff", "{{", "%s"])
prompt_text = st.lists(st.one_of(texts, special), max_size=4).map("".join)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | texts,
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
                           max_leaves=12)
# Schemas: JSON Schema words with fuzzed values, any JSON object, and text that is no JSON at all.
schema_words = st.sampled_from(["type", "properties", "required", "items", "enum", "$ref", "$defs", "minLength",
                                "maxItems", "pattern", "anyOf", "additionalProperties"])
schemas = st.dictionaries(schema_words | texts, json_values, max_size=4)
structured_outputs = st.builds(lambda s: gen.StructuredOutput(json_schema=json.dumps(s)), schemas) | \
    st.builds(lambda t: gen.StructuredOutput(json_schema=t), texts)


@st.composite
def generate_requests(draw):
    """A request that would be served, each field replaced by a fuzzed value about half the time."""
    def fuzzed(sane, wild):
        return draw(wild if draw(st.booleans()) else sane)

    request = gen.GenerateRequest(model=fuzzed(st.sampled_from(["", "default"]), st.just("nope") | texts),
                                  request_id=fuzzed(st.just(""), texts), priority=fuzzed(st.just(0), st.integers(-2**31, 2**31 - 1)))
    if draw(st.booleans()):
        request.prompt = draw(prompt_text)
    else:
        request.prompt_token_ids.ids.extend(fuzzed(st.lists(st.integers(0, 500), max_size=64), st.lists(uint32, max_size=64)))
    s = request.sampling
    for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if draw(st.booleans()):
            setattr(s, name, fuzzed(st.floats(0, 1), floats))
    s.top_k = fuzzed(st.integers(0, 50), st.integers(-2**31, 2**31 - 1))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    request.n = fuzzed(st.integers(0, 2), uint32)
    s.logprobs = fuzzed(st.integers(0, 3), uint32)
    if draw(st.booleans()):
        s.prompt_logprobs = fuzzed(st.integers(0, 3), uint32)
    s.logit_bias.update(fuzzed(st.dictionaries(st.integers(0, 500), st.floats(-100, 100), max_size=3),
                               st.dictionaries(uint32, floats, max_size=5)))
    if draw(st.booleans()):
        s.structured_output.CopyFrom(fuzzed(st.just(gen.StructuredOutput(json_object=True)), structured_outputs))
    stop = request.stopping
    stop.max_new_tokens = fuzzed(st.integers(0, 12), max_new)
    stop.stop.extend(fuzzed(st.lists(st.text(max_size=4), max_size=2), st.lists(texts, max_size=20)))
    stop.stop_token_ids.extend(fuzzed(st.lists(st.integers(0, 500), max_size=2), st.lists(uint32, max_size=80)))
    stop.ignore_eos = draw(st.booleans())
    return request


messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "user\n<|im_start|>system"]) | texts},
                                          optional={"content": prompt_text | json_values, "name": json_values}),
                    max_size=4)
common_fields = {
    "model": st.sampled_from(["default", "nope"]) | json_values,
    "max_tokens": max_new | json_values, "max_completion_tokens": max_new | json_values,
    "temperature": floats | json_values, "top_p": floats | json_values, "top_k": st.integers(-2**40, 2**40) | json_values,
    "seed": st.integers(-2**70, 2**70) | json_values, "stop": st.lists(texts, max_size=20) | json_values,
    "stream": st.booleans() | json_values, "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "repetition_penalty": floats | json_values, "presence_penalty": floats | json_values,
    "frequency_penalty": floats | json_values, "n": st.integers(-5, 5) | json_values,
    "ignore_eos": st.booleans() | json_values, "priority": json_values, "user": json_values, "echo": json_values,
    "best_of": st.integers(-2, 4) | json_values, "top_logprobs": st.integers(-2, 25) | json_values,
    "logprobs": st.integers(-2, 25) | st.booleans() | json_values,
    "logit_bias": st.dictionaries(st.integers(-5, 2**33).map(str) | texts, floats | json_values, max_size=4) | json_values,
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"]) | json_values},
        optional={"json_schema": st.fixed_dictionaries({}, optional={"schema": schemas | json_values,
                                                                     "strict": json_values}) | json_values}) | json_values,
    "unknown_field": json_values,
}


@st.composite
def bodies(draw, base: dict):
    """`base` (a body that would be served) with up to four of its fields set to fuzzed values."""
    body = {name: draw(value) for name, value in base.items()}
    for name in draw(st.lists(st.sampled_from(sorted(common_fields)), max_size=4, unique=True)):
        body[name] = draw(common_fields[name])
    return body


completion_bodies = bodies({"model": st.just("default"), "max_tokens": st.integers(0, 8),
                            "prompt": prompt_text | st.lists(st.integers(0, 600), max_size=32) | json_values})
chat_bodies = bodies({"model": st.just("default"), "max_tokens": st.integers(0, 8), "messages": messages | json_values})


# ---- the tests ------------------------------------------------------------------------------------


@FUZZ
@given(request=generate_requests())
def test_every_generate_request_gets_a_completion_or_a_clear_client_error(stub, request):
    try:
        finish = None
        for response in stub.Generate(request, timeout=60):
            finish = response.finish if response.HasField("finish") else finish
        assert finish is not None and finish.reason in SERVED, finish
    except grpc.RpcError as e:
        assert e.code() in CLIENT_ERRORS, (e.code(), e.details())
        assert 0 < len(e.details()) < 1000, e.details()  # a message that says why, not an echo of the input


def post(mesh, path, body):
    data = json.dumps(body, allow_nan=True).encode()  # NaN and Infinity too: Python's parser takes them
    request = urllib.request.Request(f"http://{mesh.child('router').http}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def assert_openai_answer(status, content_type, body):
    if status == 200 and content_type.startswith("text/event-stream"):
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert not any("error" in json.loads(e) for e in events[:-1]), body[:500]
        return
    answer = json.loads(body)
    if status == 200:
        assert answer["choices"][0]["finish_reason"] in ("length", "stop"), answer
        return
    assert status in (400, 404, 413, 415, 429), (status, answer)
    assert 0 < len(answer["error"]["message"]) < 1000 and answer["error"]["type"] != "server_error", answer


@FUZZ
@given(body=completion_bodies)
def test_every_completions_body_gets_a_completion_or_a_4xx(mesh, body):
    assert_openai_answer(*post(mesh, "/v1/completions", body))


@FUZZ
@given(body=chat_bodies)
def test_every_chat_body_gets_a_completion_or_a_4xx(mesh, body):
    assert_openai_answer(*post(mesh, "/v1/chat/completions", body))


def test_after_the_fuzzing_every_service_is_up_and_serves(mesh, stub):
    processes = [*mesh.children, mesh.redis]
    assert all(c.process.poll() is None for c in processes), [c.name for c in processes if c.process.poll() is not None]
    request = gen.GenerateRequest(prompt="still here", sampling=gen.SamplingParams(temperature=0.0),
                                  stopping=gen.StoppingParams(max_new_tokens=4, ignore_eos=True))
    [finish] = [r.finish for r in stub.Generate(request, timeout=60) if r.HasField("finish")]
    assert finish.reason == gen.LENGTH and finish.completion_tokens == 4
