"""Traces and metrics of a real mesh: an OTLP receiver in the test collects every service's spans;
each service's /metrics is scraped over HTTP after traffic."""

import asyncio
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc
from local_mesh import Mesh, collect, wait_idle

SERVICES = {"kvmesh-router", "kvmesh-scheduler", "kvmesh-kvcache", "kvmesh-worker"}


@pytest.fixture(scope="module")
def mesh(model_dir, receiver):
    m = Mesh(model_dir, workers=2, schedulers=2, env=receiver.env)
    m.wait_split()  # one worker each: the router then chooses a scheduler by kvcache's prefix index
    yield m
    m.close()


def greedy(prompt, n):
    return gen.GenerateRequest(prompt=prompt, sampling=gen.SamplingParams(temperature=0.0),
                               stopping=gen.StoppingParams(max_new_tokens=n, ignore_eos=True))


async def generate(mesh, request, metadata=()):
    async with grpc.aio.insecure_channel(mesh.addr) as ch:
        call = generation_pb2_grpc.GenerationStub(ch).Generate(request, metadata=metadata, timeout=60)
        initial = dict(await call.initial_metadata())
        tokens, finish = [], None
        async for response in call:
            tokens.extend(t.id for t in response.tokens)
            if response.HasField("finish"):
                finish = response.finish
        return initial, tokens, finish


def by_name(spans, name):
    return [s for _, s in spans if s.name == name]


def parents_present(spans) -> bool:
    """Whether every span's parent, where it names one, is among `spans`."""
    ids = {s.span_id for _, s in spans}
    return all(s.parent_span_id in ids for _, s in spans if s.parent_span_id)


def attribute(span, key):
    values = [a.value for a in span.attributes if a.key == key]
    return values[0].string_value if values else None


def test_one_generate_is_one_trace_across_all_four_services(mesh, receiver):
    # kvcache is in it because the router looks the prompt's pages up to choose a scheduler. That
    # lookup may not answer within its 250 ms on a loaded machine (the router then routes by load,
    # and its span says so): such a request is not the case under test, and another is sent.
    n = 9
    for attempt in range(5):
        initial, tokens, finish = asyncio.run(generate(mesh, greedy(f"the trace follows every hop {attempt}", n)))
        assert len(tokens) == n and finish.trace_id and initial["kvmesh-trace-id"] == finish.trace_id
        trace_id = bytes.fromhex(finish.trace_id)
        spans = receiver.wait_for(trace_id, lambda s: len(by_name(s, "kvmesh.token_step")) >= n
                                  and len(by_name(s, "kvmesh.kv.release")) >= 1 and len(by_name(s, "kvmesh.generate")) == 1)
        outcome = attribute(by_name(spans, "kvmesh.generate")[0], "kvmesh.prefix_lookup")
        assert outcome in ("hit", "miss", "unavailable")
        if outcome != "unavailable":
            break
    assert outcome != "unavailable", "kvcache did not answer the router's lookup in time in 5 requests"
    # Each service exports its spans in batches of its own, so a child can arrive before its parent:
    # wait for every span asserted below and for every parent named so far (one that never comes
    # fails below).
    expected = ("kvmesh.kv.lookup", "kvmesh.schedule", "kvmesh.queue", "kvmesh.kv.open")
    spans = receiver.wait_for(trace_id, lambda s: all(by_name(s, name) for name in expected) and parents_present(s))
    assert {svc for svc, _ in spans} == SERVICES
    steps = by_name(spans, "kvmesh.token_step")
    assert len(steps) == n
    assert [dict((a.key, a.value) for a in s.attributes)["kvmesh.phase"].string_value for s in
            sorted(steps, key=lambda s: s.start_time_unix_nano)] == ["prefill"] + ["decode"] * (n - 1)
    for step in steps:
        attrs = {a.key for a in step.attributes}
        assert {"kvmesh.step", "kvmesh.batch_size", "kvmesh.step_tokens", "kvmesh.phase", "kvmesh.forward_ms"} <= attrs

    # Parent links: one root (kvmesh.generate); every other span's parent is in the trace.
    roots = [s for _, s in spans if not s.parent_span_id]
    assert [s.name for s in roots] == ["kvmesh.generate"]
    assert parents_present(spans)
    generate_span, = by_name(spans, "kvmesh.generate")
    schedule_span, = by_name(spans, "kvmesh.schedule")
    assert schedule_span.parent_span_id == generate_span.span_id
    for name in ("kvmesh.queue", "kvmesh.kv.open", "kvmesh.kv.release", "kvmesh.token_step"):
        assert by_name(spans, name) and all(s.parent_span_id == schedule_span.span_id for s in by_name(spans, name))
    lookup, = by_name(spans, "kvmesh.kv.lookup")
    assert lookup.parent_span_id == generate_span.span_id
    assert {a.key for a in lookup.attributes} >= {"kvmesh.prompt_pages", "kvmesh.best_prefix_pages"}
    assert {a.key for a in generate_span.attributes} >= {"kvmesh.scheduler", "kvmesh.routed_prefix_pages", "kvmesh.prefix_lookup"}

    # kvmesh.forward: one span per worker step, in the worker's own trace, linked to the request.
    forwards = receiver.linked_forwards(trace_id)
    assert len(forwards) >= n
    assert all(f.trace_id != trace_id for f in forwards)


def test_a_client_traceparent_becomes_the_parent_of_kvmesh_generate(mesh, receiver):
    trace_hex, parent_hex = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    metadata = (("traceparent", f"00-{trace_hex}-{parent_hex}-01"),)
    initial, tokens, finish = asyncio.run(generate(mesh, greedy("my own trace", 3), metadata))
    assert finish.trace_id == trace_hex == initial["kvmesh-trace-id"]
    spans = receiver.wait_for(bytes.fromhex(trace_hex), lambda s: len(by_name(s, "kvmesh.token_step")) >= 3)
    generate_span, = by_name(spans, "kvmesh.generate")
    assert generate_span.parent_span_id == bytes.fromhex(parent_hex)
    assert len(by_name(spans, "kvmesh.token_step")) == 3


def test_an_invalid_request_sets_the_error_status_on_its_span(mesh, receiver):
    trace_hex = "0af7651916cd43dd8448eb211c80319c"
    metadata = (("traceparent", f"00-{trace_hex}-b7ad6b7169203331-01"),)
    bad = gen.GenerateRequest(prompt="x", stopping=gen.StoppingParams(max_new_tokens=10**7))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(generate(mesh, bad, metadata))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = receiver.wait_for(bytes.fromhex(trace_hex), lambda s: by_name(s, "kvmesh.generate"))
    generate_span, = by_name(spans, "kvmesh.generate")
    assert generate_span.status.code == generate_span.status.STATUS_CODE_ERROR
    assert "max_new_tokens" in generate_span.status.message


def scrape(address):
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def total(samples, name, **labels):
    return sum(v for l, v in samples.get(name, []) if all(l.get(k) == want for k, want in labels.items()))


def test_after_traffic_every_service_exports_the_metrics_that_moved(mesh):
    async def traffic():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            shared = "a shared system prompt that is long enough to fill two pages of sixteen tokens each, "
            await asyncio.gather(*(collect(stub, greedy(shared + f"question {i}", 6)) for i in range(6)))
            # Six at once may all be admitted in one step, each computing the shared pages: one more after
            # them finds those pages cached.
            await collect(stub, greedy(shared + "question 6", 6))
            with pytest.raises(grpc.aio.AioRpcError):
                await collect(stub, gen.GenerateRequest(prompt="x", sampling=gen.SamplingParams(temperature=-1)))
            with pytest.raises(grpc.aio.AioRpcError):
                await collect(stub, gen.GenerateRequest(model="no-such-model", prompt="x"))

    asyncio.run(traffic())
    asyncio.run(wait_idle(mesh.kvcache_addr))
    # Each scheduler refreshes its queue gauges every half second: wait (bounded) for them to read the idle queue.
    queue_gauges = ("kvmesh_num_requests_running", "kvmesh_num_requests_waiting", "kvmesh_estimated_token_queue",
                    "kvmesh_kv_pages_held_by_finished_requests")
    deadline = time.monotonic() + 30
    while True:
        schedulers = [scrape(mesh.child(f"scheduler-{i}").http) for i in range(2)]
        if all(s.get(g) and total(s, g) == 0 for s in schedulers for g in queue_gauges) or time.monotonic() > deadline:
            break
        time.sleep(0.2)

    router = scrape(mesh.child("router").http)
    for histogram in ("kvmesh_time_to_first_token_seconds", "kvmesh_inter_token_latency_seconds",
                      "kvmesh_time_per_output_token_seconds", "kvmesh_e2e_request_latency_seconds",
                      "kvmesh_request_queue_time_seconds", "kvmesh_request_generation_tokens"):
        assert total(router, histogram + "_count") >= 6, histogram
    assert total(router, "kvmesh_request_success_total", finished_reason="length") >= 6
    assert total(router, "kvmesh_request_failure_total", code="INVALID_ARGUMENT") >= 1
    assert total(router, "kvmesh_generation_tokens_total") >= 36
    labels = {l.get("model_name") for samples in router.values() for l, _ in samples}
    assert "no-such-model" not in labels  # the label set holds served pools only

    def summed(name, **labels):
        return sum(total(scheduler, name, **labels) for scheduler in schedulers)

    for histogram in ("kvmesh_step_duration_seconds", "kvmesh_batch_size", "kvmesh_step_tokens"):
        assert summed(histogram + "_count") > 0, histogram
    assert summed("kvmesh_prefix_cache_queries_total") > 0
    assert summed("kvmesh_prefix_cache_hits_total") > 0  # later questions reuse the shared pages
    for scheduler in schedulers:  # each drives the one worker it owns
        for gauge in queue_gauges:
            assert len(scheduler[gauge]) == 1 and total(scheduler, gauge) == 0, gauge
    # Every request was looked up to choose its scheduler (the first six before their shared pages existed).
    assert total(router, "kvmesh_router_prefix_lookups_total") >= 6
    assert total(router, "kvmesh_router_prefix_lookups_total", outcome="unavailable") == 0
    assert total(router, "kvmesh_router_schedulers") == 2  # both routed to, each owning its worker

    kvcache = scrape(mesh.child("kvcache").http)
    workers = {labels["worker"] for labels, _ in kvcache["kvmesh_kv_pages_capacity"]}
    assert workers == {"worker-0", "worker-1"}
    for w in workers:
        parts = sum(total(kvcache, f"kvmesh_kv_pages_{k}", worker=w) for k in ("used", "free", "cached"))
        assert parts == total(kvcache, "kvmesh_kv_pages_capacity", worker=w) > 0
        assert total(kvcache, "kvmesh_kv_pages_used", worker=w) == 0
    assert total(kvcache, "kvmesh_kv_pages_cached") > 0

    for name in ("worker-0", "worker-1"):
        worker = scrape(mesh.child(name).http)
        assert total(worker, "kvmesh_forward_seconds_count", worker=name) > 0
        assert total(worker, "kvmesh_worker_memory_bytes", worker=name, kind="resident") > 50 << 20
        assert total(worker, "kvmesh_worker_cold_start_seconds", worker=name) > 0
