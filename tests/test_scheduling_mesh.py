"""Scheduling under load through the mesh: KV-budget admission, chunked prefill, priorities, limits."""

import asyncio
import os
import random
import signal

import grpc
import pytest

from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc
from local_mesh import LONG_KV, LONG_REQUEST, Mesh, collect, queue_state, wait_idle
from reference import assert_matches_reference, hf_greedy


def ids_request(ids, n, priority=0):
    return gen.GenerateRequest(prompt_token_ids=gen.TokenIds(ids=ids), sampling=gen.SamplingParams(temperature=0.0),
                               stopping=gen.StoppingParams(max_new_tokens=n, ignore_eos=True), priority=priority)


def random_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def test_a_flood_of_near_maximum_context_requests_all_finish_and_return_every_page(model_dir):
    # 1 MiB of KV per worker holds 2,048 tokens: one of these 1,900-token requests at a time.
    mesh = Mesh(model_dir, extra_worker=["--kv-memory-mib", "1"])
    try:
        async def run():
            async with grpc.aio.insecure_channel(mesh.addr) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                results = await asyncio.gather(*(collect(stub, ids_request(random_ids(1880, seed=i), 20), timeout=300)
                                                 for i in range(8)))
                return results, await wait_idle(mesh.kvcache_addr)

        results, idle = asyncio.run(run())
        assert all(f.reason == gen.LENGTH and len(t) == 20 for t, _, _, f in results)
        assert all(w.used_pages == 0 and w.free_pages + w.cached_pages == w.total_pages for w in idle)
    finally:
        mesh.close()


def test_running_streams_keep_producing_while_a_long_prompt_is_prefilled_in_chunks(model_dir):
    mesh = Mesh(model_dir, workers=1, extra_scheduler=["--max-batched-tokens", "64"])
    try:
        async def run():
            async with grpc.aio.insecure_channel(mesh.addr) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                counts = [0] * 4
                long_sent = asyncio.Event()
                seen_at_long_first_token = []

                async def short(i):
                    async for response in stub.Generate(ids_request(random_ids(12, seed=100 + i), 400), timeout=120):
                        counts[i] += len(response.tokens)
                        if counts[i] == 20 and i == 0:
                            long_sent.set()

                async def long():
                    await long_sent.wait()
                    before = list(counts)
                    async for response in stub.Generate(ids_request(random_ids(1900, seed=7), 4), timeout=120):
                        if response.tokens and not seen_at_long_first_token:
                            seen_at_long_first_token.append([c - b for c, b in zip(counts, before)])

                await asyncio.gather(*(short(i) for i in range(4)), long())
                return seen_at_long_first_token[0]

        progress = asyncio.run(run())
        # 1,900 prompt tokens in chunks of at most 60 (64 minus the 4 decodes) take 32 steps or more,
        # and every one of those steps also decodes a token for each running stream.
        assert min(progress) >= 25, progress
    finally:
        mesh.close()


@pytest.fixture(scope="module")
def one_slot_mesh(long_model_dir):
    # One running request at a time, no aging, at most 3 waiting. No queue-wait limit: these tests
    # queue requests behind a blocker that would run for minutes, which the overload estimate
    # would rightly refuse (test_overload.py).
    m = Mesh(long_model_dir, workers=1, extra_worker=LONG_KV, extra_scheduler=["--max-num-seqs", "1", "--aging-s", "0",
                                                    "--max-queue-len", "3", "--max-queue-wait-s", "0"])
    yield m
    m.close()


def test_higher_priority_is_admitted_first(one_slot_mesh):
    async def run():
        async with grpc.aio.insecure_channel(one_slot_mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            order = []

            async def tracked(name, request):
                result = await collect(stub, request)
                order.append(name)
                return result

            blocker = asyncio.create_task(collect(stub, ids_request(random_ids(8, seed=1), LONG_REQUEST)))
            await queue_state(one_slot_mesh.redis_url, lambda n: n == 1)
            low = asyncio.create_task(tracked("low", ids_request(random_ids(8, seed=2), 5, priority=0)))
            await queue_state(one_slot_mesh.redis_url, lambda n: n == 2)
            high = asyncio.create_task(tracked("high", ids_request(random_ids(8, seed=3), 5, priority=5)))
            await queue_state(one_slot_mesh.redis_url, lambda n: n == 3)  # both wait behind the blocker
            blocker.cancel()
            await asyncio.gather(low, high)
            return order

    assert asyncio.run(run()) == ["high", "low"]


def test_a_full_queue_answers_resource_exhausted_with_a_retry_hint(one_slot_mesh):
    async def run():
        async with grpc.aio.insecure_channel(one_slot_mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            blocker = asyncio.create_task(collect(stub, ids_request(random_ids(8, seed=4), LONG_REQUEST)))
            await queue_state(one_slot_mesh.redis_url, lambda n: n == 1)
            queued = [asyncio.create_task(collect(stub, ids_request(random_ids(8, seed=5 + i), 3))) for i in range(3)]
            await queue_state(one_slot_mesh.redis_url, lambda n: n == 4)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, ids_request(random_ids(8, seed=9), 3))
            blocker.cancel()
            return err.value, await asyncio.gather(*queued)

    error, results = asyncio.run(run())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queue_len=3" in error.details() and "retry in about" in error.details()
    assert int(dict(error.trailing_metadata())["retry-after-ms"]) >= 1000
    assert all(f.reason == gen.LENGTH for *_, f in results)  # the queued ones were not harmed


def test_a_request_admitted_on_an_estimate_its_stalled_worker_then_misses_is_refused_for_load_and_holds_nothing(long_model_dir):
    # A worker that stalls (SIGSTOP: a swap storm, a hung device) after a request was admitted on a
    # short estimate: the request is refused when it has waited max_queue_wait_s, before anything was
    # streamed, and the worker serves again once it resumes. No health checks: nothing drains it meanwhile.
    mesh = Mesh(long_model_dir, workers=1, extra_worker=LONG_KV,
                extra_scheduler=["--max-num-seqs", "1", "--max-queue-wait-s", "2", "--health-check-interval-s", "0"])
    worker = mesh.child("worker-0").process
    try:
        async def run():
            async with grpc.aio.insecure_channel(mesh.addr) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                os.kill(worker.pid, signal.SIGSTOP)
                try:
                    blocker = asyncio.create_task(collect(stub, ids_request(random_ids(8, seed=10), 8)))
                    await queue_state(mesh.redis_url, lambda n: n == 1)  # admitted: a step of it is in flight
                    with pytest.raises(grpc.aio.AioRpcError) as err:  # 8 decode steps away: admitted, then it waits
                        await collect(stub, ids_request(random_ids(8, seed=11), 3))
                finally:
                    os.kill(worker.pid, signal.SIGCONT)
                return err.value, await blocker, await wait_idle(mesh.kvcache_addr)

        error, (tokens, *_, finish), idle = asyncio.run(asyncio.wait_for(run(), 120))
        # Not an ERROR finish: nothing was streamed, and a client retries RESOURCE_EXHAUSTED after the hint.
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in the queue without starting" in error.details()
        assert int(dict(error.trailing_metadata())["retry-after"]) >= 1
        assert finish.reason == gen.LENGTH and len(tokens) == 8  # the blocker finishes once the worker is back
        assert all(w.used_pages == 0 for w in idle)
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGCONT)
        mesh.close()


def test_a_request_longer_than_the_worker_s_whole_kv_pool_is_refused_naming_the_limit(one_slot_mesh):
    # The model's context is 131,072 tokens, but 32 MiB of KV holds 65,536: the router lets the
    # request through, and the scheduler refuses it by its worker's limit instead of queueing it forever.
    async def run():
        async with grpc.aio.insecure_channel(one_slot_mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, ids_request(random_ids(8, seed=12), 65_536 - 8 + 1))
            fits = await collect(stub, ids_request(random_ids(8, seed=12), 3))
            return err.value, fits

    error, (tokens, *_, finish) = asyncio.run(run())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_new_tokens" in error.details() and "over the context of 65536" in error.details()
    assert finish.reason == gen.LENGTH and len(tokens) == 3


def test_padded_static_batches_stream_exactly_and_return_every_page(model_dir):
    # Batches of 3: the short requests' rows keep decoding until each batch's longest ends.
    mesh = Mesh(model_dir, workers=1, extra_scheduler=["--batching", "static", "--max-num-seqs", "3"])
    lengths = [(9, 2), (15, 10), (6, 4), (20, 1), (11, 8)]  # (prompt tokens, output tokens)
    prompts = [random_ids(n, seed=40 + i) for i, (n, _) in enumerate(lengths)]
    try:
        async def run():
            async with grpc.aio.insecure_channel(mesh.addr) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                results = await asyncio.gather(*(collect(stub, ids_request(p, k)) for p, (_, k) in zip(prompts, lengths)))
                return results, await wait_idle(mesh.kvcache_addr)

        results, idle = asyncio.run(run())
        for prompt, (_, k), (tokens, logprobs, _, finish) in zip(prompts, lengths, results):
            assert finish.reason == gen.LENGTH and finish.completion_tokens == len(tokens) == k
            assert_matches_reference(tokens, logprobs, hf_greedy(model_dir, prompt, k))
        assert all(w.used_pages == 0 and w.free_pages + w.cached_pages == w.total_pages for w in idle)
    finally:
        mesh.close()
