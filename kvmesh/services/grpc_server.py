"""What every service's gRPC server has: grpc.health.v1 (NOT_SERVING until ready) and reflection."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.telemetry import shutdown_tracing

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ServiceServer:
    """A grpc.aio server with health and reflection; `port` is the bound port (0 picks one).
    With `credentials` it listens with TLS (kvmesh.services.tls: mTLS inside the mesh), else plaintext."""

    def __init__(self, service_names: list[str], add_servicers: Callable[[grpc.aio.Server], None], host: str, port: int,
                 credentials: grpc.ServerCredentials | None = None):
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        add_servicers(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = service_names
        reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        address = f"{host}:{port}"
        try:
            self.port = (self.server.add_secure_port(address, credentials) if credentials
                         else self.server.add_insecure_port(address))
        except RuntimeError:  # grpc's "Failed to bind"
            self.port = 0
        if self.port == 0:
            raise OSError(errno.EADDRINUSE, f"cannot serve gRPC on {host}:{port} (--port): the address is in use or not local")

    async def start(self) -> None:
        await self.server.start()
        await self.set_serving(False)

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace: float = 2.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


async def wait_for_termination(stop: Callable[[], "asyncio.Future | None"]) -> None:
    """Runs until SIGINT or SIGTERM, then awaits `stop()`."""
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    await stop()


def advertised_address(common, port: int) -> str:
    """host:port that other services use: --advertise-host, else the listen host, else the hostname."""
    host = common.advertise_host or (common.host if common.host not in ("0.0.0.0", "::", "") else socket.gethostname())
    return f"{host}:{port}"


async def serve_until_stopped(server: ServiceServer, registry, kind: str, instance_id: str, record: dict,
                              *, tasks: tuple = (), serving: bool = True, cleanups: tuple = ()) -> None:
    """Registers the service's lease, turns SERVING (unless the service decides readiness itself),
    runs until SIGINT or SIGTERM, then stops background tasks, the lease, the server, runs the
    `cleanups` (async callables) and flushes queued spans."""
    await registry.register(kind, instance_id, {"pid": os.getpid(), **record})
    if serving:
        await server.set_serving(True)

    async def stop():
        for task in tasks:
            task.cancel()
        await registry.deregister(kind, instance_id)
        await registry.close()
        await server.stop()
        for cleanup in cleanups:
            await cleanup()
        shutdown_tracing()

    await wait_for_termination(stop)
