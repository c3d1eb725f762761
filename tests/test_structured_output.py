"""Structured output (`response_format`, GenerateRequest.sampling.structured_output) against a real
mesh: sampled completions are JSON that parses and validates against the schema; bad schemas are
refused naming the field; a recomputed sequence continues its grammar."""

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from kvmesh.engine import EngineConfig, LLMEngine
from kvmesh.params import SamplingParams, StoppingParams, StructuredOutput
from kvmesh.services.scheduler.core import SchedulerConfig
from kvmesh.services.scheduler.request import FinishReason
from kvmesh.tokenizer import Tokenizer
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc
from local_mesh import collect

# Bounded everywhere (string lengths, item counts, integer range), so a random model finishes it.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "active", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=f"http://{mesh.child('router').http}/v1", api_key="x", max_retries=0)


def test_twenty_sampled_chat_completions_validate_against_the_schema(client):
    def one(seed):
        return client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Describe a person."}], temperature=1.0,
            seed=seed, max_tokens=400, response_format=JSON_SCHEMA_FORMAT)

    with ThreadPoolExecutor(8) as pool:  # together, so constrained rows share batches
        answers = list(pool.map(one, range(20)))
    texts = set()
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        texts.add(choice.message.content)
    assert len(texts) > 10  # sampled, not one answer forced


def test_streamed_completion_with_a_schema_validates(client):
    stream = client.completions.create(model="default", prompt="A person:", temperature=1.0, seed=7, max_tokens=400,
                                       stream=True, extra_body={"response_format": JSON_SCHEMA_FORMAT})
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks)), PERSON)


def test_json_object_output_is_a_json_object(client):
    """Any object: a random model may write a long string, so the budget is what ends some of them;
    every one that ends by itself parses, and a cut one is still an object's beginning."""
    finished = 0
    for seed in range(8):
        choice = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "JSON please"}], temperature=1.0, seed=seed,
            max_tokens=48, response_format={"type": "json_object"}).choices[0]
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            finished += 1
    assert finished >= 1


def test_grpc_generate_takes_a_json_schema(mesh):
    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            request = gen.GenerateRequest(
                prompt="A person:", sampling=gen.SamplingParams(
                    temperature=1.0, seed=3, structured_output=gen.StructuredOutput(json_schema=json.dumps(PERSON))),
                stopping=gen.StoppingParams(max_new_tokens=400))
            return await collect(stub, request)

    _, _, text, finish = asyncio.run(run())
    assert finish.reason == gen.EOS
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("response_format, param, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}}},
     "response_format.json_schema.schema", "cannot be compiled"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema", "is required"),
    ({"type": "yaml"}, "response_format.type", "json_object or json_schema"),
])
def test_a_bad_response_format_is_a_400_naming_the_field(client, response_format, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format=response_format)
    error = e.value.body
    assert error["param"] == param and words in error["message"], error


def test_ignore_eos_with_a_response_format_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format={"type": "json_object"}, extra_body={"ignore_eos": True})
    assert e.value.body["param"] == "ignore_eos" and "response_format" in e.value.body["message"]


def test_preempted_sequences_continue_their_grammar(model_dir):
    """A KV pool too small for all of them at once: sequences are preempted and recomputed (the
    grammar replayed over their output) and still validate."""
    schema = {"type": "object", "properties": {"role": {"enum": ["admin", "user", "guest"]},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["role", "age"], "additionalProperties": False}
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=24, page_size=4,
                                    scheduler=SchedulerConfig(max_batched_tokens=64)))
    so = StructuredOutput("json_schema", json.dumps(schema))
    done = engine.generate([[5, 6, 7, 8]] * 6, [SamplingParams(temperature=1.0, seed=s, structured_output=so) for s in range(6)],
                           StoppingParams(max_new_tokens=60))
    tokenizer = Tokenizer.from_dir(model_dir)
    assert sum(d.num_preemptions for d in done) > 0
    for d in done:
        assert d.finish_reason is FinishReason.EOS
        jsonschema.validate(json.loads(tokenizer.decode(d.token_ids)), schema)
