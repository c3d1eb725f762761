"""The mesh over real gRPC and a real redis-server: streams, cancellation, stops, errors, failures."""

import asyncio
import os
import signal
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.tokenizer import Tokenizer
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc
from local_mesh import Mesh, collect, page_stats, queue_state, streams_through, wait_idle
from reference import Reference, assert_matches_reference, hf_greedy


# The scheduler plans each step after the worker's result (overlap_steps auto: off on a CPU
# worker), or plans the next step while one is out (on): every test of this mesh runs with both.
@pytest.fixture(scope="module", params=["auto", "on"], ids=lambda v: f"overlap-{v}")
def mesh(model_dir, request):
    m = Mesh(model_dir, extra_scheduler=["--overlap-steps", request.param])
    m.overlap = request.param
    yield m
    m.close()


def greedy(prompt, n, **stopping):
    return gen.GenerateRequest(prompt=prompt, sampling=gen.SamplingParams(temperature=0.0),
                               stopping=gen.StoppingParams(max_new_tokens=n, ignore_eos=True, **stopping))


def test_32_concurrent_greedy_streams_match_transformers(mesh, model_dir):
    tok = Tokenizer.from_dir(model_dir)
    words = "alpha beta gamma delta river stone light cloud north garden".split()
    prompts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 13)) for i in range(32)]

    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            return await asyncio.gather(*(collect(stub, greedy(p, 12)) for p in prompts))

    results = asyncio.run(run())
    for prompt, (tokens, logprobs, text, finish) in zip(prompts, results):
        ids = tok.encode(prompt)
        assert finish.reason == gen.LENGTH
        assert finish.prompt_tokens == len(ids) and finish.completion_tokens == len(tokens) == 12
        assert finish.total_ms >= finish.ttft_ms > 0
        assert_matches_reference(tokens, logprobs, hf_greedy(model_dir, ids, 12))
    workers = asyncio.run(wait_idle(mesh.kvcache_addr))
    assert len(workers) == 2 and all(w.used_pages == 0 for w in workers)
    assert all(w.cached_pages + w.free_pages == w.total_pages for w in workers)


def test_cancelled_and_deadline_streams_free_their_pages(mesh):
    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            calls = [stub.Generate(greedy(f"stream number {i} goes on and on", 400)) for i in range(50)]
            for call in calls:  # each has produced at least one token: it is mid-generation
                await call.read()
            busy = await page_stats(mesh.kvcache_addr)
            queued = await queue_state(mesh.redis_url, lambda n: n == 50)
            for call in calls:
                call.cancel()
            late = [stub.Generate(greedy(f"deadline {i}", 400), timeout=0.5) for i in range(5)]
            codes = []
            for call in late:
                try:
                    async for _ in call:
                        pass
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
            return busy, queued, codes, await wait_idle(mesh.kvcache_addr)

    busy, queued, codes, idle = asyncio.run(run())
    assert sum(w.used_pages for w in busy) > 0
    assert queued == 50  # Redis queue state listed every stream, running or waiting
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 5
    assert all(w.used_pages == 0 for w in idle), idle


def test_stop_string_spanning_tokens_ends_the_stream(mesh):
    async def run(request):
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            pieces = []
            async for response in stub.Generate(request, timeout=60):
                pieces += [(t.id, t.text) for t in response.tokens]
                finish = response.finish if response.HasField("finish") else None
            return pieces, finish

    pieces, _ = asyncio.run(run(greedy("garden river stone", 24)))
    text = "".join(t for _, t in pieces)
    # The last character of one token's text and the first of the next: a stop string across tokens.
    i = next(i for i in range(len(pieces) - 1) if pieces[i][1] and pieces[i + 1][1])
    stop_string = pieces[i][1][-1] + pieces[i + 1][1][0]
    stopped, finish = asyncio.run(run(greedy("garden river stone", 24, stop=[stop_string])))
    assert finish.reason == gen.STOP
    assert "".join(t for _, t in stopped) == text[: text.find(stop_string)]
    assert [t for t, _ in stopped] == [t for t, _ in pieces[: len(stopped)]]
    assert finish.completion_tokens == len(stopped)


def test_streams_ending_on_a_stop_token_mid_stream_end_there_exactly(mesh, model_dir):
    """Each stream stops on a token id its greedy output reaches at a different step: found in a
    step's result after the next step (with overlap) already computes one token more for it.
    What streams is the reference's output up to that token, and every page comes back."""
    tok = Tokenizer.from_dir(model_dir)
    prompts = [f"stop token {i} river" for i in range(12)]
    refs = [hf_greedy(model_dir, tok.encode(p), 16) for p in prompts]
    # The first position of each stream whose token did not come earlier in it: the stop there.
    stops = [next(j for j in range(i % 8, 16) if ref.token_ids[j] not in ref.token_ids[:j]) for i, ref in enumerate(refs)]

    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            return await asyncio.gather(*(collect(stub, greedy(p, 16, stop_token_ids=[ref.token_ids[j]]))
                                          for p, ref, j in zip(prompts, refs, stops))), await wait_idle(mesh.kvcache_addr)

    results, idle = asyncio.run(run())
    compared = 0
    for (tokens, logprobs, _, finish), ref, j in zip(results, refs, stops):
        assert finish.reason == gen.STOP and finish.completion_tokens == len(tokens) == j + 1, (finish, j)
        compared += assert_matches_reference(tokens, logprobs, Reference(ref.token_ids[:j + 1], ref.logits[:j + 1]))
    assert compared == sum(stops) + len(stops)
    assert all(w.used_pages == 0 for w in idle), idle
    with urllib.request.urlopen(f"http://{mesh.child('scheduler').http}/metrics", timeout=10) as response:
        metrics = text_string_to_metric_families(response.read().decode())
    ahead = sum(s.value for f in metrics if f.name == "kvmesh_steps_planned_ahead" for s in f.samples if s.name.endswith("_total"))
    if mesh.overlap == "on":
        assert ahead > 0
    else:  # auto: these CPU workers' steps are overlapped only once one's thread tuner leaves a core, which the scheduler logs
        with open(mesh.child("scheduler").log_path) as log:
            followed = "steps overlapped (its step leaves" in log.read()
        assert followed or ahead == 0, ahead


@pytest.mark.parametrize("request_kwargs, field", [
    (dict(prompt=""), "prompt"),
    (dict(prompt="hello", stopping=gen.StoppingParams(max_new_tokens=5000)), "max_new_tokens"),
    (dict(prompt="hello", stopping=gen.StoppingParams(max_new_tokens=0)), "max_new_tokens"),
    (dict(prompt="hello", sampling=gen.SamplingParams(temperature=-1)), "temperature"),
    (dict(prompt="hello", sampling=gen.SamplingParams(top_p=0)), "top_p"),
    (dict(prompt="hello", sampling=gen.SamplingParams(top_p=1.5)), "top_p"),
    (dict(prompt="hello", sampling=gen.SamplingParams(top_k=-2)), "top_k"),
])
def test_bad_input_is_invalid_argument_and_other_streams_carry_on(mesh, request_kwargs, field):
    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            good = asyncio.create_task(collect(stub, greedy("a stream that must finish", 30)))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, gen.GenerateRequest(**request_kwargs))
            return err.value, await good

    error, (tokens, _, _, finish) = asyncio.run(run())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.details()
    assert finish.reason == gen.LENGTH and len(tokens) == 30


def test_unknown_model_is_not_found(mesh):
    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            await collect(generation_pb2_grpc.GenerationStub(ch), gen.GenerateRequest(model="nope", prompt="hi"))

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(run())
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.value.details()


def test_list_models_and_tokenize(mesh, model_dir):
    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            return await stub.ListModels(gen.ListModelsRequest()), await stub.Tokenize(gen.TokenizeRequest(text="river stone"))

    models, ids = asyncio.run(run())
    assert [(m.name, m.ready_workers) for m in models.models] == [("default", 2)]
    assert list(ids.ids) == Tokenizer.from_dir(model_dir).encode("river stone")


@pytest.mark.parametrize("overlap", ["auto", "on"])
def test_a_killed_workers_streams_continue_exactly_on_another_worker(model_dir, overlap):
    mesh = Mesh(model_dir, extra_scheduler=["--overlap-steps", overlap])
    try:
        tok = Tokenizer.from_dir(model_dir)
        prompts = [f"long stream {i}" for i in range(6)]
        n = 200

        killed = []

        def kill():
            os.kill(mesh.child("worker-0").process.pid, signal.SIGKILL)
            killed.append(time.monotonic())

        async def run():
            async with grpc.aio.insecure_channel(mesh.addr) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                started = time.monotonic()
                results = await streams_through(stub, [greedy(p, n) for p in prompts], kill)
                after = await asyncio.gather(*(collect(stub, greedy(f"after {i}", 8), timeout=30) for i in range(4)))
                return results, killed[0] - started, after, await wait_idle(mesh.kvcache_addr)

        results, killed_after, after, pages = asyncio.run(asyncio.wait_for(run(), 120))
        for prompt, (tokens, logprobs, finish) in zip(prompts, results):
            # On worker-1, unless worker-0 ended it before the kill: the test kills once every stream
            # has its first token, and on a loaded machine a stream can end first (its whole life,
            # from its arrival after `started`, then fits before the kill).
            assert finish.reason == gen.LENGTH, finish
            assert finish.worker_id == "worker-1" or finish.total_ms / 1000 <= killed_after, (finish, killed_after)
            assert_matches_reference(tokens, logprobs, hf_greedy(model_dir, tok.encode(prompt), n))
        assert any(f.preemptions for _, _, f in results)  # worker-0 had some: recomputed on worker-1
        assert all(a[3].reason == gen.LENGTH and a[3].worker_id == "worker-1" for a in after)
        # Nothing leaks: the dead worker's pages are forgotten, the moved requests' pages returned.
        assert [w.worker_id for w in pages] == ["worker-1"] and pages[0].used_pages == 0
    finally:
        mesh.close()


def test_a_killed_worker_with_no_other_worker_fails_its_streams_once_nothing_takes_them_over(model_dir):
    # The router resubmits them for resume_timeout_s (here 2 s); the worker never comes back.
    mesh = Mesh(model_dir, workers=1, extra_router=["--resume-timeout-s", "2"])
    try:
        async def run():
            async with grpc.aio.insecure_channel(mesh.addr) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                calls = [stub.Generate(greedy(f"long stream {i}", 1500)) for i in range(3)]
                for call in calls:
                    await call.read()
                os.kill(mesh.child("worker-0").process.pid, signal.SIGKILL)
                errors = []
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        while (response := await call.read()) is not grpc.aio.EOF and not response.HasField("finish"):
                            pass
                    errors.append(err.value)
                return errors

        errors = asyncio.run(asyncio.wait_for(run(), 60))
        assert all(e.code() == grpc.StatusCode.UNAVAILABLE and "worker-0" in e.details()
                   and "resume_timeout_s" in e.details() for e in errors), errors
    finally:
        mesh.close()


def test_router_without_workers_is_unavailable(tmp_path, model_dir):
    from kvmesh.services.children import free_port, redis_child, serve_command, wait_ready
    import subprocess

    redis_port, port = free_port(), free_port()
    redis_server = redis_child(redis_port, str(tmp_path))
    wait_ready([redis_server], {})
    redis = redis_server.process
    router = subprocess.Popen(serve_command("router", f"redis://127.0.0.1:{redis_port}/0", port, "--model", str(model_dir),
                                            "--http-port", "0", "--no-worker-wait-s", "1"))
    try:
        async def run():
            deadline = time.monotonic() + 30
            while True:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                    try:
                        return await collect(generation_pb2_grpc.GenerationStub(ch), greedy("hi", 4), timeout=5)
                    except grpc.aio.AioRpcError as e:
                        if e.code() == grpc.StatusCode.UNAVAILABLE and "no ready worker" in (e.details() or ""):
                            raise
                        if time.monotonic() > deadline:
                            raise
                await asyncio.sleep(0.2)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(run())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        router.terminate()
        router.wait(10)
        redis.terminate()
        redis.wait(10)


def test_generate_command_streams_text_and_reports_usage(mesh, model_dir):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "kvmesh.cli", "generate", "--addr", mesh.addr, "--max-new-tokens", "6",
                           "river stone"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    tok = Tokenizer.from_dir(model_dir)
    ref = hf_greedy(model_dir, tok.encode("river stone"), 6)
    assert proc.stdout.strip() == tok.decode(ref.token_ids).strip()
    assert "completion 6 tokens" in proc.stderr and "first token" in proc.stderr


def test_a_request_id_already_in_use_is_rejected_and_the_first_stream_is_unharmed(mesh):
    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            first = greedy("the first of two", 600)
            first.request_id = "same-id"
            call = stub.Generate(first, timeout=60)
            tokens = list((await call.read()).tokens)  # it is running
            second = greedy("the second of two", 4)
            second.request_id = "same-id"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, second)
            while (response := await call.read()) is not grpc.aio.EOF:
                tokens += response.tokens
                finish = response.finish if response.HasField("finish") else None
            return err.value, tokens, finish

    error, tokens, finish = asyncio.run(run())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "same-id" in error.details()
    assert finish.reason == gen.LENGTH and len(tokens) == 600


def test_with_steps_overlapped_a_request_the_worker_fails_alone_ends_in_error_and_the_rest_exactly(model_dir):
    """A worker that fails some sequences alone (--fault-rate: the same request ids on every run)
    while the scheduler already has their next step out: each failed request ends once, with an
    ERROR finish naming the worker's reason; every other one streams transformers' tokens; every
    page comes back."""
    mesh = Mesh(model_dir, workers=1, extra_worker=["--fault-rate", "0.3"], extra_scheduler=["--overlap-steps", "on"])
    try:
        tok = Tokenizer.from_dir(model_dir)
        prompts = [f"fault {i} stone light" for i in range(16)]

        async def run():
            async with grpc.aio.insecure_channel(mesh.addr) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                results = await asyncio.gather(*(collect(stub, greedy(p, 12)) for p in prompts))
                return results, await wait_idle(mesh.kvcache_addr)

        results, idle = asyncio.run(run())
        failed = [f for _, _, _, f in results if f.reason == gen.ERROR]
        assert 0 < len(failed) < len(prompts), [f.reason for _, _, _, f in results]
        assert all("injected fault" in f.message for f in failed), failed[0]
        compared = 0
        for prompt, (tokens, logprobs, _, finish) in zip(prompts, results):
            if finish.reason == gen.LENGTH:
                compared += assert_matches_reference(tokens, logprobs, hf_greedy(model_dir, tok.encode(prompt), 12))
        assert compared == 12 * (len(prompts) - len(failed))
        assert all(w.used_pages == 0 for w in idle), idle
    finally:
        mesh.close()
