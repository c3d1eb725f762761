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
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

if TYPE_CHECKING:
    from kvmesh.services.tls import MeshCertificates


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
    service: str = ""
    pool: str = ""
    argv: tuple[str, ...] = ()  # to start it again
    log_path: str = ""
    env: dict | None = None
    retired: bool = False  # stopped on purpose (autoscaling down): not restarted

    def start(self) -> None:
        """(Re)starts the process with the same command line, appending to the same log."""
        log = open(self.log_path, "a")
        self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()


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


def start_redis(port: int, workdir: str, *extra: str) -> subprocess.Popen:
    """A redis-server on 127.0.0.1:`port`; `extra` arguments come last (--requirepass, TLS settings)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not on PATH: install it (Debian/Ubuntu: apt-get install redis-server; "
                         "macOS: brew install redis) or pass --redis-url redis://HOST:PORT")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--maxmemory-policy", "noeviction", "--dir", workdir, *extra],
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


Pools = list[tuple[str, str | None]]  # (pool name, checkpoint folder or None for the default model)


def launch(model: "str | None | Pools", workers: int, redis_url: str | None, port: int, extra_worker: list[str] = (),
           extra_scheduler: list[str] = (), log_dir: str | None = None, http_port: int | None = None,
           extra_router: list[str] = (), env: dict[str, str] | None = None, tls: "MeshTLS | None" = None,
           ) -> tuple[list[Child], subprocess.Popen | None, str]:
    """Starts the mesh and waits until it is ready; returns the children, redis and its URL.

    `model` is one checkpoint folder (None: the default model) served as pool `default`, or a
    list of (pool name, folder): one scheduler and `workers` workers per pool, one router for all.
    Every service gets a free /metrics port; the router's HTTP port is `http_port` (None: a free one).
    `env` adds variables to the services' environment (OTEL_* settings, for one). `tls` gives every
    service its mesh certificate (mTLS) and the router's public side its own, if any."""
    tls = tls or MeshTLS()
    extra_worker = [*extra_worker, *tls.flags("worker")]
    extra_scheduler = [*extra_scheduler, *tls.flags("scheduler")]
    extra_router = [*extra_router, *tls.flags("router")]
    log_dir = log_dir or tempfile.mkdtemp(prefix="kvmesh-up-")
    redis_proc = None
    if redis_url is None:
        redis_port = free_port()
        redis_proc = start_redis(redis_port, log_dir)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
    pools: Pools = model if isinstance(model, list) else [("default", model)]
    single = len(pools) == 1 and pools[0][0] == "default"
    env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1")
    children: list[Child] = []
    try:
        children.append(_spawn("kvcache", "kvcache", "", redis_url, free_port(), tls.flags("kvcache"), log_dir, env))
        for name, _ in pools:
            children.append(_spawn("scheduler" if single else f"scheduler-{name}", "scheduler", name, redis_url,
                                   free_port(), ["--pool", name, *extra_scheduler], log_dir, env))
        for name, folder in pools:
            for i in range(workers):
                children.append(worker_child(name, i, folder, redis_url, log_dir, env, list(extra_worker), single))
        router_model = (pools[0][1] or "") if single else ",".join(f"{n}={f}" for n, f in pools if f)
        if not single and any(f is None for _, f in pools):
            raise ValueError("several pools need a checkpoint folder each (NAME=DIR)")
        children.append(_spawn("router", "router", "", redis_url, port, [*(["--model", router_model] if router_model else []),
                                                                         *extra_router], log_dir, env, http_port))
        for child in children:
            wait_serving(child.address, {"worker": 300, "router": 120}.get(child.service, 30), child.process,
                         *tls.client(child.service))
        wait_scheduled(redis_url, workers * len(pools), timeout_s=60)
    except BaseException:
        stop(children, redis_proc)
        raise
    return children, redis_proc, redis_url


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
        return (self.certs.identity("client").channel_credentials() if self.certs else None), ()


def worker_child(pool: str, index: int, folder: str | None, redis_url: str, log_dir: str, env: dict,
                 extra: list[str], single: bool) -> Child:
    """Starts worker `index` of a pool (named worker-N in a one-pool mesh, POOL-worker-N otherwise)."""
    name = f"worker-{index}" if single else f"{pool}-worker-{index}"
    flags = [*(["--model", folder] if folder else []), "--pool", pool, "--worker-id", name, *extra]
    return _spawn(name, "worker", pool, redis_url, free_port(), flags, log_dir, env)


def _spawn(name: str, service: str, pool: str, redis_url: str, port: int, extra: list[str], log_dir: str, env: dict,
           http_port: int | None = None) -> Child:
    http = (http_port or free_port()) if service == "router" else free_port()
    http_flag = "--http-port" if service == "router" else "--metrics-port"
    argv = tuple(serve_command(service, redis_url, port, http_flag, str(http), *extra))
    child = Child(name, f"127.0.0.1:{port}", None, f"127.0.0.1:{http}", service, pool, argv,
                  os.path.join(log_dir, f"{name}.log"), env)
    child.start()
    return child


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


def up(model: "str | None | Pools", workers: int, redis_url: str | None, port: int, batching: str = "continuous",
       http_port: int = 8000, autoscale: bool = False, extra_scheduler: list[str] = (), tls: bool = False,
       tls_cert: str = "", tls_key: str = "", tls_names: list[str] = ()) -> int:
    """`kvmesh up`. `tls`: a private CA and a certificate per service in the state folder, and mTLS on
    every internal call; `tls_cert`/`tls_key`: TLS on the router's public ports (plaintext without)."""
    from kvmesh.services.redis_client import redacted
    from kvmesh.services.tls import MeshCertificates

    print("starting the kvmesh mesh (the first start generates the default model)...", flush=True)
    log_dir = tempfile.mkdtemp(prefix="kvmesh-up-")
    mesh_tls = MeshTLS(MeshCertificates.create(os.path.join(log_dir, "tls"), list(tls_names)) if tls else None,
                       tls_cert, tls_key)
    children, redis_proc, redis_url = launch(model, workers, redis_url, port, log_dir=log_dir, http_port=http_port,
                                             extra_scheduler=["--batching", batching, *extra_scheduler], tls=mesh_tls)
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
          "Ctrl-C stops every service.", flush=True)
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    from kvmesh.services.supervisor import Supervisor

    folders = dict(model) if isinstance(model, list) else {"default": model}
    supervisor = Supervisor(children, redis_url, log_dir, autoscale, extra_worker=mesh_tls.flags("worker"), folders=folders)
    try:
        while not stopping:
            if (fatal := supervisor.poll()) is not None:
                print(fatal, file=sys.stderr)
                break
            time.sleep(0.5)
    finally:
        supervisor.close()
        stop(children, redis_proc)
    return 0
