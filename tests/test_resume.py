"""Streams survive the death of their scheduler, worker or router (issue 14, items 3-4).

Real processes, real SIGKILL, a real redis-server. A killed scheduler or worker: the router
resubmits each request with the tokens already streamed, and the client's stream goes on. A
killed router: the client reconnects to another router with its request_id and the number of
tokens it has, and the scheduler, which held the request meanwhile, streams the rest. Every
stream is compared token by token with an undisturbed run of the same requests (which is itself
compared with transformers), so a lost or repeated token anywhere fails the test.
"""

import asyncio
import json
import os
import signal
import subprocess
import time

import grpc
import aiohttp
import pytest
import redis

from kvmesh import client
from kvmesh.services.children import free_port, service_child
from kvmesh.services.registry import request_holder_key
from kvmesh.tokenizer import Tokenizer
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc
from local_mesh import LONG_KV, LONG_REQUEST, Mesh, page_stats, queue_state, wait_idle
from reference import assert_matches_reference, hf_greedy

GRACE_S = 8.0  # the scheduler's detach_grace_s here: long enough to reconnect under load, short to wait out
N_STREAMS = 16
RECOVER_S = 120  # generous: the machine may be loaded
REFERENCE_TOKENS = 256  # of each undisturbed stream, compared with transformers


@pytest.fixture(scope="module")
def mesh(long_model_dir):
    m = Mesh(long_model_dir, extra_worker=LONG_KV, extra_scheduler=["--detach-grace-s", str(GRACE_S)])
    # A second router: clients of a killed router reconnect through it.
    m.router2 = service_child("router-2", "router", "", m.redis_url, free_port(), ["--model", str(long_model_dir)],
                              m.log_dir, dict(os.environ, PYTHONUNBUFFERED="1"))
    wait_serving(m.router2)
    yield m
    m.router2.process.kill()
    m.router2.process.wait()
    m.close()


def wait_serving(child, timeout=RECOVER_S):
    deadline = time.monotonic() + timeout
    while not child.serving(timeout_s=1):
        assert child.process.poll() is None, f"{child.name} exited: see {child.log_path}"
        assert time.monotonic() < deadline, f"{child.name} did not serve within {timeout}s"
        time.sleep(0.2)


def greedy(i, request_id=""):
    """Stream i's request; odd streams take their tokens four a message (a stream interval), so the
    tokens a router holds for a client must come through every fault exactly too. Long enough that
    no stream ends before the last one's first message, with one worker just restarted (its first
    steps slow while its thread tuner tries teams and its pool is backed) on a loaded machine: at
    256 tokens the 16 streams took 1.9 s (3.4-4.2 s through a fault) beside two spinning processes
    on a Zen 5, and in one whole-suite run so loaded a stream ended before the last one's first
    message."""
    return gen.GenerateRequest(prompt=f"stream {i} walks by the river stone", request_id=request_id,
                               sampling=gen.SamplingParams(temperature=0.0), stream_interval=4 if i % 2 else 0,
                               stopping=gen.StoppingParams(max_new_tokens=3 * REFERENCE_TOKENS + 8 * i, ignore_eos=True))


def seeded(request_id=""):
    return gen.GenerateRequest(prompt="a seeded walk in the garden", request_id=request_id,
                               sampling=gen.SamplingParams(temperature=0.9, top_k=50, seed=1234),
                               stopping=gen.StoppingParams(max_new_tokens=120, ignore_eos=True))


class Stream:
    """What a client received on one (possibly reconnected) stream."""

    def __init__(self):
        self.tokens, self.logprobs, self.texts, self.finish = [], [], [], None

    def take(self, response):
        for t in response.tokens:
            self.tokens.append(t.id)
            self.logprobs.append(t.logprob)
            self.texts.append(t.text)
        if response.HasField("finish"):
            assert self.finish is None, "two finish messages"
            self.finish = response.finish

    @property
    def text(self):
        return "".join(self.texts)


async def stream_all(stubs, requests, fault=None):
    """Runs `requests` through kvmesh.client (reconnecting over `stubs`); once every stream has
    received a message, calls `fault()`. Returns the Streams and what `fault` returned."""
    streams = [Stream() for _ in requests]
    heard = [asyncio.Event() for _ in requests]

    async def one(request, stream, event):
        async for response in client.generate(stubs, request, timeout=RECOVER_S):
            stream.take(response)
            event.set()

    tasks = [asyncio.create_task(one(r, s, e)) for r, s, e in zip(requests, streams, heard)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in heard)), RECOVER_S)
    assert not any(t.done() for t in tasks), "a stream ended before the fault: make the streams longer"
    outcome = fault() if fault else None
    if asyncio.iscoroutine(outcome):
        outcome = await outcome
    await asyncio.gather(*tasks)
    return streams, outcome


@pytest.fixture(scope="module")
def undisturbed(mesh, long_model_dir):
    """The 16 greedy streams without a fault, each checked against transformers over its first
    REFERENCE_TOKENS + 8i tokens (the faulted runs are compared with all of it, token by token)."""
    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            return (await stream_all([generation_pb2_grpc.GenerationStub(ch)], [greedy(i) for i in range(N_STREAMS)]))[0]

    streams = asyncio.run(run())
    tok = Tokenizer.from_dir(long_model_dir)
    compared = 0
    total = 0
    for i, s in enumerate(streams):
        assert s.finish.reason == gen.LENGTH and s.finish.resumes == 0
        assert len(s.tokens) == greedy(i).stopping.max_new_tokens
        n = REFERENCE_TOKENS + 8 * i
        compared += assert_matches_reference(s.tokens[:n], s.logprobs[:n],
                                             hf_greedy(long_model_dir, tok.encode(greedy(i).prompt), n))
        total += n
    print(f"compared {compared} of {total} tokens with transformers")
    assert compared >= total // 2
    return streams


def lost_and_repeated(got, want):
    """(tokens missing, tokens extra) of `got` against the undisturbed `want`, after their common prefix."""
    common = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return len(want) - common, len(got) - common


def assert_exact(streams, undisturbed, min_resumes=1):
    for i, (got, want) in enumerate(zip(streams, undisturbed)):
        assert lost_and_repeated(got.tokens, want.tokens) == (0, 0), f"stream {i}"
        assert got.text == want.text, f"stream {i}: the text differs"
        for a, b in zip(got.logprobs, want.logprobs):
            assert abs(a - b) < 1e-3
        assert got.finish.reason == gen.LENGTH and got.finish.completion_tokens == len(want.tokens)
        assert got.finish.resumes >= min_resumes, f"stream {i} was not resumed: {got.finish}"


async def all_pages_returned(mesh):
    idle = await wait_idle(mesh.kvcache_addr, timeout=RECOVER_S, workers=2)
    assert len(idle) == 2 and all(w.used_pages == 0 for w in idle), idle
    assert all(w.cached_pages + w.free_pages == w.total_pages for w in idle), idle


def kill(*children):
    for child in children:
        os.kill(child.process.pid, signal.SIGKILL)
    for child in children:
        child.process.wait()


async def recovery(stub, killed, children):
    """Restarts `children` (killed) on their ports and times, from the kill, the first new request
    to succeed and the children serving again."""
    for child in children:
        child.start()
    new_request = time.monotonic()
    response = None
    while response is None:
        try:
            response = await collect_one(stub, gen.GenerateRequest(
                prompt="a new request", sampling=gen.SamplingParams(temperature=0.0),
                stopping=gen.StoppingParams(max_new_tokens=4, ignore_eos=True)))
        except grpc.aio.AioRpcError:
            assert time.monotonic() - killed < RECOVER_S
            await asyncio.sleep(0.1)
    served_after = time.monotonic() - killed
    await asyncio.to_thread(lambda: [wait_serving(c) for c in children])
    back_after = time.monotonic() - killed
    print(f"new request sent {new_request - killed:.1f}s after the kill served after {served_after:.1f}s; "
          f"{', '.join(c.name for c in children)} back after {back_after:.1f}s")
    return served_after, back_after


async def collect_one(stub, request):
    s = Stream()
    async for response in stub.Generate(request, timeout=RECOVER_S):
        s.take(response)
    assert s.finish.reason == gen.LENGTH
    return s


def report(row):
    """Appends a measured row for docs/reliability.md to the file KVMESH_RELIABILITY_ROWS names."""
    if path := os.environ.get("KVMESH_RELIABILITY_ROWS"):
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def router_resumes(mesh) -> dict[str, float]:
    """The router's kvmesh_router_resumes_total by cause."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{mesh.child('router').http}/metrics", timeout=10).read().decode()
    return {s.labels["cause"]: s.value for f in text_string_to_metric_families(text) if f.name == "kvmesh_router_resumes"
            for s in f.samples if s.name.endswith("_total")}


def faulted_run(mesh, undisturbed, names, min_resumes=1):
    """16 streams; `names` killed once every stream has its first message, restarted on their ports.
    A worker's or kvcache's death is no resume for the router (the scheduler moves a dead worker's
    requests itself): `min_resumes` says how many each stream must show."""
    children = [mesh.child(n) for n in names]

    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)

            async def fault():
                kill(*children)
                return await recovery(stub, time.monotonic(), children)

            streams, (served, back) = await stream_all([stub], [greedy(i) for i in range(N_STREAMS)], fault)
            await all_pages_returned(mesh)
            return streams, served, back

    before = router_resumes(mesh)
    streams, served, back = asyncio.run(run())
    assert_exact(streams, undisturbed, min_resumes)
    if "scheduler" in names:  # the router counts every resume its streams report, by cause
        after = router_resumes(mesh)
        assert after["scheduler"] + after["worker"] - before["scheduler"] - before["worker"] == \
            sum(s.finish.resumes for s in streams) > 0, (before, after)
    lost = sum(lost_and_repeated(s.tokens, u.tokens)[0] for s, u in zip(streams, undisturbed))
    repeated = sum(lost_and_repeated(s.tokens, u.tokens)[1] for s, u in zip(streams, undisturbed))
    report({"killed": " + ".join(names), "completed": sum(s.finish.reason == gen.LENGTH for s in streams),
            "streams": len(streams), "lost": lost, "repeated": repeated, "new_request_s": round(served, 1),
            "back_s": round(back, 1)})


def test_a_killed_scheduler_s_streams_continue_exactly(mesh, undisturbed):
    faulted_run(mesh, undisturbed, ["scheduler"])


def test_a_worker_and_the_scheduler_killed_at_once_lose_no_stream(mesh, undisturbed):
    faulted_run(mesh, undisturbed, ["scheduler", "worker-0"])


def test_a_killed_worker_s_streams_continue_exactly_on_the_other(mesh, undisturbed):
    faulted_run(mesh, undisturbed, ["worker-0"], min_resumes=0)


def test_streams_continue_exactly_through_a_kvcache_kill(mesh, undisturbed):
    faulted_run(mesh, undisturbed, ["kvcache"], min_resumes=0)


def test_a_scheduler_killed_twice_in_a_row_loses_no_token(mesh):
    """One long greedy stream; the scheduler is killed, restarted, killed again once the stream has
    moved on, and restarted. The client stops reading after that; what it got equals an undisturbed
    run of that many tokens."""
    request = gen.GenerateRequest(prompt="a stream through two scheduler deaths", sampling=gen.SamplingParams(temperature=0.0),
                                  stopping=gen.StoppingParams(max_new_tokens=LONG_REQUEST, ignore_eos=True))
    scheduler = mesh.child("scheduler")

    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            faulted = Stream()
            call = stub.Generate(request, timeout=RECOVER_S)
            kills = []

            async def read_until(n):
                while len(faulted.tokens) < n:
                    faulted.take(await call.read())

            await read_until(1)
            for _ in range(2):
                kill(scheduler)
                kills.append(len(faulted.tokens))
                scheduler.start()
                await read_until(len(faulted.tokens) + 32)  # resumed on the restarted scheduler, and on its way
            call.cancel()
            calm = gen.GenerateRequest()
            calm.CopyFrom(request)
            calm.stopping.max_new_tokens = len(faulted.tokens)
            undisturbed = await collect_one(stub, calm)
            await all_pages_returned(mesh)
            return faulted, undisturbed, kills

    faulted, undisturbed, kills = asyncio.run(run())
    assert lost_and_repeated(faulted.tokens, undisturbed.tokens) == (0, 0)
    assert faulted.text == undisturbed.text
    assert all(abs(a - b) < 1e-3 for a, b in zip(faulted.logprobs, undisturbed.logprobs))
    assert kills[0] < kills[1] < len(faulted.tokens), kills  # each kill interrupted the stream mid-way


def test_a_seeded_sampled_stream_through_a_scheduler_kill_equals_the_undisturbed_one(mesh):
    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            calm = await collect_one(stub, seeded())
            scheduler = mesh.child("scheduler")

            async def fault():
                kill(scheduler)
                scheduler.start()

            [hit], _ = await stream_all([stub], [seeded()], fault)
            await asyncio.to_thread(wait_serving, scheduler)
            return calm, hit

    calm, hit = asyncio.run(run())
    assert len(calm.tokens) == 120 and calm.finish.resumes == 0
    assert hit.tokens == calm.tokens and hit.text == calm.text
    assert hit.finish.resumes >= 1


def test_clients_of_a_killed_router_resume_through_another_with_their_request_id(mesh, undisturbed):
    router = mesh.child("router")
    http_port = int(router.http.rsplit(":", 1)[1])

    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch1, grpc.aio.insecure_channel(mesh.router2.address) as ch2:
            stubs = [generation_pb2_grpc.GenerationStub(ch1), generation_pb2_grpc.GenerationStub(ch2)]
            # An OpenAI client on the same router cannot resume: it fails, and leaves nothing behind.
            body = {"model": "default", "prompt": "an http stream", "max_tokens": LONG_REQUEST, "stream": True,
                    "temperature": 0, "ignore_eos": True}
            http = aiohttp.ClientSession()
            http_stream = await http.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body)
            assert http_stream.status == 200 and (await http_stream.content.readline()).startswith(b"data:")
            killed = []

            def fault():
                kill(router)
                killed.append(time.monotonic())

            requests = [greedy(i, request_id=f"resume-{i}-{time.monotonic_ns()}") for i in range(N_STREAMS)]
            streams, _ = await stream_all(stubs, requests, fault)
            with pytest.raises(aiohttp.ClientError):
                async for _ in http_stream.content:
                    pass
            await http.close()
            await all_pages_returned(mesh)
            router.start()
            await asyncio.to_thread(wait_serving, router)
            return streams, time.monotonic() - killed[0]

    streams, back = asyncio.run(run())
    assert_exact(streams, undisturbed)
    report({"killed": "router (clients reconnect to a second router)", "completed": len(streams),
            "streams": len(streams), "lost": 0, "repeated": 0, "new_request_s": 0.0, "back_s": round(back, 1)})


OLD_GRACE_S = 2.0  # what SIGTERM gave a router's gRPC calls in flight before --drain-s


def test_a_router_stopped_for_a_rolling_update_takes_no_new_calls_and_lets_those_in_flight_go_on(mesh):
    """SIGTERM, as an orchestrator replacing the router sends it: both ports stop taking calls
    (a new gRPC call is UNAVAILABLE, the HTTP port refuses connections) while the streams in
    flight on both go on, past the 2 s gRPC calls were given before; once the last one ends the
    router exits 0 without waiting out --drain-s (30 s)."""
    router = mesh.child("router")
    http_port = int(router.http.rsplit(":", 1)[1])
    in_flight = gen.GenerateRequest(prompt="a stream through a rolling update", sampling=gen.SamplingParams(temperature=0.0),
                                    stopping=gen.StoppingParams(max_new_tokens=LONG_REQUEST, ignore_eos=True))
    probe = gen.GenerateRequest(prompt="a probe", stopping=gen.StoppingParams(max_new_tokens=1))
    body = {"model": "default", "prompt": "an http stream through a rolling update", "max_tokens": LONG_REQUEST,
            "stream": True, "temperature": 0, "ignore_eos": True}

    async def refused_grpc(stub):
        try:
            async for _ in stub.Generate(probe, timeout=RECOVER_S):
                pass
        except grpc.aio.AioRpcError as e:
            # A call that reached the server just as it began to shut down, before grpc handed it to
            # a handler, ends CANCELLED (gRPC core: grpc/grpc#41785); probe again: calls made after
            # the shutdown began must be UNAVAILABLE, which clients retry elsewhere.
            if e.code() == grpc.StatusCode.CANCELLED:
                return False
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            return True
        return False

    async def refused_http():
        try:
            async with aiohttp.ClientSession() as fresh, fresh.get(f"http://127.0.0.1:{http_port}/health"):
                return False
        except aiohttp.ClientConnectorError:
            return True

    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch, aiohttp.ClientSession() as http:
            stub = generation_pb2_grpc.GenerationStub(ch)
            call = stub.Generate(in_flight, timeout=RECOVER_S)
            grpc_stream = Stream()
            grpc_stream.take(await call.read())
            http_stream = await http.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body)
            assert http_stream.status == 200 and (await http_stream.content.readline()).startswith(b"data:")
            signalled = time.monotonic()
            router.process.send_signal(signal.SIGTERM)
            grpc_refused = http_refused = False
            while not (grpc_refused and http_refused):  # the stop takes a moment to begin
                assert time.monotonic() - signalled < RECOVER_S, "the stopping router still takes new calls"
                grpc_refused = grpc_refused or await refused_grpc(generation_pb2_grpc.GenerationStub(ch))
                http_refused = http_refused or await refused_http()
            refused = time.monotonic()
            read = {"grpc": 0, "http": 0}

            async def read_grpc():
                while time.monotonic() - refused < OLD_GRACE_S + 3:
                    response = await call.read()
                    assert response is not grpc.aio.EOF and not response.HasField("finish"), response
                    read["grpc"] += len(response.tokens)

            async def read_http():
                while time.monotonic() - refused < OLD_GRACE_S + 3:
                    line = await http_stream.content.readline()
                    assert line, "the HTTP stream was cut"
                    if line.startswith(b"data:"):
                        chunk = json.loads(line[5:])  # an error or the end would fail here
                        assert chunk["choices"][0]["finish_reason"] is None, chunk
                        read["http"] += 1

            await asyncio.gather(read_grpc(), read_http())
            call.cancel()
            http_stream.close()
            exited = await asyncio.to_thread(router.process.wait, RECOVER_S)
            return read, exited, time.monotonic() - signalled

    try:
        read, exited, stopped_s = asyncio.run(run())
    finally:  # the module's other tests need a router, whatever happened here
        if router.process.poll() is None:  # its streams went with run()'s channel, so its drain ends
            try:
                router.process.wait(RECOVER_S)
            except subprocess.TimeoutExpired:  # never signalled, or stuck: the next test needs the port
                router.process.kill()
                router.process.wait()
        router.start()
        wait_serving(router)
    assert read["grpc"] > 0 and read["http"] > 0, read  # both streams went on after new calls were refused
    assert exited == 0
    assert stopped_s < 30, stopped_s  # it ended when its last call did, not at the end of --drain-s


def test_a_whole_mesh_stopped_at_once_with_streams_open_stops_without_being_killed(long_model_dir):
    """Ctrl-C on `kvmesh up`: every service gets SIGTERM at once. The router's streams lose their
    scheduler; a stopping router does not resubmit them (that would be new work, and would keep
    its drain waiting for resume_timeout_s): each ends UNAVAILABLE, and every process exits on its
    own (code 0) before stop()'s SIGKILL, 10 s later. A stream whose router held tokens for it (a
    stream interval it had not reached) gets them before its UNAVAILABLE: the tokens produced are
    the client's whatever ends the stream (the router's gap rule is off here, so only the error
    can have sent them)."""
    m = Mesh(long_model_dir, workers=1, extra_worker=LONG_KV, extra_router=["--stream-interval-max-gap-ms", "0"])

    def request(interval):
        return gen.GenerateRequest(prompt="a stream open at Ctrl-C", sampling=gen.SamplingParams(temperature=0.0),
                                   stream_interval=interval,
                                   stopping=gen.StoppingParams(max_new_tokens=LONG_REQUEST, ignore_eos=True))

    async def read_until_error(call, tokens):
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while (response := await call.read()) is not grpc.aio.EOF:
                tokens += [t.id for t in response.tokens]
        return ended.value

    async def run():
        async with grpc.aio.insecure_channel(m.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            # Same prompt, same batch: the held stream has about as many tokens as the one streaming
            # each token, which shows the run has gone on past the first few.
            each, held = stub.Generate(request(1), timeout=RECOVER_S), stub.Generate(request(100_000), timeout=RECOVER_S)
            each_tokens = [t.id for t in (await each.read()).tokens]
            held_tokens = [t.id for t in (await held.read()).tokens]  # the first token comes at once
            while len(each_tokens) < 8:
                each_tokens += [t.id for t in (await each.read()).tokens]
            await asyncio.to_thread(m.close)
            return (await read_until_error(each, each_tokens), await read_until_error(held, held_tokens),
                    each_tokens, held_tokens)

    try:
        ended, held_ended, each_tokens, held_tokens = asyncio.run(run())
    finally:
        m.close()
    assert ended.code() == grpc.StatusCode.UNAVAILABLE, ended
    assert held_ended.code() == grpc.StatusCode.UNAVAILABLE, held_ended
    # The first token, then those held until the error: more than the one sent at once, and the same
    # greedy tokens as the other stream's.
    n = min(len(each_tokens), len(held_tokens))
    assert len(held_tokens) > 1 and n > 1, (len(held_tokens), len(each_tokens))
    assert held_tokens[:n] == each_tokens[:n]
    assert {c.name: c.process.returncode for c in m.children} == {c.name: 0 for c in m.children}


def test_a_request_never_resumed_is_cancelled_after_the_grace_period_and_frees_its_pages(mesh):
    request_id = f"abandoned-{time.monotonic_ns()}"
    request = gen.GenerateRequest(prompt="a stream nobody comes back for", request_id=request_id,
                                  sampling=gen.SamplingParams(temperature=0.0),
                                  stopping=gen.StoppingParams(max_new_tokens=LONG_REQUEST, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            call = stub.Generate(request)
            received = len((await call.read()).tokens)
            call.cancel()  # the client goes away for good
            left = time.monotonic()
            # Held: it keeps running, holding its pages, until the grace period ends.
            running_midway = await queue_state(mesh.redis_url, lambda n: n == 1, timeout=1)
            # The scheduler ships its page operations to kvcache after each step: wait for them (bounded, within the grace).
            deadline = time.monotonic() + GRACE_S / 2
            while (in_use_midway := sum(w.used_pages for w in await page_stats(mesh.kvcache_addr))) == 0 \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            # Cancelled at the grace period's end (it could run for minutes): its holder key goes,
            # and then a resume finds nothing.
            holder = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
            deadline = left + GRACE_S + RECOVER_S
            while holder.exists(request_holder_key(request_id)) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            holder.close()
            cancelled_after = time.monotonic() - left
            await queue_state(mesh.redis_url, lambda n: n == 0, timeout=RECOVER_S)
            idle = await wait_idle(mesh.kvcache_addr, timeout=RECOVER_S)
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                late = gen.GenerateRequest()
                late.CopyFrom(request)
                late.resume_from = received
                async for _ in stub.Generate(late, timeout=30):
                    pass
            return running_midway, in_use_midway, cancelled_after, idle, gone.value

    running_midway, in_use_midway, cancelled_after, idle, gone = asyncio.run(run())
    assert running_midway == 1 and in_use_midway > 0
    assert GRACE_S <= cancelled_after < GRACE_S + RECOVER_S
    assert all(w.used_pages == 0 for w in idle), idle
    assert gone.code() == grpc.StatusCode.NOT_FOUND and request_id in gone.details()


def test_a_client_resumes_its_request_by_request_id_over_an_mtls_mesh(model_dir, tmp_path):
    from kvmesh.services.launcher import MeshTLS
    from kvmesh.services.tls import MeshCertificates

    tls_mesh = Mesh(model_dir, workers=1, tls=MeshTLS(MeshCertificates.create(tmp_path / "mesh")))
    request = gen.GenerateRequest(prompt="a stream over mutual TLS", request_id="tls-resume",
                                  sampling=gen.SamplingParams(temperature=0.0),
                                  stopping=gen.StoppingParams(max_new_tokens=96, ignore_eos=True))
    try:
        async def run():
            async with grpc.aio.insecure_channel(tls_mesh.addr) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                calm = gen.GenerateRequest()
                calm.CopyFrom(request)
                calm.request_id = ""
                undisturbed = await collect_one(stub, calm)
                head, call = Stream(), stub.Generate(request)
                head.take(await call.read())
                call.cancel()  # the connection drops; the scheduler holds the request
                resumed = gen.GenerateRequest()
                resumed.CopyFrom(request)
                resumed.resume_from = len(head.tokens)
                rest = await collect_one(stub, resumed)
                return undisturbed, head, rest

        undisturbed, head, rest = asyncio.run(asyncio.wait_for(run(), RECOVER_S))
        assert head.tokens and head.tokens + rest.tokens == undisturbed.tokens
        assert head.text + rest.text == undisturbed.text
        assert rest.finish.resumes == 1 and rest.finish.completion_tokens == 96
    finally:
        tls_mesh.close()
