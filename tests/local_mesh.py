"""A local mesh for tests (real processes, real redis-server, loopback gRPC) and small clients for it."""

import asyncio
import json
import os
import socket
import subprocess
import time

import grpc

from kvmesh.services.children import redis_child
from kvmesh.services.launcher import free_port, launch, stop, wait_split
from kvmesh.services.tls import mesh_channel
from kvmesh.services.registry import QUEUE_STATE_PATTERN
from kvmesh.v1 import kvcache_pb2, kvcache_pb2_grpc

# Output tokens for a request that must still be running when a test acts on it (on conftest's
# long_model_dir, with LONG_KV of KV per worker): a minute or more of decoding on any machine;
# the test cancels it.
LONG_REQUEST = 60_000
LONG_KV = ["--kv-memory-mib", "32"]  # 65,536 of the tiny model's tokens


class Mesh:
    """What `kvmesh up` starts (with its own redis-server unless given `redis_url`), with 4 MiB of KV
    per worker unless overridden; `tls` (a launcher.MeshTLS) as `kvmesh up --tls` has it;
    `schedulers` per pool as `kvmesh up --schedulers`."""

    def __init__(self, model_dir, workers=2, extra_worker=(), extra_scheduler=(), extra_router=(), env=None,
                 redis_url=None, tls=None, schedulers=1):
        self.port = free_port()
        model = model_dir if isinstance(model_dir, list) else str(model_dir)  # a list: [(pool, folder)]
        self.children, self.redis, self.redis_url = launch(model, workers, redis_url, self.port,
                                                           extra_worker=["--kv-memory-mib", "4", *extra_worker],
                                                           extra_scheduler=list(extra_scheduler),
                                                           extra_router=list(extra_router), env=env, tls=tls,
                                                           schedulers=schedulers)
        self.addr = f"127.0.0.1:{self.port}"
        self.kvcache_addr = next(c.address for c in self.children if c.name == "kvcache")

    def child(self, name):
        return next(c for c in self.children if c.name == name)

    @property
    def log_dir(self):
        return os.path.dirname(self.children[0].log_path)

    def close(self):
        stop(self.children, self.redis)

    def wait_split(self, timeout=60) -> dict:
        """Waits until every worker is owned and every scheduler owns one; returns worker id -> its scheduler's address."""
        return wait_split(self.redis_url, self.children, timeout)


async def collect(stub, request, timeout=60):
    tokens, logprobs, texts, finish = [], [], [], None
    async for response in stub.Generate(request, timeout=timeout):
        for t in response.tokens:
            tokens.append(t.id)
            logprobs.append(t.logprob)
            texts.append(t.text)
        if response.HasField("finish"):
            assert finish is None, "two finish messages"
            finish = response.finish
    return tokens, logprobs, "".join(texts), finish


async def read_rest(call, head, on_message=None):
    """The rest of a stream whose first message, already read, was `head`: (tokens, logprobs, finish)."""
    tokens, logprobs, finish, response = [], [], None, head
    while response is not grpc.aio.EOF:
        tokens += [t.id for t in response.tokens]
        logprobs += [t.logprob for t in response.tokens]
        finish = response.finish if response.HasField("finish") else finish
        if on_message is not None:
            on_message()
        response = await call.read()
    return tokens, logprobs, finish


async def streams_through(stub, requests, fault, on_message=None):
    """Starts every request, waits until each has streamed its first message, calls `fault()`
    (kill or stop a worker), then reads every stream to its end: [(tokens, logprobs, finish)]."""
    calls = [stub.Generate(r, timeout=120) for r in requests]
    heads = [await call.read() for call in calls]
    fault()
    return [await read_rest(call, head, on_message) for call, head in zip(calls, heads)]


async def page_stats(addr, identity=None):
    """The kvcache's page stats per worker (over mTLS with `identity`, a tls.MeshIdentity, when the mesh has one)."""
    async with mesh_channel(addr, identity) as ch:
        return (await kvcache_pb2_grpc.KVCacheStub(ch).Stats(kvcache_pb2.StatsRequest())).workers


async def lookup(addr, hashes, identity=None):
    """kvcache's Lookup: per worker holding some, the leading pages of `hashes` it holds."""
    async with mesh_channel(addr, identity) as ch:
        return (await kvcache_pb2_grpc.KVCacheStub(ch).Lookup(kvcache_pb2.LookupRequest(hashes=hashes))).workers


async def queue_state(redis_url, until, timeout=10):
    """Requests (running plus waiting) in the schedulers' Redis queue state, once `until(n)` holds."""
    import redis.asyncio as aioredis

    r = aioredis.from_url(redis_url, decode_responses=True)
    deadline = time.monotonic() + timeout
    try:
        while True:
            keys = [k async for k in r.scan_iter(QUEUE_STATE_PATTERN)]
            states = [json.loads(v) for v in await r.mget(keys) if v] if keys else []
            n = sum(s["running"] + s["waiting"] for s in states)
            if until(n) or time.monotonic() > deadline:
                return n
            await asyncio.sleep(0.1)
    finally:
        await r.aclose()


async def wait_idle(addr, timeout=10, identity=None, workers=0):
    """Waits until no worker has pages in use (and kvcache accounts for at least `workers`
    workers: after its restart it learns them again from their schedulers); returns the last stats."""
    deadline = time.monotonic() + timeout
    at_least = workers
    while True:
        workers = await page_stats(addr, identity)
        if (len(workers) >= at_least and all(w.used_pages == 0 for w in workers)) or time.monotonic() > deadline:
            return workers
        await asyncio.sleep(0.1)


def stop_process(process) -> None:
    """SIGTERM, then SIGKILL 10 s later if it is still running (as `kvmesh up` stops its services):
    a test's teardown must not fail on a loaded machine because a process it started is slow to exit."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start_redis(port: int, folder: str, *extra: str):
    """A redis-server with `extra` settings, once its port accepts connections: its process."""
    child = redis_child(port, folder, *extra)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return child.process
        assert child.process.poll() is None, child.last_lines()
        time.sleep(0.05)
    raise TimeoutError(f"redis-server did not listen on {port}")
