"""The processes `kvmesh up` runs: how one is started (again), whether it serves, and what to say
when it fails.

Every child keeps its command line, ports and log file for its whole life, so a restart brings it
back where the rest of the mesh expects it. The launcher and the supervisor both build on this
module; it imports neither.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

LAST_LINES = 6  # of a failed child's log, in the message that names it


_handed_out: set[int] = set()  # ports free_port gave this process: never given twice
_draw = random.SystemRandom()  # not the random module's state, which tests seed


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections' local ports."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def reserve_ports(*ports: int | None) -> None:
    """Ports a service will bind later that free_port must not hand out meanwhile (the router's
    --port and --http-port, bound after every other service has started)."""
    _handed_out.update(p for p in ports if p and p > 0)


def free_port() -> int:
    """A port on 127.0.0.1 that is free now, for a child to bind a moment later. It is drawn below
    the kernel's range for outgoing connections where there is room: a connection any process
    opens in between takes its local port from that range, so a port from it could be gone by the
    time the child binds ("address already in use" at start, seen in the suite)."""
    low = _ephemeral_low()
    for _ in range(1000):
        port = _draw.randrange(max(1024, low - 20000), low) if low > 2048 else 0
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # something listens there
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no free port on 127.0.0.1")


@dataclass
class Child:
    name: str
    address: str  # gRPC (redis-server: its host:port)
    process: subprocess.Popen
    http: str  # /metrics (and, on the router, the HTTP API)
    service: str = ""  # router, scheduler, kvcache, worker or redis
    pool: str = ""
    argv: tuple[str, ...] = ()  # to start it again
    log_path: str = ""
    env: dict | None = None
    retired: bool = False  # stopped on purpose (autoscaling down): not restarted
    health_credentials: tuple = (None, ())  # (channel credentials, options) for its health check: mTLS

    def start(self) -> None:
        """(Re)starts the process with the same command line, appending to the same log."""
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def serving(self, timeout_s: float = 1.0) -> bool:
        """Whether it answers: gRPC health SERVING, or PONG from redis-server."""
        if self.service == "redis":
            return redis_answers(self.address, timeout_s)
        from kvmesh.services.tls import channel as open_channel

        credentials, options = self.health_credentials
        with open_channel(self.address, credentials, aio=False, options=options) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status
            except grpc.RpcError:
                return False
        return status == health_pb2.HealthCheckResponse.SERVING

    def last_lines(self, n: int = LAST_LINES) -> list[str]:
        """The last `n` non-blank lines of its log (where a Python service prints its error)."""
        try:
            with open(self.log_path, errors="replace") as log:
                lines = [line.rstrip() for line in log if line.strip()]
        except OSError:
            return []
        return lines[-n:]

    def failure(self, what: str) -> str:
        """`what` happened to this child, with its last log lines and the log's path."""
        lines = "".join(f"\n  | {line}" for line in self.last_lines())
        return f"{self.name} {what}{lines}\n  log: {self.log_path}"


class ServiceFailed(RuntimeError):
    """A child exited or did not become ready at start; the message names it, the cause and its log."""


def redis_answers(address: str, timeout_s: float) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def wait_ready(children: list["Child"], timeouts_s: dict[str, float], default_s: float = 30.0) -> None:
    """Blocks until every child serves, checking them all in turn, so that the first one to exit
    (a port in use, a bad setting) is reported at once: ServiceFailed naming it. `timeouts_s` gives
    per service how long it may take to become ready."""
    started = time.monotonic()
    pending = list(children)
    while pending:
        for child in list(pending):
            if child.process.poll() is not None:
                raise ServiceFailed(child.failure(f"failed at start (exit code {child.process.returncode})"))
            if child.serving(timeout_s=0.5):
                pending.remove(child)
            elif time.monotonic() - started > timeouts_s.get(child.service, default_s):
                limit = timeouts_s.get(child.service, default_s)
                raise ServiceFailed(child.failure(f"was not ready within {limit:.0f}s"))
        if pending:
            time.sleep(0.2)


def redis_command(port: int, workdir: str, *extra: str) -> list[str]:
    """redis-server on 127.0.0.1:`port`; `extra` arguments come last (--requirepass, TLS settings)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not on PATH: install it (Debian/Ubuntu: apt-get install redis-server; "
                         "macOS: brew install redis) or pass --redis-url redis://HOST:PORT")
    return [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--maxmemory-policy", "noeviction", "--dir", workdir, *extra]


def redis_child(port: int, log_dir: str, *extra: str) -> Child:
    """A redis-server of our own (no persistence: a restart starts empty, and services re-register)."""
    child = Child("redis", f"127.0.0.1:{port}", None, "", "redis", argv=tuple(redis_command(port, log_dir, *extra)),
                  log_path=os.path.join(log_dir, "redis.log"))
    child.start()
    return child


def serve_command(service: str, redis_url: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvmesh.cli", "serve", service, "--redis-url", redis_url, "--port", str(port), *extra]


def service_child(name: str, service: str, pool: str, redis_url: str, port: int, extra: list[str], log_dir: str,
                  env: dict, http_port: int | None = None) -> Child:
    """Starts `kvmesh serve SERVICE` with the KVMESH_* variables of `env` that this service reads."""
    from kvmesh.services.config import service_environment

    http = (http_port or free_port()) if service == "router" else free_port()
    http_flag = "--http-port" if service == "router" else "--metrics-port"
    argv = tuple(serve_command(service, redis_url, port, http_flag, str(http), *extra))
    child = Child(name, f"127.0.0.1:{port}", None, f"127.0.0.1:{http}", service, pool, argv,
                  os.path.join(log_dir, f"{name}.log"), service_environment(service, env or dict(os.environ)))
    child.start()
    return child


def worker_child(pool: str, index: int, folder: str | None, redis_url: str, log_dir: str, env: dict,
                 extra: list[str], single: bool) -> Child:
    """Starts worker `index` of a pool (named worker-N in a one-pool mesh, POOL-worker-N otherwise)."""
    name = f"worker-{index}" if single else f"{pool}-worker-{index}"
    flags = [*(["--model", folder] if folder else []), "--pool", pool, "--worker-id", name, *extra]
    return service_child(name, "worker", pool, redis_url, free_port(), flags, log_dir, env)
