"""`kvmesh up`: a whole local mesh as child processes, with its own redis-server unless given one.

Order: Redis, kvcache, scheduler, workers, router; each is waited for (gRPC health SERVING)
before the summary is printed. Ctrl-C (or SIGTERM) stops every child.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Child:
    name: str
    address: str  # gRPC
    process: subprocess.Popen
    http: str  # /metrics (and, on the router, the HTTP API)


def wait_serving(address: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    """Blocks until the gRPC health check at `address` answers SERVING."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{address}: process exited with code {process.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} was not SERVING within {timeout_s:.0f}s")


def wait_scheduled(redis_url: str, workers: int, timeout_s: float) -> None:
    """Blocks until the scheduler's published queue state shows `workers` live workers."""
    import json

    import redis

    from kvmesh.services.registry import QUEUE_STATE_PATTERN

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            keys = list(r.scan_iter(QUEUE_STATE_PATTERN))
            states = [json.loads(v) for v in r.mget(keys) if v] if keys else []
            if sum(w["alive"] for state in states for w in state["workers"].values()) >= workers:
                return
            time.sleep(0.2)
    finally:
        r.close()
    raise TimeoutError(f"the scheduler did not reach all {workers} workers within {timeout_s:.0f}s")


def start_redis(port: int, workdir: str) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not on PATH: install it (Debian/Ubuntu: apt-get install redis-server; "
                         "macOS: brew install redis) or pass --redis-url redis://HOST:PORT")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--maxmemory-policy", "noeviction", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server did not start on port {port}")


def serve_command(service: str, redis_url: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvmesh.cli", "serve", service, "--redis-url", redis_url, "--port", str(port), *extra]


def launch(model: str | None, workers: int, redis_url: str | None, port: int, extra_worker: list[str] = (),
           extra_scheduler: list[str] = (), log_dir: str | None = None, http_port: int | None = None,
           extra_router: list[str] = (), env: dict[str, str] | None = None) -> tuple[list[Child], subprocess.Popen | None, str]:
    """Starts the mesh and waits until it is ready; returns the children, redis and its URL.
    Every service gets a free /metrics port; the router's HTTP port is `http_port` (None: a free one).
    `env` adds variables to the services' environment (OTEL_* settings, for one)."""
    log_dir = log_dir or tempfile.mkdtemp(prefix="kvmesh-up-")
    redis_proc = None
    if redis_url is None:
        redis_port = free_port()
        redis_proc = start_redis(redis_port, log_dir)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
    model_flags = ["--model", model] if model else []
    plan = [("kvcache", free_port(), [], 30), ("scheduler", free_port(), list(extra_scheduler), 30)]
    plan += [(f"worker-{i}", free_port(), [*model_flags, "--worker-id", f"worker-{i}", *extra_worker], 300) for i in range(workers)]
    plan += [("router", port, [*model_flags, *extra_router], 120)]
    children: list[Child] = []
    env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1")
    try:
        for name, p, extra, timeout in plan:
            service = name.split("-")[0]
            http = (http_port or free_port()) if service == "router" else free_port()
            http_flag = "--http-port" if service == "router" else "--metrics-port"
            log = open(os.path.join(log_dir, f"{name}.log"), "w")
            proc = subprocess.Popen(serve_command(service, redis_url, p, http_flag, str(http), *extra),
                                    stdout=log, stderr=subprocess.STDOUT, env=env)
            children.append(Child(name, f"127.0.0.1:{p}", proc, f"127.0.0.1:{http}"))
        for child, (_, _, _, timeout) in zip(children, plan):
            wait_serving(child.address, timeout, child.process)
        wait_scheduled(redis_url, workers, timeout_s=60)
    except BaseException:
        stop(children, redis_proc)
        raise
    return children, redis_proc, redis_url


def stop(children: list[Child], redis_proc: subprocess.Popen | None) -> None:
    for child in reversed(children):
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    for child in children:
        try:
            child.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.process.kill()
    if redis_proc is not None:
        redis_proc.terminate()
        redis_proc.wait(timeout=10)


def up(model: str | None, workers: int, redis_url: str | None, port: int, batching: str = "continuous",
       http_port: int = 8000) -> int:
    print("starting the kvmesh mesh (the first start generates the default model)...", flush=True)
    log_dir = tempfile.mkdtemp(prefix="kvmesh-up-")
    children, redis_proc, redis_url = launch(model, workers, redis_url, port, log_dir=log_dir,
                                             extra_scheduler=["--batching", batching], http_port=http_port)
    print(f"redis      {redis_url}")
    for child in children:
        print(f"{child.name:<10} gRPC {child.address}   metrics http://{child.http}/metrics")
    print(f"logs       {log_dir}")
    print(f'\nready. try:\n  kvmesh generate --addr 127.0.0.1:{port} --max-new-tokens 32 "Once upon a time"\n'
          f'  curl http://127.0.0.1:{http_port}/v1/completions -H "Content-Type: application/json" '
          f"""-d '{{"model": "default", "prompt": "Once upon a time", "max_tokens": 32}}'\n"""
          "Ctrl-C stops every service.", flush=True)
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while not stopping:
            dead = [c for c in children if c.process.poll() is not None]
            if dead:
                print(f"{dead[0].name} exited with code {dead[0].process.returncode}; see {log_dir}", file=sys.stderr)
                break
            time.sleep(0.5)
    finally:
        stop(children, redis_proc)
    return 0
