"""Per-key limits: API keys from a file with requests/s, tokens/min and in-flight caps, shared by
every router through Redis, reloaded without a restart, and shown by id only."""

import asyncio
import json
import os
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import pytest

from kvmesh.services.launcher import free_port, serve_command, wait_serving
from kvmesh.services.router.limits import (KeyBook, KeyLimiter, KeyLimits, LimitExceeded, TokenBucket, in_flight_key,
                                          parse_keys)
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc
from local_mesh import Mesh, stop_process

# ---- the cores ---------------------------------------------------------------------------------


def test_a_token_bucket_starts_full_refills_continuously_and_says_how_long_to_wait():
    bucket = TokenBucket(rate=2.0, capacity=2.0)
    assert bucket.take(1, 1, now=0.0) == 0.0 and bucket.take(1, 1, now=0.0) == 0.0
    assert bucket.take(1, 1, now=0.1) == pytest.approx(0.4)  # 0.2 of a token back; 0.8 missing at 2/s
    assert bucket.take(1, 1, now=0.5) == 0.0
    assert bucket.take(0, 0, now=100.0) == 0.0 and bucket.level == 2.0  # never above capacity


def test_output_charged_after_the_fact_leaves_a_debt_that_later_requests_wait_out():
    bucket = TokenBucket(rate=1.0, capacity=60.0)  # 60 tokens/min
    assert bucket.take(50, 50, now=0.0) == 0.0
    assert bucket.take(100, 0, now=0.0) == 0.0 and bucket.level == -60.0  # the debt is bounded by a minute
    assert bucket.take(10, 10, now=0.0) == pytest.approx(70.0)


def test_keys_file_entries_are_checked_and_errors_name_the_id_never_the_key():
    keys = parse_keys(b'{"sk-a": {"id": "team-a", "requests_per_s": 5, "tokens_per_min": 1000, "max_concurrent": 2},'
                      b' "sk-b": {"id": "team-b"}}', "keys.json")
    assert sorted(k.id for k in keys.values()) == ["team-a", "team-b"]
    assert "sk-a" not in json.dumps(list(keys)), "the key itself is kept only as its digest"
    toml = parse_keys(b'["sk-c"]\nid = "team-c"\nrequests_per_s = 0.5\n', "keys.toml")
    assert list(toml.values()) == [KeyLimits("team-c", requests_per_s=0.5)]
    for body, words in [(b'{"sk-secret": {"id": "x", "rate": 1}}', "unknown field 'rate'"),
                        (b'{"sk-secret": {"requests_per_s": 1}}', "id is required"),
                        (b'{"sk-secret": {"id": "x", "max_concurrent": -1}}', "max_concurrent must be an integer >= 0"),
                        (b'{"sk-secret": {"id": "x", "requests_per_s": NaN}}', "requests_per_s must be a number >= 0"),
                        (b'{"sk-secret": {"id": "has space"}}', "id must be"),
                        (b'{"sk-secret": {"id": "x"}, "sk-other": {"id": "x"}}', "id 'x' is used twice"),
                        (b'["sk-secret"]', "must map each key"), (b"{", "does not parse")]:
        with pytest.raises(ValueError) as e:
            parse_keys(body, "keys.json")
        assert words in str(e.value) and "sk-secret" not in str(e.value), str(e.value)


def test_the_keys_file_is_read_again_when_it_changes_and_a_bad_version_keeps_the_last_good_one(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-a": {"id": "team-a"}}))
    book = KeyBook("sk-plain", str(path))
    assert book.find("sk-a").id == "team-a" and book.find("sk-plain").id == "key-1" and book.find("sk-b") is None
    assert not book.reload()  # unchanged
    path.write_text(json.dumps({"sk-b": {"id": "team-b", "max_concurrent": 3}}))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime even on a coarse clock
    assert book.reload()
    assert book.find("sk-a") is None and book.find("sk-b") == KeyLimits("team-b", max_concurrent=3)
    path.write_text("{not json")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert not book.reload() and book.find("sk-b") is not None
    with pytest.raises(ValueError, match="api_keys_file"):
        KeyBook("", str(path))  # at start a bad file is an error


# ---- the limiter on a real redis-server ----------------------------------------------------------


def run_with(redis_url, body, routers=2, **kwargs):
    """Runs `body(limiters)` with `routers` KeyLimiters on one Redis: routers sharing the limits."""
    async def run():
        limiters = [KeyLimiter(redis_url, f"router-{i}", **kwargs) for i in range(routers)]
        try:
            return await body(limiters)
        finally:
            for limiter in limiters:
                await limiter.close()
    return asyncio.run(run())


def test_a_requests_per_s_limit_is_one_bucket_for_all_routers(redis_url):
    key = KeyLimits("shared-rps", requests_per_s=3)

    async def body(limiters):
        started = time.monotonic()
        outcomes = []
        for i in range(4):
            try:
                await limiters[i % 2].admit(key)
                outcomes.append(None)
            except LimitExceeded as e:
                outcomes.append(e)
        return outcomes, time.monotonic() - started

    outcomes, elapsed = run_with(redis_url, body)
    refused = [e for e in outcomes if e is not None]
    assert len(refused) <= 1
    if elapsed < 1 / 3:  # less than one token refilled meanwhile: exactly the fourth is refused
        assert outcomes[:3] == [None, None, None] and len(refused) == 1
    for e in refused:
        assert e.limit == "requests_per_s" and 0 < e.retry_after_s <= 1 / 3 and "'shared-rps'" in str(e)


def test_prompt_tokens_are_refused_while_the_bucket_holds_fewer_and_output_is_charged_at_the_end(redis_url):
    key = KeyLimits("shared-tpm", tokens_per_min=600)  # 10 tokens/s

    async def body(limiters):
        a, b = limiters
        admission = await a.admit(key)
        await a.take_prompt(key, 400)
        admission.output_tokens = 150
        await a.finish(admission)  # 50 left
        with pytest.raises(LimitExceeded) as e:
            await b.take_prompt(key, 100)
        with pytest.raises(LimitExceeded) as too_big:
            await b.take_prompt(key, 601)
        return e.value, too_big.value

    short, too_big = run_with(redis_url, body)
    assert short.limit == "tokens_per_min" and 4.0 < short.retry_after_s <= 5.0  # 50 missing at 10/s
    assert too_big.retry_after_s is None and "over API key 'shared-tpm''s limit of 600 tokens/min" in str(too_big)


async def past_first_lifetime(limiter, key, lease_ms, timeout_s=30):
    """Returns once Redis's clock is a whole lease past the first expiry of `key`'s in-flight leases
    as they stand now: leases nobody renewed would have expired by then."""
    r = limiter.redis
    first = max(score for _, score in await r.zrange(in_flight_key(key.id), 0, -1, withscores=True))
    deadline = time.monotonic() + timeout_s
    while True:
        seconds, micros = await r.time()
        if seconds * 1000 + micros // 1000 > first + lease_ms:
            return
        assert time.monotonic() < deadline, "Redis's clock did not move"
        await asyncio.sleep(0.05)


def test_an_in_flight_cap_is_shared_and_a_dead_routers_slots_come_back(redis_url):
    key = KeyLimits("shared-cap", max_concurrent=2)

    async def body(limiters):
        a, b = limiters
        held = [await a.admit(key), await b.admit(key)]
        with pytest.raises(LimitExceeded) as e:
            await b.admit(key)
        await a.finish(held[0])
        again = await b.admit(key)  # a finished request frees its slot at once
        renewing = asyncio.create_task(b.renew_leases())
        # Router a "dies" holding nothing; router b keeps renewing its two leases past their lifetime:
        # wait (by Redis's clock, which the leases are scored by) until their first expiry is a lease ago.
        await past_first_lifetime(b, key, lease_ms=int(b.lease_s * 1000))
        with pytest.raises(LimitExceeded):
            await a.admit(key)
        renewing.cancel()
        return e.value, held[1], again

    refused, *_ = run_with(redis_url, body, lease_s=0.6)
    assert refused.limit == "max_concurrent" and refused.retry_after_s > 0

    key = KeyLimits("dead-router-cap", max_concurrent=2)

    async def dead_router(limiters):
        [a] = limiters
        await a.admit(key)
        await a.admit(key)  # held by a router that never renews nor finishes them
        with pytest.raises(LimitExceeded):
            await a.admit(key)
        deadline = time.monotonic() + 10
        while True:  # the leases expire: the slots come back
            try:
                return await a.admit(key)
            except LimitExceeded:
                assert time.monotonic() < deadline, "a dead router's slots never came back"
                await asyncio.sleep(0.1)

    assert run_with(redis_url, dead_router, routers=1, lease_s=0.6).key == key


def test_with_redis_unreachable_each_router_limits_on_its_own(caplog):
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    key = KeyLimits("no-redis", requests_per_s=2, max_concurrent=5)

    async def body(limiters):
        [a] = limiters
        admitted = [await a.admit(key), await a.admit(key)]
        with pytest.raises(LimitExceeded):
            await a.admit(key)
        for admission in admitted:
            await a.finish(admission)
        return admitted

    assert all(a.local_slot for a in run_with(dead, body, routers=1))  # fail open, with local limits
    assert "Redis is unreachable" in caplog.text


# ---- two routers of a mesh ------------------------------------------------------------------------

RATE = 2  # requests/s of the keys below; a burst of RATE + 1 within 1 / RATE s gets exactly one 429


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    keys = {f"sk-burst-{i}": {"id": f"burst-{i}", "requests_per_s": RATE} for i in range(5)}
    keys["sk-grpc"] = {"id": "grpc", "requests_per_s": RATE}
    keys["sk-cap"] = {"id": "capped", "max_concurrent": 1}
    path.write_text(json.dumps(keys))
    return path


@pytest.fixture(scope="module")
def two_routers(model_dir, keys_file):
    """A one-worker mesh with two routers reading the same keys file: their gRPC and HTTP addresses."""
    mesh = Mesh(model_dir, workers=1, extra_router=["--api-keys-file", str(keys_file)])
    port, http = free_port(), free_port()
    second = subprocess.Popen(serve_command("router", mesh.redis_url, port, "--http-port", str(http), "--model",
                                            str(model_dir), "--api-keys-file", str(keys_file)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_serving(f"127.0.0.1:{port}", 60, second)
        yield mesh, [(mesh.addr, mesh.child("router").http), (f"127.0.0.1:{port}", f"127.0.0.1:{http}")]
    finally:
        stop_process(second)
        mesh.close()


def post(http, key, body, path="/v1/completions"):
    request = urllib.request.Request(f"http://{http}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def one_token(key_prompt="hello"):
    return {"model": "default", "prompt": key_prompt, "max_tokens": 1, "temperature": 0}


def test_n_plus_one_requests_in_a_second_across_two_routers_get_exactly_one_429(two_routers):
    _, routers = two_routers
    https = [http for _, http in routers]

    async def burst(key):
        started = time.monotonic()
        answers = await asyncio.gather(*(asyncio.to_thread(post, https[i % 2], key, one_token()) for i in range(RATE + 1)))
        return answers, time.monotonic() - started

    for attempt in range(5):  # each attempt on a fresh key; a burst slower than 1 / RATE s proves nothing
        answers, elapsed = asyncio.run(burst(f"sk-burst-{attempt}"))
        statuses = sorted(status for status, _, _ in answers)
        assert statuses.count(429) <= 1, answers  # never more refused than the limit says
        if elapsed < 1 / RATE or statuses.count(429) == 1:
            break
    assert statuses == [200] * RATE + [429], answers
    [(_, headers, body)] = [a for a in answers if a[0] == 429]
    assert headers["Retry-After"] == "1" and 0 < int(headers["retry-after-ms"]) <= 1000 / RATE
    assert body["error"]["code"] == "rate_limit_exceeded" and f"'burst-{attempt}'" in body["error"]["message"]


def test_over_grpc_the_refusal_is_resource_exhausted_with_a_retry_after_trailer(two_routers):
    _, routers = two_routers

    async def run():
        channels = [grpc.aio.insecure_channel(addr) for addr, _ in routers]
        stubs = [generation_pb2_grpc.GenerationStub(ch) for ch in channels]
        request = gen.GenerateRequest(prompt="hi", stopping=gen.StoppingParams(max_new_tokens=1))
        metadata = (("authorization", "Bearer sk-grpc"),)
        try:
            results = []
            for i in range(RATE + 3):  # more than the bucket holds, even refilled while they run
                try:
                    results.append([m async for m in stubs[i % 2].Generate(request, metadata=metadata, timeout=30)])
                except grpc.aio.AioRpcError as e:
                    results.append(e)
            return results
        finally:
            for ch in channels:
                await ch.close()

    refused = [r for r in asyncio.run(run()) if isinstance(r, grpc.aio.AioRpcError)]
    assert refused, "no request was refused"
    for e in refused:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "requests/s" in e.details()
        assert int(dict(e.trailing_metadata())["retry-after"]) >= 1


def test_the_in_flight_cap_holds_across_routers(two_routers):
    _, routers = two_routers
    long_one = {"model": "default", "prompt": "a long one", "max_tokens": 400, "ignore_eos": True, "stream": True}

    def open_stream():
        request = urllib.request.Request(f"http://{routers[0][1]}/v1/completions", data=json.dumps(long_one).encode(),
                                         headers={"Content-Type": "application/json", "Authorization": "Bearer sk-cap"})
        response = urllib.request.urlopen(request, timeout=60)
        response.readline()  # its first event: the request holds its slot now
        return response

    streaming = open_stream()
    try:
        status, headers, body = post(routers[1][1], "sk-cap", one_token())
    finally:
        streaming.close()
    assert status == 429 and "max_concurrent" in body["error"]["message"] and "Retry-After" in headers
    deadline = time.monotonic() + 30
    while (status := post(routers[1][1], "sk-cap", one_token())[0]) == 429 and time.monotonic() < deadline:
        time.sleep(0.1)  # the router notices the client left, cancels the request and frees the slot
    assert status == 200


def test_a_key_added_to_the_file_is_accepted_without_a_restart_and_metrics_show_ids_only(two_routers, keys_file):
    mesh, routers = two_routers
    assert post(routers[0][1], "sk-new", one_token())[0] == 401
    keys = json.loads(keys_file.read_text())
    keys["sk-new"] = {"id": "newcomer"}
    keys_file.write_text(json.dumps(keys))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(post(http, "sk-new", one_token())[0] != 200 for _, http in routers):
        time.sleep(0.2)
    assert all(post(http, "sk-new", one_token())[0] == 200 for _, http in routers)
    with urllib.request.urlopen(f"http://{routers[0][1]}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'kvmesh_api_key_requests_total{key_id="newcomer",outcome="admitted"}' in metrics
    assert not any(key in metrics for key in keys), "a key in the metrics"
