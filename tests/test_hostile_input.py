"""Hostile input against a running mesh: every service checks what it is sent.

Each attack of issue 15 is sent straight to the service it targets (the scheduler's Submit, the
router's Generate, the kvcache's Publish) while a normal greedy request streams on the one worker,
so that anything the attack got into would share its batch. Each attack is refused with
INVALID_ARGUMENT naming the field and the limit (or answered without harm), and the normal
request finishes with the tokens transformers gives.

Every test runs on a plaintext mesh and on one with mTLS. With mTLS an attacker without the mesh's
certificate is refused on every internal port (UNAVAILABLE: it never gets to send a message), so
there the attacks come from a peer holding a mesh certificate: a compromised or buggy service,
which is what each service's own validation is for.
"""

import asyncio
import json
import math
import urllib.error
import urllib.request

import grpc
import psutil
import pytest

from kvmesh.params import MAX_REQUEST_ID_CHARS
from kvmesh.services.launcher import MeshTLS
from kvmesh.services.tls import MeshCertificates, mesh_channel
from kvmesh.tokenizer import Tokenizer
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from local_mesh import Mesh, page_stats, read_rest, wait_idle
from reference import assert_matches_reference, hf_greedy

NORMAL_TOKENS = 200  # long enough to still be streaming while the attacks are answered
MIN_COMPARED = 16


@pytest.fixture(scope="module", params=["plaintext", "mtls"])
def mesh(model_dir, request, tmp_path_factory):
    """A one-worker mesh; `peer` is the identity internal calls are made with (a mesh certificate
    under mTLS: the compromised peer; None on the plaintext mesh, where anyone is a peer)."""
    certs = MeshCertificates.create(tmp_path_factory.mktemp("hostile-tls")) if request.param == "mtls" else None
    m = Mesh(model_dir, workers=1, tls=MeshTLS(certs))
    m.peer = certs.identity("client") if certs else None
    yield m
    m.close()


def peer_channel(mesh, address):
    """A channel to an internal service, as a peer of the mesh."""
    return mesh_channel(address, mesh.peer)


@pytest.fixture(scope="module")
def normal_prompt(model_dir):
    return Tokenizer.from_dir(model_dir).encode("a normal request streams beside the attack")


@pytest.fixture(scope="module")
def reference(model_dir, normal_prompt):
    return hf_greedy(model_dir, normal_prompt, NORMAL_TOKENS)


def normal_request(prompt_ids):
    return gen.GenerateRequest(prompt_token_ids=gen.TokenIds(ids=prompt_ids), sampling=gen.SamplingParams(temperature=0.0),
                               stopping=gen.StoppingParams(max_new_tokens=NORMAL_TOKENS, ignore_eos=True))


async def beside_a_normal_request(mesh, prompt_ids, attacks):
    """Starts the normal request, waits for its first token, awaits each attack (a coroutine
    function returning what it saw), then reads the normal stream to its end.
    Returns (what each attack saw, whether the normal stream was still open after the attacks,
    the normal stream's tokens, logprobs and finish)."""
    async with grpc.aio.insecure_channel(mesh.addr) as ch:
        call = generation_pb2_grpc.GenerationStub(ch).Generate(normal_request(prompt_ids), timeout=120)
        head = await call.read()
        seen = [await attack() for attack in attacks]
        still_streaming = call.done() is False
        tokens, logprobs, finish = await read_rest(call, head)
    return seen, still_streaming, tokens, logprobs, finish


def assert_finished_exact(tokens, logprobs, finish, reference):
    assert finish.reason == gen.LENGTH and finish.message == ""
    assert len(tokens) == NORMAL_TOKENS
    compared = assert_matches_reference(tokens, logprobs, reference)
    assert compared >= MIN_COMPARED, f"only {compared} tokens compared"


async def code_of(call) -> tuple[grpc.StatusCode, str]:
    """The status a call ends with (OK once it ran to its end) and its details."""
    try:
        async for _ in call:
            pass
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""


# -- scheduler: it trusts no caller ----------------------------------------------------------


def submit(prompt_ids, request_id="", **sampling):
    return scheduler_pb2.SubmitRequest(
        request_id=request_id, prompt_token_ids=prompt_ids, sampling=gen.SamplingParams(seed=1, **sampling),
        stopping=gen.StoppingParams(max_new_tokens=8, ignore_eos=True))


SUBMIT_ATTACKS = [
    (submit([5, 6, 999_999], temperature=0.0), "prompt_token_ids", "token id 999999 is outside the vocabulary"),
    (submit([5, 6, 7], temperature=math.nan), "temperature", "must be in [0, 100]"),
    (submit([5, 6, 7], temperature=math.inf), "temperature", "must be in [0, 100]"),
    (submit([5, 6, 7], temperature=1.0, repetition_penalty=1e-45), "repetition_penalty", "must be in [0.01, 2]"),
    (submit([5, 6, 7], "r" * 1_000_000, temperature=0.0), "request_id", f"over the limit of {MAX_REQUEST_ID_CHARS}"),
    (submit([5] * 100_000, temperature=0.0), "prompt", "over the context of"),
]


def test_submit_straight_to_the_scheduler_is_validated_and_the_batch_carries_on(mesh, normal_prompt, reference):
    def attack(request):
        async def send():
            async with peer_channel(mesh, mesh.child("scheduler").address) as ch:
                return await code_of(scheduler_pb2_grpc.SchedulerStub(ch).Submit(request, timeout=30))
        return send

    seen, still_streaming, tokens, logprobs, finish = asyncio.run(
        beside_a_normal_request(mesh, normal_prompt, [attack(r) for r, _, _ in SUBMIT_ATTACKS]))
    for (code, details), (_, field, limit) in zip(seen, SUBMIT_ATTACKS):
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{field}: ") and limit in details, details
        assert len(details) < 300  # the limit, not the echoed input
    assert still_streaming
    assert_finished_exact(tokens, logprobs, finish, reference)


def test_an_undecodable_submit_is_refused_and_the_scheduler_serves_on(mesh, normal_prompt, reference):
    async def garbage():
        async with peer_channel(mesh, mesh.child("scheduler").address) as ch:
            raw = ch.unary_stream("/kvmesh.v1.Scheduler/Submit", request_serializer=None, response_deserializer=None)
            return await code_of(raw(b"\xff\xff\xff\xff\x0f", timeout=30))

    [(code, details)], still_streaming, tokens, logprobs, finish = asyncio.run(
        beside_a_normal_request(mesh, normal_prompt, [garbage]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details, details
    assert mesh.child("scheduler").process.poll() is None
    assert_finished_exact(tokens, logprobs, finish, reference)


def test_an_undecodable_session_message_ends_that_session_alone_and_the_scheduler_serves_on(mesh, normal_prompt, reference):
    async def garbage():
        async with peer_channel(mesh, mesh.child("scheduler").address) as ch:
            raw = ch.stream_stream("/kvmesh.v1.Scheduler/Session", request_serializer=None, response_deserializer=None)

            async def messages():
                yield b"\xff\xff\xff\xff\x0f"
            return await code_of(raw(messages(), timeout=30))

    [(code, details)], still_streaming, tokens, logprobs, finish = asyncio.run(
        beside_a_normal_request(mesh, normal_prompt, [garbage]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details, details
    assert mesh.child("scheduler").process.poll() is None
    assert_finished_exact(tokens, logprobs, finish, reference)  # through the router's own session


# -- router: sampling values that would make the sampler meet inf or NaN ---------------------


def test_repetition_penalty_1e_45_is_refused_by_the_router_over_grpc_and_http(mesh, normal_prompt, reference):
    attack_request = gen.GenerateRequest(prompt="hello there", sampling=gen.SamplingParams(temperature=1.0, repetition_penalty=1e-45),
                                         stopping=gen.StoppingParams(max_new_tokens=8))

    async def over_grpc():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            return await code_of(generation_pb2_grpc.GenerationStub(ch).Generate(attack_request, timeout=30))

    async def over_http():
        body = json.dumps({"model": "default", "prompt": "hello there", "max_tokens": 8, "temperature": 1,
                           "repetition_penalty": 1e-45}).encode()
        request = urllib.request.Request(f"http://{mesh.child('router').http}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})

        def post():
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return response.status, response.read()
            except urllib.error.HTTPError as e:
                return e.code, e.read()
        return await asyncio.to_thread(post)

    [(code, details), (status, body)], still_streaming, tokens, logprobs, finish = asyncio.run(
        beside_a_normal_request(mesh, normal_prompt, [over_grpc, over_http]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("repetition_penalty: ") and "must be in [0.01, 2]" in details
    assert status == 400 and b"repetition_penalty" in body, body
    assert still_streaming
    assert_finished_exact(tokens, logprobs, finish, reference)


# -- kvcache: Publish keeps nothing it was not meant to -----------------------------------


def test_kvcache_publish_is_bounded_and_leaves_the_real_workers_index_alone(mesh, normal_prompt, reference):
    kvcache = psutil.Process(mesh.child("kvcache").process.pid)
    rss_before = kvcache.memory_info().rss

    real = {}  # the real worker's page stats, read once the normal request has made its pool known

    async def read_real():
        [stats] = await page_stats(mesh.kvcache_addr, mesh.peer)
        real.update(worker_id=stats.worker_id, total_pages=stats.total_pages)

    def publish(**fields):
        async def send():
            request = kvcache_pb2.PublishRequest(**{k: v(real) if callable(v) else v for k, v in fields.items()})
            async with peer_channel(mesh, mesh.kvcache_addr) as ch:
                try:
                    await kvcache_pb2_grpc.KVCacheStub(ch).Publish(request, timeout=30)
                    return grpc.StatusCode.OK, ""
                except grpc.aio.AioRpcError as e:
                    return e.code(), e.details()
        return send

    worker_id, total = (lambda r: r["worker_id"]), (lambda r: r["total_pages"])
    attacks = [
        read_real,
        publish(worker_id="attacker", epoch=1, num_pages=5_000_000, page_size=16, full=True),
        publish(worker_id="attacker", epoch=1, num_pages=1000, page_size=16, full=True,  # within the cap, but no such worker
                pages=kvcache_pb2.PageCounts(free=1000)),
        publish(worker_id=worker_id, epoch=10**9, num_pages=total, page_size=16, full=True,  # not its epoch
                pages=lambda r: kvcache_pb2.PageCounts(free=r["total_pages"])),
        publish(worker_id=worker_id, epoch=1, num_pages=total, page_size=16, full=True,  # more hashes than pages
                stored=lambda r: [bytes(16)] * (r["total_pages"] + 1), pages=lambda r: kvcache_pb2.PageCounts(free=r["total_pages"])),
    ]
    seen, still_streaming, tokens, logprobs, finish = asyncio.run(beside_a_normal_request(mesh, normal_prompt, attacks))
    seen = seen[1:]

    (code, details) = seen[0]
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("num_pages: ") and "[1, 1048576] (max_pages_per_worker)" in details
    assert seen[1] == (grpc.StatusCode.FAILED_PRECONDITION, "worker 'attacker' is not registered")
    assert seen[2][0] == grpc.StatusCode.FAILED_PRECONDITION and "is registered at epoch" in seen[2][1]
    assert seen[3][0] == grpc.StatusCode.INVALID_ARGUMENT and seen[3][1].startswith("stored: ")
    assert kvcache.memory_info().rss - rss_before < 30 << 20  # the attack in the issue grew it by 357 MB
    assert still_streaming
    assert_finished_exact(tokens, logprobs, finish, reference)
    [after] = asyncio.run(wait_idle(mesh.kvcache_addr, identity=mesh.peer))
    assert (after.worker_id, after.total_pages, after.used_pages) == (real["worker_id"], real["total_pages"], 0)


# -- with mTLS: an attacker without the mesh's certificate does not get to send anything --------


def test_with_mtls_the_attacks_from_a_client_without_a_mesh_certificate_are_refused(mesh, normal_prompt, reference):
    if mesh.peer is None:
        pytest.skip("a plaintext mesh has no peers to tell apart (the attacks above are its test)")

    def without_certificate(address, call):
        async def send():
            async with grpc.aio.insecure_channel(address) as ch:
                try:
                    result = call(ch)
                    if hasattr(result, "__aiter__"):
                        return await code_of(result)
                    await result
                    return grpc.StatusCode.OK, ""
                except grpc.aio.AioRpcError as e:
                    return e.code(), e.details()
        return send

    scheduler, kvcache = mesh.child("scheduler").address, mesh.kvcache_addr
    attacks = [without_certificate(scheduler, lambda ch: scheduler_pb2_grpc.SchedulerStub(ch).Submit(r, timeout=10))
               for r, _, _ in SUBMIT_ATTACKS[:2]]
    attacks.append(without_certificate(kvcache, lambda ch: kvcache_pb2_grpc.KVCacheStub(ch).Publish(
        kvcache_pb2.PublishRequest(worker_id="attacker", epoch=1, num_pages=5_000_000, page_size=16), timeout=10)))
    attacks.append(without_certificate(kvcache, lambda ch: kvcache_pb2_grpc.KVCacheStub(ch).Publish(
        kvcache_pb2.PublishRequest(worker_id="worker-0", forget=True), timeout=10)))
    seen, still_streaming, tokens, logprobs, finish = asyncio.run(beside_a_normal_request(mesh, normal_prompt, attacks))
    assert [code for code, _ in seen] == [grpc.StatusCode.UNAVAILABLE] * len(attacks), seen
    assert still_streaming
    assert_finished_exact(tokens, logprobs, finish, reference)
