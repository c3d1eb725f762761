"""`kvmesh up`: a whole local mesh as child processes, with its own redis-server unless given one.

Order: Redis, then kvcache, scheduler, workers and router together; all are waited for (gRPC
health SERVING) at once, so the first that fails at start is named within seconds, with its last
log lines. While the mesh runs, the supervisor restarts whatever dies, on the same ports.
Ctrl-C (or SIGTERM) stops every child.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.services.children import (Child, ServiceFailed, free_port, redis_child, reserve_ports, serve_command,
                                      service_child, wait_ready, worker_child)

if TYPE_CHECKING:
    from kvmesh.services.tls import MeshCertificates

__all__ = ["Child", "MeshTLS", "ServiceFailed", "free_port", "launch", "serve_command", "stop", "up",
           "wait_scheduled", "wait_serving"]

# How long each service may take to become ready at start (a worker loads its model).
READY_TIMEOUTS_S = {"redis": 10, "kvcache": 30, "scheduler": 30, "worker": 300, "router": 120}


def wait_serving(address: str, timeout_s: float, process: subprocess.Popen | None = None,
                 credentials: grpc.ChannelCredentials | None = None, options: tuple = ()) -> None:
    """Blocks until the gRPC health check at `address` answers SERVING (over TLS with `credentials`)."""
    from kvmesh.services.tls import channel as open_channel

    deadline = time.monotonic() + timeout_s
    with open_channel(address, credentials, aio=False, options=options) as channel:
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
    from kvmesh.services.redis_client import connect
    from kvmesh.services.registry import read_queue_states

    r = connect(redis_url, aio=False)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            states = read_queue_states(r)
            if sum(w["alive"] for state in states for w in state["workers"].values()) >= workers:
                return
            time.sleep(0.2)
    finally:
        r.close()
    raise TimeoutError(f"the scheduler did not reach all {workers} workers within {timeout_s:.0f}s")


def wait_split(redis_url: str, children: list[Child], timeout_s: float) -> dict[str, str]:
    """Blocks until every worker among `children` is owned and every scheduler owns one at least
    (schedulers that start together split the workers by lease), and the router has read so: it
    routes to every scheduler (`kvmesh_router_schedulers`; it reads the registry in rounds, and
    until then a request would have one scheduler to go to). Returns worker -> its scheduler."""
    from kvmesh.services.redis_client import connect
    from kvmesh.services.registry import owner_key, parse_lease

    workers = [c.name for c in children if c.service == "worker"]
    schedulers = [c.address for c in children if c.service == "scheduler"]
    router = next(c for c in children if c.service == "router")
    r = connect(redis_url, aio=False)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            owner = {w: (parse_lease(r.get(owner_key(w))) or ("", 0))[0] for w in workers}
            if set(owner.values()) == set(schedulers) and routed_schedulers(router.http) == len(schedulers):
                return owner
            time.sleep(0.2)
    finally:
        r.close()
    raise TimeoutError(f"the schedulers did not split the workers, or the router did not see it, within {timeout_s:.0f}s")


def routed_schedulers(router_http: str) -> int:
    """The schedulers a plaintext router at `router_http` routes to (summed over its pools); 0 when
    its /metrics does not answer."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(f"http://{router_http}/metrics", timeout=5).read().decode()
    except OSError:  # urllib's URLError among them
        return 0
    return int(sum(s.value for f in text_string_to_metric_families(text) if f.name == "kvmesh_router_schedulers"
                   for s in f.samples))


def check_redis(redis_url: str) -> None:
    """ServiceFailed naming the URL and the cause when the Redis at `redis_url` does not answer."""
    import redis

    from kvmesh.services.redis_client import connect, redacted

    client = connect(redis_url, aio=False, socket_connect_timeout=3, socket_timeout=3)
    try:
        client.ping()
    except redis.RedisError as e:
        raise ServiceFailed(f"redis at {redacted(redis_url)} does not answer: {e}") from None
    finally:
        client.close()


def check_router_ports(port: int, http_port: int | None) -> None:
    """ServiceFailed naming the port when a port the user chose for the router is taken: said at
    once, rather than after the other services started. Bound as the router binds (SO_REUSEADDR)."""
    for number, what in ((port, "gRPC port (--port)"), (http_port, "HTTP port (--http-port)")):
        if not number or number < 0:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", number))
            except OSError as e:
                raise ServiceFailed(f"router cannot start: its {what} 127.0.0.1:{number} is taken ({e.strerror})") from None


Pools = list[tuple[str, str | None]]  # (pool name, checkpoint folder or None for the default model)


def launch(model: "str | None | Pools", workers: int, redis_url: str | None, port: int, extra_worker: list[str] = (),
           extra_scheduler: list[str] = (), log_dir: str | None = None, http_port: int | None = None,
           extra_router: list[str] = (), env: dict[str, str] | None = None,
           extra_kvcache: list[str] = (), tls: "MeshTLS | None" = None,
           schedulers: int = 1) -> tuple[list[Child], Child | None, str]:
    """Starts the mesh and waits until it is ready; returns the children, our redis-server (None
    when `redis_url` names one) and the Redis URL. A service that fails at start raises
    ServiceFailed naming it, after everything started is stopped.

    `model` is one checkpoint folder (None: the default model) served as pool `default`, or a
    list of (pool name, folder): `schedulers` schedulers (they split the pool's workers by lease and
    adopt a dead one's) and `workers` workers per pool, one router for all.
    Every service gets a free /metrics port; the router's HTTP port is `http_port` (None: a free one).
    `env` adds variables to the services' environment (OTEL_* settings, for one); each service
    gets only the KVMESH_* variables it reads. `tls` gives every service its mesh certificate
    (mTLS) and the router's public side its own, if any."""
    tls = tls or MeshTLS()
    extra_worker, extra_scheduler = [*extra_worker, *tls.flags("worker")], [*extra_scheduler, *tls.flags("scheduler")]
    extra_router, extra_kvcache = [*extra_router, *tls.flags("router")], [*extra_kvcache, *tls.flags("kvcache")]
    log_dir = log_dir or tempfile.mkdtemp(prefix="kvmesh-up-")
    if schedulers < 1:
        raise ValueError(f"schedulers must be >= 1, got {schedulers}")
    pools: Pools = model if isinstance(model, list) else [("default", model)]
    single = len(pools) == 1 and pools[0][0] == "default"
    if not single and any(f is None for _, f in pools):
        raise ValueError("several pools need a checkpoint folder each (NAME=DIR)")
    env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1")
    children: list[Child] = []
    redis = None
    check_router_ports(port, http_port)
    reserve_ports(port, http_port)  # else a service started before the router could be given one
    try:
        if redis_url is None:
            redis = redis_child(free_port(), log_dir)
            redis_url = f"redis://{redis.address}/0"
            wait_ready([redis], READY_TIMEOUTS_S)
        else:
            check_redis(redis_url)
        children.append(service_child("kvcache", "kvcache", "", redis_url, free_port(), list(extra_kvcache), log_dir, env))
        for name, _ in pools:
            for i in range(schedulers):
                children.append(service_child(scheduler_name(name, i, schedulers, single), "scheduler", name, redis_url,
                                              free_port(), ["--pool", name, *extra_scheduler], log_dir, env))
        if schedulers > 1:  # all registered before any worker, so that they split the workers by share
            started = [c for c in children if c.service == "scheduler"]
            for child in started:
                child.health_credentials = tls.client(child.service)
            wait_ready(started, READY_TIMEOUTS_S)
        for name, folder in pools:
            for i in range(workers):
                children.append(worker_child(name, i, folder, redis_url, log_dir, env, list(extra_worker), single))
        router_model = (pools[0][1] or "") if single else ",".join(f"{n}={f}" for n, f in pools)
        children.append(service_child("router", "router", "", redis_url, port,
                                      [*(["--model", router_model] if router_model else []), *extra_router],
                                      log_dir, env, http_port))
        for child in children:
            child.health_credentials = tls.client(child.service)
        wait_ready(children, READY_TIMEOUTS_S)
        wait_scheduled(redis_url, workers * len(pools), timeout_s=60)
    except BaseException:
        stop(children, redis)
        raise
    return children, redis, redis_url


def scheduler_name(pool: str, index: int, count: int, single: bool) -> str:
    """scheduler, or scheduler-N when a pool has several; with several pools, scheduler-POOL[-N]."""
    base = "scheduler" if single else f"scheduler-{pool}"
    return base if count == 1 else f"{base}-{index}"


@dataclass(frozen=True)
class MeshTLS:
    """What `kvmesh up --tls` (and `--tls-cert`/`--tls-key`) adds to each service's command line,
    and how the launcher's own health checks reach them. Empty: everything plaintext."""

    certs: "MeshCertificates | None" = None  # mTLS inside the mesh
    public_cert: str = ""  # the router's public ports
    public_key: str = ""

    def flags(self, service: str) -> list[str]:
        flags = self.certs.flags(service) if self.certs else []
        if service == "router" and self.public_cert:
            flags += ["--tls-cert", self.public_cert, "--tls-key", self.public_key]
        return flags

    def client(self, service: str) -> tuple:
        """(credentials, channel options) for a health check of `service`'s gRPC port."""
        from kvmesh.services.tls import certificate_names, public_client_credentials

        if service == "router":
            if not self.public_cert:
                return None, ()
            # The certificate file is its own trust anchor (self-signed, or a chain up to its root),
            # checked for the first name it carries, since the launcher dials 127.0.0.1.
            with open(self.public_cert, "rb") as f:
                name = certificate_names(f.read())[0]
            return public_client_credentials(self.public_cert), (("grpc.ssl_target_name_override", name),)
        if service == "redis":
            return None, ()
        return (self.certs.identity("client").channel_credentials() if self.certs else None), ()


def stop(children: list[Child], redis: Child | None = None) -> None:
    """SIGTERM to every child (the router first), SIGKILL to any still running 10 s later; then redis-server."""
    for child in reversed(children):
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    for child in [*children, *([redis] if redis else [])]:
        if child is redis:
            child.process.terminate()
        try:
            child.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


def ensure_default_model(model: "str | None | Pools") -> None:
    """Generates the default model before the services start (once per machine), and says so."""
    from kvmesh.modelgen import default_model_dir, default_model_exists

    folders = [f for _, f in model] if isinstance(model, list) else [model]
    if None in folders and not default_model_exists():
        print("generating the default model (first start only)...", flush=True)
        default_model_dir()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def up(model: "str | None | Pools", workers: int, redis_url: str | None, port: int, http_port: int = 8000,
       autoscale: bool = False, service_args: dict[str, list[str]] | None = None, tls: bool = False,
       tls_cert: str = "", tls_key: str = "", tls_names: list[str] = (), schedulers: int = 1) -> int:
    """Runs the mesh until Ctrl-C or SIGTERM (exit code 0), restarting whatever dies. Exit code 1,
    with a message naming the service, its last log lines and its log, when a service fails at
    start or keeps failing to start again. `tls`: a private CA and a certificate per service in the
    state folder, and mTLS on every internal call; `tls_cert`/`tls_key`: TLS on the router's public
    ports (plaintext without)."""
    from kvmesh.services.redis_client import redacted
    from kvmesh.services.supervisor import Supervisor
    from kvmesh.services.tls import MeshCertificates

    args = service_args or {}
    signal.signal(signal.SIGTERM, _interrupt)  # like Ctrl-C: stop every child on the way out
    ensure_default_model(model)
    print("starting the kvmesh mesh...", flush=True)
    log_dir = tempfile.mkdtemp(prefix="kvmesh-up-")
    mesh_tls = MeshTLS(MeshCertificates.create(os.path.join(log_dir, "tls"), list(tls_names)) if tls else None,
                       tls_cert, tls_key)
    try:
        children, redis, redis_url = launch(model, workers, redis_url, port, log_dir=log_dir, http_port=http_port,
                                            extra_worker=args.get("worker", []), extra_scheduler=args.get("scheduler", []),
                                            extra_router=args.get("router", []), extra_kvcache=args.get("kvcache", []),
                                            tls=mesh_tls, schedulers=schedulers)
    except ServiceFailed as e:
        print(f"kvmesh up: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(f"redis      {redacted(redis_url)}")
    for child in children:
        print(f"{child.name:<10} gRPC {child.address}   metrics http://{child.http}/metrics")
    print(f"logs       {log_dir}")
    if mesh_tls.certs:
        print(f"mTLS       CA and service certificates in {mesh_tls.certs.folder} "
              f"(kvmesh health needs {' '.join(mesh_tls.certs.flags('client'))})")
    first = model[0][0] if isinstance(model, list) else "default"
    client_tls, scheme = (f" --tls-ca {tls_cert}", "https") if tls_cert else ("", "http")
    print(f'\nready. try:\n  kvmesh generate --addr 127.0.0.1:{port}{client_tls} --model {first} --max-new-tokens 32 "Once upon a time"\n'
          f'  curl {scheme}://127.0.0.1:{http_port}/v1/completions -H "Content-Type: application/json" '
          f"""-d '{{"model": "{first}", "prompt": "Once upon a time", "max_tokens": 32}}'\n"""
          "A service that dies is restarted on the same ports. Ctrl-C stops every service.", flush=True)
    folders = dict(model) if isinstance(model, list) else {"default": model}
    supervisor = Supervisor(children, redis_url, log_dir, autoscale,
                            extra_worker=[*args.get("worker", []), *mesh_tls.flags("worker")],
                            folders=folders, redis=redis, health_credentials=mesh_tls.client("worker"))
    code = 0
    try:
        while (fatal := supervisor.poll()) is None:
            time.sleep(0.5)
        print(f"kvmesh up: {fatal}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        pass
    finally:
        supervisor.close()
        stop(children, redis)
    return code
