"""mTLS inside the mesh, TLS at the router's edge, Redis with a password, ACL user and TLS: what a
peer without the mesh's certificate, or without Redis's password, can no longer do."""

import asyncio
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
import redis
from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.services.grpc_server import ServiceServer
from kvmesh.services.launcher import MeshTLS, free_port
from kvmesh.services.redis_client import check_redis_url, connect, redacted
from kvmesh.services.registry import service_key
from kvmesh.services.tls import (MESH_NAMES, MeshCertificates, MeshIdentity, certificate_names, channel, issue_certificate,
                                 make_ca, mesh_channel, public_client_credentials)
from kvmesh.tokenizer import Tokenizer
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from local_mesh import Mesh, collect, start_redis
from reference import assert_matches_reference, hf_greedy

ADMIN_PASSWORD = "s3cret-admin"
MESH_USER, MESH_PASSWORD = "kvmesh", "mesh pass/with:reserved@chars"
MESH_PASSWORD_IN_URL = "mesh%20pass%2Fwith%3Areserved%40chars"


def greedy(prompt, n):
    return gen.GenerateRequest(prompt=prompt, sampling=gen.SamplingParams(temperature=0.0),
                               stopping=gen.StoppingParams(max_new_tokens=n, ignore_eos=True))


def load_cert(path):
    return x509.load_pem_x509_certificate(open(path, "rb").read())


# ---- certificates ------------------------------------------------------------------------------


def test_service_certificates_name_loopback_the_hostname_and_operator_names(tmp_path):
    certs = MeshCertificates.create(tmp_path, ["scheduler.kvmesh.svc", "10.0.0.7"])
    for service in MESH_NAMES:
        names = certificate_names(certs.cert_path(service).read_bytes())
        assert {"localhost", "127.0.0.1", "::1", socket.gethostname(), "scheduler.kvmesh.svc", "10.0.0.7"} <= set(names)
        assert os.stat(certs.key_path(service)).st_mode & 0o077 == 0, "a private key readable by others"
    assert os.stat(tmp_path / "ca-key.pem").st_mode & 0o077 == 0


def test_service_certificates_chain_to_the_mesh_ca_and_to_no_other(tmp_path):
    certs = MeshCertificates.create(tmp_path / "mesh")
    other = MeshCertificates.create(tmp_path / "other")
    ca = load_cert(certs.ca_path)
    leaf = load_cert(certs.cert_path("worker"))
    for name in (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))):
        chain = PolicyBuilder().store(Store([ca])).build_server_verifier(name).verify(leaf, [])
        assert chain[-1] == ca
    assert PolicyBuilder().store(Store([ca])).build_client_verifier().verify(leaf, []).chain[-1] == ca  # clients too
    with pytest.raises(VerificationError):
        PolicyBuilder().store(Store([load_cert(other.ca_path)])).build_server_verifier(x509.DNSName("localhost")).verify(leaf, [])
    with pytest.raises(VerificationError):  # a name the certificate does not carry
        PolicyBuilder().store(Store([ca])).build_server_verifier(x509.DNSName("rogue.example")).verify(leaf, [])


def test_creating_again_keeps_the_ca_so_earlier_certificates_stay_valid(tmp_path):
    first = MeshCertificates.create(tmp_path)
    ca_before = first.ca_path.read_bytes()
    old_leaf = load_cert(first.cert_path("router"))
    again = MeshCertificates.create(tmp_path, ["router.example"])
    assert again.ca_path.read_bytes() == ca_before
    ca = load_cert(again.ca_path)
    for leaf in (old_leaf, load_cert(again.cert_path("router"))):
        PolicyBuilder().store(Store([ca])).build_server_verifier(x509.DNSName("localhost")).verify(leaf, [])


def test_a_mesh_server_refuses_peers_without_a_certificate_from_its_ca(tmp_path):
    certs = MeshCertificates.create(tmp_path / "mesh")
    rogue = MeshCertificates.create(tmp_path / "rogue")
    ca = certs.ca_path.read_bytes()
    rogue_client = rogue.identity("client")

    async def run():
        server = ServiceServer(["kvmesh.v1.KVCache"], lambda s: None, "127.0.0.1", 0,
                               certs.identity("kvcache").server_credentials())
        await server.start()
        address = f"127.0.0.1:{server.port}"
        answers = {}
        clients = {"mesh client": certs.identity("client").channel_credentials(),
                   "plaintext": None,
                   "no certificate": grpc.ssl_channel_credentials(root_certificates=ca),
                   "certificate from another CA": grpc.ssl_channel_credentials(ca, rogue_client.key, rogue_client.cert)}
        for name, credentials in clients.items():
            async with channel(address, credentials) as ch:
                try:
                    await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    answers[name] = "answered"
                except grpc.aio.AioRpcError as e:
                    answers[name] = e.code()
        await server.stop(0)
        return answers

    assert asyncio.run(run()) == {"mesh client": "answered", "plaintext": grpc.StatusCode.UNAVAILABLE,
                                  "no certificate": grpc.StatusCode.UNAVAILABLE,
                                  "certificate from another CA": grpc.StatusCode.UNAVAILABLE}


def test_one_shared_server_name_stands_in_for_addresses_no_certificate_can_list(tmp_path):
    ca_cert, ca_key = make_ca()
    cert, key = issue_certificate(ca_cert, ca_key, "kvmesh-worker", ["kvmesh-mesh"])  # no IP: a pod's is unknown
    server_identity = MeshIdentity(ca_cert, cert, key)
    client_cert, client_key = issue_certificate(ca_cert, ca_key, "kvmesh-scheduler", ["kvmesh-mesh"])

    async def run():
        server = ServiceServer(["kvmesh.v1.Worker"], lambda s: None, "127.0.0.1", 0, server_identity.server_credentials())
        await server.start()
        answers = []
        for server_name in ("kvmesh-mesh", ""):
            async with mesh_channel(f"127.0.0.1:{server.port}", MeshIdentity(ca_cert, client_cert, client_key, server_name)) as ch:
                try:
                    await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    answers.append("answered")
                except grpc.aio.AioRpcError as e:
                    answers.append(e.code())
        await server.stop(0)
        return answers

    assert asyncio.run(run()) == ["answered", grpc.StatusCode.UNAVAILABLE]  # 127.0.0.1 is not a name it carries


# ---- Redis URLs, password, ACL user, TLS ---------------------------------------------------------


def test_redis_urls_are_checked_and_passwords_never_shown():
    for bad, words in [("http://127.0.0.1:6379/0", "must start with"), ("redis:///0", "no host"),
                       ("redis://h:6379/0?ssl_ca_certs=/ca.pem", "rediss://")]:
        with pytest.raises(ValueError, match="redis_url") as e:
            check_redis_url(bad)
        assert words in str(e.value)
    assert redacted("redis://kvmesh:hunter2@redis:6379/0") == "redis://kvmesh:***@redis:6379/0"
    assert redacted("rediss://:hunter2@redis/0?ssl_ca_certs=/ca.pem") == "rediss://:***@redis/0?ssl_ca_certs=/ca.pem"
    assert redacted("redis://redis:6379/0") == "redis://redis:6379/0"


@pytest.fixture(scope="module")
def auth_redis(tmp_path_factory):
    """A redis-server with `requirepass` and an ACL user limited to kvmesh's keys: (port, mesh URL)."""
    port = free_port()
    proc = start_redis(port, str(tmp_path_factory.mktemp("redis")), "--requirepass", ADMIN_PASSWORD)
    admin = redis.Redis(port=port, password=ADMIN_PASSWORD)
    admin.acl_setuser(MESH_USER, enabled=True, passwords=[f"+{MESH_PASSWORD}"], keys=["kvmesh:*"], commands=["+@all"])
    admin.close()
    yield port, f"redis://{MESH_USER}:{MESH_PASSWORD_IN_URL}@127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


def test_redis_refuses_a_client_without_the_password(auth_redis):
    port, mesh_url = auth_redis
    for url in (f"redis://127.0.0.1:{port}/0", f"redis://:wrong@127.0.0.1:{port}/0",
                f"redis://{MESH_USER}:wrong@127.0.0.1:{port}/0"):
        client = connect(url, aio=False)
        with pytest.raises(redis.exceptions.AuthenticationError):
            client.set("kvmesh:probe", "1")
        client.close()
    admin = connect(f"redis://:{ADMIN_PASSWORD}@127.0.0.1:{port}/0", aio=False)
    assert admin.ping()
    admin.close()
    user = connect(mesh_url, aio=False)
    assert user.set("kvmesh:probe", "1")
    with pytest.raises(redis.exceptions.NoPermissionError):  # the ACL user reaches kvmesh's keys only
        user.set("other:probe", "1")
    user.close()


def test_rediss_urls_carry_the_ca_and_a_client_certificate(tmp_path):
    certs = MeshCertificates.create(tmp_path)
    port = free_port()
    proc = start_redis(port, str(tmp_path), "--port", "0", "--tls-port", str(port),
                       "--tls-cert-file", str(certs.cert_path("kvcache")), "--tls-key-file", str(certs.key_path("kvcache")),
                       "--tls-ca-cert-file", str(certs.ca_path))  # tls-auth-clients defaults to yes
    try:
        base = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs.ca_path}"
        good = connect(f"{base}&ssl_certfile={certs.cert_path('client')}&ssl_keyfile={certs.key_path('client')}", aio=False)
        assert good.ping()
        good.close()
        for url in (base, f"redis://127.0.0.1:{port}/0"):  # no client certificate; no TLS at all
            bad = connect(url, aio=False)
            with pytest.raises(redis.exceptions.ConnectionError):
                bad.ping()
            bad.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---- a mesh with mTLS on, on a Redis with an ACL user -----------------------------------------------


@pytest.fixture(scope="module")
def tls_mesh(model_dir, auth_redis, tmp_path_factory):
    certs = MeshCertificates.create(tmp_path_factory.mktemp("mesh-tls"))
    m = Mesh(model_dir, workers=1, redis_url=auth_redis[1], tls=MeshTLS(certs))
    m.certs = certs
    yield m
    m.close()


def test_a_mesh_with_tls_serves_exact_streams_and_its_public_port_stays_plaintext(tls_mesh, model_dir):
    ids = Tokenizer.from_dir(model_dir).encode("alpha beta gamma delta")

    async def run():
        async with grpc.aio.insecure_channel(tls_mesh.addr) as ch:  # `--tls` alone: the edge is unchanged
            return await collect(generation_pb2_grpc.GenerationStub(ch), greedy("alpha beta gamma delta", 8))

    tokens, logprobs, _, finish = asyncio.run(run())
    assert finish.reason == gen.LENGTH and finish.completion_tokens == 8
    assert_matches_reference(tokens, logprobs, hf_greedy(model_dir, ids, 8))


def _internal_calls():
    """One real RPC of each internal service, as an attacker would send it."""
    return {
        "scheduler": lambda ch: _read_all(scheduler_pb2_grpc.SchedulerStub(ch).Submit(
            scheduler_pb2.SubmitRequest(request_id="attack", prompt_token_ids=[1, 2, 3]), timeout=5)),
        "worker": lambda ch: worker_pb2_grpc.WorkerStub(ch).Info(worker_pb2.InfoRequest(), timeout=5),
        "kvcache": lambda ch: kvcache_pb2_grpc.KVCacheStub(ch).Stats(kvcache_pb2.StatsRequest(), timeout=5),
    }


async def _read_all(call):
    return [m async for m in call]


def test_logprobs_and_choices_cross_the_mutually_authenticated_mesh(tls_mesh, model_dir):
    ids = Tokenizer.from_dir(model_dir).encode("alpha beta gamma delta")
    request = gen.GenerateRequest(prompt_token_ids=gen.TokenIds(ids=ids), n=2,
                                  sampling=gen.SamplingParams(seed=1, logprobs=3, prompt_logprobs=2),
                                  stopping=gen.StoppingParams(max_new_tokens=4, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(tls_mesh.addr) as ch:
            return [r async for r in generation_pb2_grpc.GenerationStub(ch).Generate(request, timeout=60)]

    responses = asyncio.run(run())
    tokens = {i: [t for r in responses if r.index == i for t in r.tokens] for i in (0, 1)}
    assert [len(tokens[0]), len(tokens[1])] == [4, 4]
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob for ts in tokens.values() for t in ts)
    [prompt] = [list(r.prompt_tokens) for r in responses if r.prompt_tokens]
    assert [t.id for t in prompt] == ids and all(len(t.top_logprobs) == 2 for t in prompt[1:])
    assert sum(r.HasField("finish") for r in responses) == 2


def test_plaintext_and_wrong_ca_clients_are_refused_on_every_internal_port(tls_mesh, tmp_path):
    rogue = MeshCertificates.create(tmp_path).identity("client")
    ca = tls_mesh.certs.ca_path.read_bytes()
    bad_clients = {"plaintext": None, "no certificate": grpc.ssl_channel_credentials(root_certificates=ca),
                   "certificate from another CA": grpc.ssl_channel_credentials(ca, rogue.key, rogue.cert)}
    internal = [c for c in tls_mesh.children if c.service in ("scheduler", "worker", "kvcache")]
    assert {c.service for c in internal} == {"scheduler", "worker", "kvcache"}

    async def run():
        refused = {}
        for child in internal:
            for name, credentials in bad_clients.items():
                async with channel(child.address, credentials) as ch:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await _internal_calls()[child.service](ch)
                    refused[child.service, name] = e.value.code()
            async with channel(child.address, tls_mesh.certs.identity("client").channel_credentials()) as ch:
                status = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert status.status == health_pb2.HealthCheckResponse.SERVING, child.name
        return refused

    refused = asyncio.run(run())
    assert refused == {(c.service, name): grpc.StatusCode.UNAVAILABLE for c in internal for name in bad_clients}


def _kvmesh(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_MESH_")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", *args], capture_output=True, text=True, timeout=120, env=env)


def test_kvmesh_health_reaches_internal_services_with_the_mesh_identity_only(tls_mesh):
    scheduler = tls_mesh.child("scheduler").address
    certs = tls_mesh.certs
    with_flags = _kvmesh("health", scheduler, *certs.flags("client"))
    assert with_flags.returncode == 0 and "SERVING" in with_flags.stdout, with_flags.stderr
    from_env = _kvmesh("health", scheduler, env_extra={"KVMESH_MESH_CA": str(certs.ca_path),
                                                       "KVMESH_MESH_CERT": str(certs.cert_path("client")),
                                                       "KVMESH_MESH_KEY": str(certs.key_path("client"))})
    assert from_env.returncode == 0, from_env.stderr
    plaintext = _kvmesh("health", scheduler)
    assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stderr


class RogueScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """A plaintext server that registered itself as a scheduler; counts the requests it is sent."""

    def __init__(self):
        self.submits = 0

    async def Submit(self, request, context):
        self.submits += 1
        yield scheduler_pb2.TokenEvent(token_ids=[0], logprobs=[0.0], finish_reason=gen.LENGTH)


def wait_for_line(path, text, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, encoding="utf-8", errors="replace") as f:
            if text in f.read():
                return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path} within {timeout}s")


def test_a_rogue_scheduler_registration_gets_no_requests(tls_mesh, model_dir):
    rogue = RogueScheduler()
    prompts = [f"request {i} from a real client" for i in range(8)]
    tok = Tokenizer.from_dir(model_dir)

    async def run():
        server = ServiceServer(["kvmesh.v1.Scheduler"], lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(rogue, s),
                               "127.0.0.1", 0)  # plaintext, and healthy: without mTLS the router would use it
        await server.start()
        await server.set_serving(True)
        address = f"127.0.0.1:{server.port}"
        r = connect(tls_mesh.redis_url)
        await r.set(service_key("scheduler", "rogue"), json.dumps({"id": "rogue", "kind": "scheduler", "address": address,
                                                                    "pool": "default"}))
        try:
            await asyncio.to_thread(wait_for_line, tls_mesh.child("router").log_path,
                                    f"skipping the scheduler registered at {address}")
            async with grpc.aio.insecure_channel(tls_mesh.addr) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                return await asyncio.gather(*(collect(stub, greedy(p, 4)) for p in prompts))
        finally:
            await r.delete(service_key("scheduler", "rogue"))
            await r.aclose()
            await server.stop(0)

    results = asyncio.run(run())
    assert rogue.submits == 0
    for prompt, (tokens, logprobs, _, finish) in zip(prompts, results):
        assert finish.reason == gen.LENGTH
        assert_matches_reference(tokens, logprobs, hf_greedy(model_dir, tok.encode(prompt), 4))


# ---- TLS on the router's public ports ---------------------------------------------------------------


@pytest.fixture(scope="module")
def edge_mesh(model_dir, tmp_path_factory):
    """mTLS inside, and the router's public ports with a certificate from a CA of the edge's own."""
    folder = tmp_path_factory.mktemp("edge")
    ca_cert, ca_key = make_ca("edge CA")
    cert, key = issue_certificate(ca_cert, ca_key, "api.example", ["localhost", "127.0.0.1"])
    (folder / "edge-ca.pem").write_bytes(ca_cert)
    (folder / "router.pem").write_bytes(cert + ca_cert)  # the chain, up to its root
    (folder / "router-key.pem").write_bytes(key)
    certs = MeshCertificates.create(folder / "mesh")
    m = Mesh(model_dir, workers=1, tls=MeshTLS(certs, str(folder / "router.pem"), str(folder / "router-key.pem")))
    m.edge_ca = str(folder / "edge-ca.pem")
    yield m
    m.close()


def test_the_router_public_ports_speak_tls_with_their_certificate(edge_mesh):
    async def run():
        async with channel(edge_mesh.addr, public_client_credentials(edge_mesh.edge_ca)) as ch:
            answer = await collect(generation_pb2_grpc.GenerationStub(ch), greedy("alpha beta", 4))
        async with grpc.aio.insecure_channel(edge_mesh.addr) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(generation_pb2_grpc.GenerationStub(ch), greedy("alpha beta", 4), timeout=5)
        return answer, refused.value.code()

    (tokens, _, _, finish), plaintext = asyncio.run(run())
    assert finish.reason == gen.LENGTH and len(tokens) == 4
    assert plaintext == grpc.StatusCode.UNAVAILABLE

    http = edge_mesh.child("router").http
    body = json.dumps({"model": "default", "prompt": "alpha beta", "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"https://{http}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60, context=ssl.create_default_context(cafile=edge_mesh.edge_ca)) as r:
        assert r.status == 200 and json.load(r)["usage"]["completion_tokens"] == 4
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://{http}/health", timeout=10)

    cli = _kvmesh("generate", "--addr", edge_mesh.addr, "--tls-ca", edge_mesh.edge_ca, "--max-new-tokens", "4", "alpha beta")
    assert cli.returncode == 0 and "[length]" in cli.stderr, cli.stderr
