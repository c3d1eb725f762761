"""What third-party tools see of a running mesh: promtool-clean /metrics on every service with
counters at 0 from the start, cancellations counted, OpenAI-shaped 404s, gRPC reflection v1, and a
model answering to its folder's path and its --served-model-name aliases."""

import asyncio
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_reflection.v1alpha import reflection_pb2
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc
from local_mesh import Mesh, collect

ALIASES = ("alias-a", "alias-b")


@pytest.fixture(scope="module")
def mesh(model_dir):
    m = Mesh(model_dir, workers=1, extra_router=["--served-model-name", ",".join(ALIASES)])
    yield m
    m.close()


def services(mesh):
    return [c for c in mesh.children if c.service in ("router", "scheduler", "kvcache", "worker")]


def scrape(child) -> str:
    with urllib.request.urlopen(f"http://{child.http}/metrics", timeout=10) as response:
        return response.read().decode()


def check_metrics(text: str) -> None:
    """`promtool check metrics` when installed; else prometheus-client's parser plus promtool's rule
    that only counters end in `_total`."""
    if shutil.which("promtool"):
        result = subprocess.run(["promtool", "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
        assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
        return
    for family in text_string_to_metric_families(text):
        assert family.type == "counter" or not family.name.endswith("_total"), family.name


def samples(text: str) -> dict[str, list[tuple[dict, float]]]:
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(text: str, name: str, **labels) -> float | None:
    """The sum over `name`'s samples that have `labels`; None when there is no such sample."""
    found = [v for l, v in samples(text).get(name, []) if all(l.get(k) == want for k, want in labels.items())]
    return sum(found) if found else None


def test_every_service_is_promtool_clean_with_its_counters_at_zero_from_the_start(mesh):
    for child in services(mesh):
        text = scrape(child)
        check_metrics(text)
        counters = [f for f in text_string_to_metric_families(text) if f.type == "counter" and f.name.startswith("kvmesh_")]
        assert all(f.samples for f in counters), [f.name for f in counters if not f.samples]
    router = scrape(mesh.child("router"))
    for reason in ("length", "stop", "eos", "cancelled", "error"):
        assert value(router, "kvmesh_request_success_total", model_name="default", finished_reason=reason) == 0
    assert value(router, "kvmesh_request_cancelled_total", model_name="default") == 0
    assert value(router, "kvmesh_request_failure_total", model_name="default", code="RESOURCE_EXHAUSTED") == 0
    scheduler = scrape(mesh.child("scheduler"))
    for counter in ("kvmesh_num_preemptions_total", "kvmesh_prefix_cache_queries_total", "kvmesh_prefix_cache_hits_total"):
        assert value(scheduler, counter, model_name="default", worker="worker-0") == 0, counter


def test_after_traffic_and_a_cancel_metrics_stay_clean_and_count_the_cancel(mesh):
    async def traffic():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            await asyncio.gather(*(collect(stub, gen.GenerateRequest(
                prompt=f"question {i}", sampling=gen.SamplingParams(temperature=0),
                stopping=gen.StoppingParams(max_new_tokens=5, ignore_eos=True))) for i in range(3)))
            call = stub.Generate(gen.GenerateRequest(prompt="a long one", stopping=gen.StoppingParams(
                max_new_tokens=1500, ignore_eos=True)))
            await call.read()  # it runs; then the client leaves
            call.cancel()

    asyncio.run(traffic())
    deadline = time.monotonic() + 30
    while (value(scrape(mesh.child("router")), "kvmesh_request_cancelled_total", model_name="default") or 0) < 1:
        assert time.monotonic() < deadline, "the cancelled request was not counted"
        time.sleep(0.2)
    router = scrape(mesh.child("router"))
    for histogram in ("kvmesh_request_prefill_time_seconds", "kvmesh_request_decode_time_seconds",
                      "kvmesh_request_inference_time_seconds", "kvmesh_request_params_max_tokens"):
        assert value(router, histogram + "_count", model_name="default") >= 3, histogram
    assert value(router, "kvmesh_request_params_max_tokens_sum", model_name="default") >= 15
    for child in services(mesh):
        check_metrics(scrape(child))


@pytest.mark.parametrize("method, path, status", [("POST", "/v1/embeddings", 404), ("GET", "/v1/responses", 404),
                                                  ("GET", "/v1/completions", 405)])
def test_unknown_paths_and_methods_answer_openai_shaped_json(mesh, method, path, status):
    request = urllib.request.Request(f"http://{mesh.child('router').http}{path}", method=method,
                                     data=b"{}" if method == "POST" else None, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == status
    assert e.value.headers["Content-Type"].startswith("application/json")
    error = json.loads(e.value.read())["error"]
    assert error["message"] == f"Invalid URL ({method} {path})"
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"


def test_openai_client_sees_a_not_found_error_for_embeddings(mesh):
    client = openai.OpenAI(base_url=f"http://{mesh.child('router').http}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="default", input="hi")
    assert "Invalid URL" in e.value.body["message"]


@pytest.mark.parametrize("service", ["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"])
def test_reflection_v1_and_v1alpha_list_the_services(mesh, service):
    async def list_services(address):
        async with grpc.aio.insecure_channel(address) as ch:
            info = ch.stream_stream(f"/{service}/ServerReflectionInfo",
                                    request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                    response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
            requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                        reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvmesh.v1.Generation")]
            return [r async for r in info(iter(requests))]

    listed, described = asyncio.run(list_services(mesh.addr))
    names = {s.name for s in listed.list_services_response.service}
    assert {"kvmesh.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} <= names
    assert described.file_descriptor_response.file_descriptor_proto  # grpcurl can describe and call


def test_a_model_answers_to_its_folder_path_and_its_aliases(mesh, model_dir):
    client = openai.OpenAI(base_url=f"http://{mesh.child('router').http}/v1", api_key="x", max_retries=0)
    names = ["default", str(model_dir), *ALIASES]
    assert [m.id for m in client.models.list().data] == names
    for name in names:
        answer = client.completions.create(model=name, prompt="hello", max_tokens=2, temperature=0)
        assert answer.model == name and answer.usage.completion_tokens >= 1
        assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="alias-c", prompt="hello", max_tokens=2)

    async def list_models():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            return await generation_pb2_grpc.GenerationStub(ch).ListModels(gen.ListModelsRequest())

    [info] = asyncio.run(list_models()).models
    assert info.name == "default" and list(info.aliases) == names[1:]
